"""The validation loss and perplexity of a model on a dataset's held-out samples, as a training run measures it.

recipes.eval with `dataset.val_split=` (or `dataset.val_path=`) holds out the same samples a training run with the
same dataset settings and seed holds out, and sums the cross-entropy over their target tokens (the prompt masked
as in training) divided by their count: the run's `eval_loss`, on the model it wrote (tests/test_eval.py).
"""

import math
import time

import torch

from moai_recipes.data.datasets import collate
from moai_recipes.inference.loading import whole_sequence_logits
from moai_recipes.models.loss import IGNORE_INDEX, cross_entropy_sum


@torch.no_grad()
def validation_loss(model: torch.nn.Module, dataset, *, batch_size: int, pad_id: int, device: torch.device) -> dict:
    """{"eval_loss", "perplexity", "samples", "target_tokens", "eval_time_s"} over every sample of `dataset`."""
    start = time.perf_counter()
    total, targets = 0.0, 0
    for first in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(first, min(first + batch_size, len(dataset)))], pad_id=pad_id)
        tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
        total += float(cross_entropy_sum(whole_sequence_logits(model, tokens), labels))
        targets += int((labels != IGNORE_INDEX).sum())
    loss = total / max(targets, 1)
    return {"eval_loss": loss, "perplexity": math.exp(loss), "samples": len(dataset), "target_tokens": targets,
            "eval_time_s": time.perf_counter() - start}
