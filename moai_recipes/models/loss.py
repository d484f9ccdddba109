"""The training loss: cross-entropy summed over the target tokens (the step divides by the global count).

With a large vocabulary the logits dominate a step's memory: 8K tokens x 128K entries are 4 GB in
fp32, and the loss's backward holds two or three such tensors. `chunked=True` never makes them
whole: the model stops after its last layer, and the final norm, the output projection and the loss
run on CHUNK_TOKENS tokens at a time, each chunk recomputed in the backward pass (one extra forward
of the output projection: about 2% of a Llama-3-8B step). The norm works token by token, so it
chunks exactly, and its backward's fp32 temporaries stay a chunk's size too. The loss and the
gradients are the same.
Test: `python -m pytest tests/test_loss.py -q`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # a label that is not a target (prompt, padding, the last position)
# Tokens per chunk of the chunked loss: small enough that a chunk's logits are a fraction of a GB with a
# 128K vocabulary, large enough that the output projection's matmuls stay efficient.
CHUNK_TOKENS = 1024


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the cross-entropy over target tokens, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cross_entropy_sum(head(hidden), labels), CHUNK_TOKENS tokens at a time, each chunk recomputed in the
    backward pass so that only one chunk's logits ever exist. `head` must work token by token."""
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(CHUNK_TOKENS), labels.split(CHUNK_TOKENS)):
        total = total + checkpoint(lambda h, y: cross_entropy_sum(head(h), y), h, y, use_reentrant=False)
    return total


def token_loss_sum(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, *, chunked: bool = False,
                   documents=None) -> torch.Tensor:
    """The summed loss of a torchtune decoder on a micro-batch; `chunked` never materialises all logits.
    `documents` (models.attention.Documents): `tokens` is one packed row of them, each attending to itself."""
    kwargs = {} if documents is None else {"mask": documents, "input_pos": documents.positions(tokens.device)}
    if not chunked:
        return cross_entropy_sum(model(tokens, **kwargs), labels)
    from moai_recipes.models.build import head_skipped

    with head_skipped(model):
        hidden = model(tokens, **kwargs)
    return chunked_cross_entropy_sum(lambda h: model.output(model.norm(h)), hidden, labels)
