"""The pieces of a training step that every recipe shares: optimizer, schedule, the step itself.

A step runs the global batch as micro-batches on every rank and normalises the loss by the number
of target tokens in the WHOLE global batch, so the loss and the gradients are the same whatever
the flavor, the micro-batch size or the number of accumulation steps.
"""

import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moai_recipes.batching import GlobalBatches, split_micro_batches
from moai_recipes.data import IGNORE_INDEX, collate
from moai_recipes.launch import World

# An empty slot still runs forward and backward (FSDP's collectives must match on every rank),
# on one padding token whose label is ignored: it adds nothing to the loss or the gradients.
_EMPTY = {"tokens": None, "labels": [IGNORE_INDEX]}


def build_optimizer(params, *, lr: float, betas, eps: float, weight_decay: float, device: torch.device):
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **impl)


def build_scheduler(optimizer, *, warmup_steps: int, total_steps: int):
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)


def token_loss_sum(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the cross-entropy over target tokens; the caller divides by the global count."""
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass
class StepResult:
    loss: float  # mean over the target tokens of the global batch
    tokens: int  # tokens processed (padding excluded), global
    target_tokens: int
    grad_norm: float


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def train_step(model: nn.Module, optimizer, dataset, batches: GlobalBatches, step: int, *, micro_batch_size: int,
               max_grad_norm: float | None, world: World, pad_id: int) -> StepResult:
    """One optimizer step on the global batch of `step` (0-based)."""
    slots = batches.rank_slots(step, rank=world.rank, world_size=world.world_size)
    samples = [dataset[i] if i is not None else {**_EMPTY, "tokens": [pad_id]} for i in slots]
    local_targets = sum(sum(1 for t in s["labels"] if t != IGNORE_INDEX) for s in samples)
    local_tokens = sum(len(s["tokens"]) for s, i in zip(samples, slots) if i is not None)
    global_targets, global_tokens = _all_reduce([local_targets, local_tokens], world.device)
    # FSDP averages gradients over ranks; scaling by world size makes that a sum over the global batch.
    scale = world.world_size / max(global_targets, 1)
    loss_sum = torch.zeros((), device=world.device, dtype=torch.float64)
    for micro in split_micro_batches(samples, micro_batch_size):
        batch = collate(micro, pad_id=pad_id)
        tokens, labels = batch["tokens"].to(world.device), batch["labels"].to(world.device)
        loss = token_loss_sum(model, tokens, labels)
        (loss * scale).backward()
        loss_sum += loss.detach().double()
    grad_norm = clip_gradients(model, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    (total_loss,) = _all_reduce([loss_sum.item()], world.device)
    return StepResult(loss=total_loss / max(global_targets, 1), tokens=int(global_tokens),
                      target_tokens=int(global_targets), grad_norm=grad_norm)


def clip_gradients(model: nn.Module, max_norm: float | None) -> float:
    """Clip to `max_norm` (None: measure only) and return the total gradient norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, norm)
    return float(norm)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: allocated device memory on a GPU, resident memory on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def max_over_ranks(value: float, world: World) -> float:
    return _all_reduce([value], world.device, op=dist.ReduceOp.MAX)[0]


def train_loop(model: nn.Module, optimizer, scheduler, inputs, *, micro_batch_size: int, max_grad_norm: float | None,
               world: World, log) -> None:
    """Run every step of the run: the same global batch, loss and gradients on any flavor."""
    model.train()
    for step in range(inputs.total_steps):
        with StepTimer(world.device) as timer:
            result = train_step(model, optimizer, inputs.dataset, inputs.batches, step, micro_batch_size=micro_batch_size,
                                max_grad_norm=max_grad_norm, world=world, pad_id=inputs.tokenizer.pad_id)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        peak = max_over_ranks(peak_memory_bytes(world.device), world)
        if log:
            log.step(step=step + 1, loss=result.loss, lr=lr, tokens=result.tokens,
                     tokens_per_sec=result.tokens / timer.seconds, step_time_s=timer.seconds,
                     grad_norm=result.grad_norm, peak_memory_bytes=int(peak), target_tokens=result.target_tokens)
    model.eval()


class StepTimer:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.start
