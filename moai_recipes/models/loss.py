"""The training loss: cross-entropy summed over the target tokens (the step divides by the global count).

With a large vocabulary the logits dominate a step's memory: 8K tokens x 128K entries are 4 GB in fp32, and the
loss's backward holds two or three such tensors. `chunked=True` never makes them whole: the model stops after its
last layer and the final norm runs whole (token by token: it chunks exactly, and its activations are a hidden
state's size); then the output projection and the loss run CHUNK_TOKENS tokens at a time in one pass that also
computes their gradients (the softmax minus the one-hot target, times the weight for the hidden states' gradient,
times the hidden states for the weight's), as Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy do.
Only one chunk's logits ever exist, in fp32, and nothing is recomputed in the backward: it scales the gradients
already computed by the loss's gradient. The loss and the gradients are the same as the whole computation's.
(An output projection with LoRA adapters, lora.apply_to_output, runs its chunks through the module instead, each
recomputed in the backward.)
Test: `python -m pytest tests/test_loss.py -q`; `bench/fused_loss.py` measures it.
"""

import sys

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


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over the target rows of cross_entropy(hidden @ weight.T, labels), chunk by chunk, its gradients made in
    the forward pass and kept until the backward, which only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight's gradient accumulates over the chunks in fp32 (a bf16 sum of many chunks would lose bits).
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            target = y != IGNORE_INDEX
            logits = (h @ weight.T).float()  # [chunk, vocabulary]: the only logits there are
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, y.clamp(min=0)[:, None])[:, 0]
            total += ((lse - picked) * target).sum()
            # d(sum of losses)/d(logits) = softmax - one_hot(target), 0 on the rows that are not targets: in place.
            grad = logits.sub_(lse[:, None]).exp_()
            grad.mul_(target[:, None]).scatter_add_(1, y.clamp(min=0)[:, None], -target[:, None].to(grad.dtype))
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = grad @ weight
            if grad_weight is not None:
                if h.dtype == torch.float32:
                    grad_weight.addmm_(grad.T, h)
                else:
                    grad_weight += (grad.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Scaled in place (one backward uses them, once): no second weight-sized tensor where the dtypes agree.
        scale = lambda g, dtype: None if g is None else (g.mul_(grad_total) if g.dtype == dtype  # noqa: E731
                                                         else (g * grad_total).to(dtype))
        return scale(grad_hidden, grad_hidden.dtype if grad_hidden is not None else None), \
            scale(grad_weight, ctx.weight_dtype), None, None


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight.T, labels) with only `chunk` tokens' logits at a time, the gradients
    computed in the same pass (a fused linear cross-entropy)."""
    return _FusedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk)


def _checkpointed_chunks(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cross_entropy_sum(head(hidden), labels), CHUNK_TOKENS tokens at a time, each chunk recomputed in the backward:
    for an output projection that is more than a weight (LoRA adapters on it)."""
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(CHUNK_TOKENS), labels.split(CHUNK_TOKENS)):
        total = total + checkpoint(lambda h, y: cross_entropy_sum(head(h), y), h, y, use_reentrant=False)
    return total


def output_weight(model: nn.Module) -> torch.Tensor | None:
    """The output projection's weight (tied: the embedding's); None where the projection has adapters of its own or
    the model does more to its logits (soft-capping, a scale: models/transformers_model.py)."""
    if not getattr(model, "plain_head", True):
        return None
    out = model.output
    # A TiedLinear exists only once torchtune's modules are imported (a model built of them): not imported here for
    # a model of transformers' modules, whose dry run never needs torchtune (it imports torchao: 1.3 s of 19).
    modules = sys.modules.get("torchtune.modules")
    if modules is not None and isinstance(out, modules.TiedLinear):
        return out.tied_module.weight
    return out.weight if type(out) is nn.Linear else None


def token_loss_sum(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, *, chunked: bool = False,
                   documents=None, images: dict | None = None) -> torch.Tensor:
    """The summed loss of a torchtune decoder on a micro-batch; `chunked` never materialises all logits.
    `documents` (models.attention.Documents): `tokens` is one packed row of them, each attending to itself.
    `images`: an image-text model's inputs for the rows' images (data/images.collate_images)."""
    kwargs = {} if documents is None else {"mask": documents, "input_pos": documents.positions(tokens.device)}
    if images:
        kwargs["images"] = {k: v.to(tokens.device) for k, v in images.items()}
    if not chunked:
        return cross_entropy_sum(model(tokens, **kwargs), labels)
    from moai_recipes.models.build import head_skipped

    with head_skipped(model):
        hidden = model(tokens, **kwargs)
    return head_loss_sum(model, hidden, labels, chunked=True)


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm and the output projection of the last layer's hidden states, and whatever the model does to
    its logits after (transformers' modules: TransformersDecoder.logits)."""
    normed = model.norm(hidden)
    return model.logits(normed) if hasattr(model, "logits") else model.output(normed)


def head_loss_sum(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, chunked: bool) -> torch.Tensor:
    """The final norm, the output projection and the loss on the last layer's hidden states: whole, or chunked."""
    if not chunked:
        return cross_entropy_sum(head_logits(model, hidden).float(), labels)
    weight = output_weight(model)
    if weight is None:
        return _checkpointed_chunks(lambda h: head_logits(model, h), hidden, labels)
    return chunked_cross_entropy_sum(model.norm(hidden), weight, labels)
