"""The pieces of a training step that every recipe shares: optimizer, schedule, the step itself.

A step runs the global batch as micro-batches on every rank and normalises the loss by the number
of target tokens in the WHOLE global batch, so the loss and the gradients are the same whatever
the flavor, the micro-batch size or the number of accumulation steps.
"""

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moai_recipes.checkpoint.steps import (
    complete_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from moai_recipes.data.batches import GlobalBatches, split_micro_batches
from moai_recipes.data.datasets import collate
from moai_recipes.errors import UserError
from moai_recipes.launch.world import World
from moai_recipes.train.loss import IGNORE_INDEX, token_loss_sum
from moai_recipes.train.optim import clip_gradients
from moai_recipes.train.peak_memory import peak_memory_bytes

# An empty slot still runs forward and backward (FSDP's collectives must match on every rank),
# on one padding token whose label is ignored: it adds nothing to the loss or the gradients.
_EMPTY = {"tokens": None, "labels": [IGNORE_INDEX]}



@dataclass
class StepResult:
    loss: float  # mean over the target tokens of the global batch
    tokens: int  # tokens processed (padding excluded), global
    target_tokens: int
    grad_norm: float
    finite: bool


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def train_step(model: nn.Module, optimizer, dataset, batches: GlobalBatches, step: int, *, micro_batch_size: int,
               chunked_loss: bool, max_grad_norm: float | None, world: World, pad_id: int) -> StepResult:
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
        loss = token_loss_sum(model, tokens, labels, chunked=chunked_loss)
        (loss * scale).backward()
        loss_sum += loss.detach().double()
    (total_loss,) = _all_reduce([loss_sum.item()], world.device)
    grad_norm = clip_gradients(model, max_grad_norm)
    finite = math.isfinite(total_loss) and math.isfinite(grad_norm)  # the same verdict on every rank
    if finite:  # a NaN/inf step is never applied: the weights stay those of the last good step
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=total_loss / max(global_targets, 1), tokens=int(global_tokens),
                      target_tokens=int(global_targets), grad_norm=grad_norm, finite=finite)


class Stopped(Exception):
    """The run stopped at a step boundary on SIGTERM or SIGINT, after saving a checkpoint."""

    def __init__(self, step: int, checkpoint: Path, signame: str):
        super().__init__(f"{signame}: stopped after step {step}; the state is saved in {checkpoint}. "
                         "Run the same command again to resume (resume=auto)")
        self.step, self.checkpoint = step, checkpoint


class _StopRequest:
    """Turns SIGTERM/SIGINT into a request honoured at the next step boundary (preemption, Ctrl-C)."""

    def __enter__(self):
        self.signame = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        self.signame = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)


def train_loop(model: nn.Module, optimizer, scheduler, inputs, *, micro_batch_size: int, chunked_loss: bool,
               max_grad_norm: float | None, world: World, log, checkpoint_every: int | None, checkpoint_keep: int,
               skip_nonfinite_steps: int, plan: dict, flavor: str) -> None:
    """Run the run's steps, resuming from `inputs.resume_from`: the same global batches on any flavor.

    Saves a checkpoint every `checkpoint_every` steps and when asked to stop; stops with a UserError
    naming the step after more than `skip_nonfinite_steps` steps with a NaN/inf loss or gradient.
    """
    first = 0
    if inputs.resume_from is not None:
        meta = load_checkpoint(inputs.resume_from, model=model, optimizer=optimizer, scheduler=scheduler, world=world)
        first = meta["step"]
        assert meta["samples_seen"] == inputs.batches.samples_before(first)
        if log:
            log.info(f"Resumed from {inputs.resume_from} (step {first}, saved on {meta['flavor']} with "
                     f"{meta['world_size']} process(es)); continuing at step {first + 1}")
    save = lambda step: save_checkpoint(inputs.out, step=step, samples_seen=inputs.batches.samples_before(step),
                                        model=model, optimizer=optimizer, scheduler=scheduler, world=world,
                                        plan=plan, flavor=flavor, keep=checkpoint_keep)
    nonfinite = 0
    model.train()
    with _StopRequest() as stop:
        for step in range(first, inputs.total_steps):
            with StepTimer(world.device) as timer:
                result = train_step(model, optimizer, inputs.dataset, inputs.batches, step,
                                    micro_batch_size=micro_batch_size, chunked_loss=chunked_loss,
                                    max_grad_norm=max_grad_norm, world=world,
                                    pad_id=inputs.tokenizer.pad_id)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
            if not result.finite:
                nonfinite += 1
                last = complete_checkpoints(inputs.out)
                if nonfinite > skip_nonfinite_steps:
                    raise UserError(f"step {step + 1}: the loss or the gradient is not finite (loss {result.loss}, "
                                    f"grad norm {result.grad_norm}); stopped without applying it. "
                                    f"{f'The last good checkpoint is {last[-1]}. ' if last else ''}"
                                    "Lower optimizer.lr, or tolerate such steps with skip_nonfinite_steps=K")
            # One collective for both: the peak of any rank, and whether any rank was asked to stop.
            peak, stopping = _all_reduce([peak_memory_bytes(world.device), float(stop.signame is not None)],
                                         world.device, op=dist.ReduceOp.MAX)
            if log:
                log.step(step=step + 1, loss=result.loss, lr=lr, tokens=result.tokens,
                         tokens_per_sec=result.tokens / timer.seconds, step_time_s=timer.seconds,
                         grad_norm=result.grad_norm, peak_memory_bytes=int(peak), target_tokens=result.target_tokens,
                         skipped=not result.finite)
            done = step + 1
            if stopping or (checkpoint_every and done % checkpoint_every == 0 and done < inputs.total_steps):
                path, seconds, size = save(done)
                if log:
                    log.checkpoint(step=done, path=path, seconds=seconds, size=size)
                if stopping:
                    raise Stopped(done, path, stop.signame or "SIGTERM")
    if log and log.rows and "predicted_peak_bytes" in plan:
        measured, predicted = max(r["peak_memory_bytes"] for r in log.rows), plan["predicted_peak_bytes"]
        log.info(f"Peak memory per device: predicted {predicted / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB "
                 f"({(measured - predicted) / max(predicted, 1):+.1%})")
        log.summary(predicted_peak_bytes=predicted, measured_peak_bytes=measured)
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
