"""The training loop every recipe runs: global batch -> this rank's share -> micro-batches -> optimizer step.

A step runs the global batch as micro-batches on every rank and normalises the loss by the number
of target tokens in the WHOLE global batch, so the loss and the gradients are the same whatever
the flavor, the micro-batch size or the number of accumulation steps. The Plan alone decides how the
global batch splits into ranks and micro-batches.
"""

import gc
import math
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from moai_recipes.checkpoint.run_folder import complete_checkpoints
from moai_recipes.checkpoint.steps import TrainState, load_checkpoint, save_checkpoint
from moai_recipes.errors import Stopped, UserError
from moai_recipes.launch.host_allocator import keep_freed_memory_for
from moai_recipes.launch.world import World
from moai_recipes.planner.plan import Plan
from moai_recipes.planner.search import PlanChoice
from moai_recipes.run_inputs import RunInputs
from moai_recipes.train.loss import IGNORE_INDEX, token_loss_sum
from moai_recipes.train.micro_batches import (
    micro_batch_shapes,
    model_inputs,
    rank_micro_batches,
)
from moai_recipes.train.optim import clip_gradients
from moai_recipes.train.out_of_memory import (
    injected_fault,
    is_out_of_memory,
    release_memory,
    restart_smaller,
    smaller_plan,
)
from moai_recipes.train.parallel import all_reduce_gradients
from moai_recipes.train.peak_memory import PeakMemory, host_peak_bytes
from moai_recipes.train.plan_accuracy import Measured, compare, record
from moai_recipes.train.run_log import RunLog


@dataclass(frozen=True)
class LoopSettings:
    """What the user sets about the loop itself (not about the model, the data or the plan)."""

    max_grad_norm: float | None  # None: no clipping
    checkpoint_every: int | None  # steps; None: only when asked to stop
    checkpoint_keep: int
    skip_nonfinite_steps: int  # NaN/inf steps tolerated (skipped) before stopping
    eval_every: int | None = None  # steps between validation losses; None: at the end only

    @classmethod
    def from_config(cls, cfg) -> "LoopSettings":
        return cls(max_grad_norm=cfg.optimizer.max_grad_norm, checkpoint_every=cfg.checkpoint_every,
                   checkpoint_keep=cfg.checkpoint_keep, skip_nonfinite_steps=cfg.skip_nonfinite_steps,
                   eval_every=cfg.eval_every)


@dataclass
class StepResult:
    loss: float  # mean over the target tokens of the global batch
    tokens: int  # tokens processed (padding excluded), global
    target_tokens: int
    grad_norm: float
    finite: bool


class StepOutOfMemory(Exception):
    """A step's forward or backward ran out of memory before anything was applied."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def evaluate(model: torch.nn.Module, dataset, *, plan: Plan, world: World, batch_size: int, pad_id: int) -> dict:
    """The validation loss: every sample of `dataset` in order, a global batch at a time split as the plan splits
    training's, forward only, normalised by the target tokens of the whole set. The same on any flavor.
    Returns {"eval_loss": ..., "eval_time_s": ...}."""
    start = time.perf_counter()
    model.eval()
    loss_sum, targets = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(dataset), batch_size):
            samples = [dataset[i] for i in range(first, min(first + batch_size, len(dataset)))]
            for micro in rank_micro_batches(plan, samples, world):
                batch = model_inputs(micro, plan, pad_id)
                labels = batch["labels"].to(world.device)
                loss = token_loss_sum(model, batch["tokens"].to(world.device), labels, chunked=plan.chunked_loss,
                                      documents=batch.get("documents"))
                loss_sum += loss.double().item()
                targets += int((labels != IGNORE_INDEX).sum())
    model.train()
    total, total_targets = _all_reduce([loss_sum, targets], world.device)
    return {"eval_loss": total / max(total_targets, 1), "eval_time_s": time.perf_counter() - start}


def train_step(state: TrainState, micro_batches: list[list[dict] | None], *, plan: Plan, world: World,
               max_grad_norm: float | None, pad_id: int) -> StepResult:
    """One optimizer step on this rank's micro-batches (rank_micro_batches)."""
    samples = [s for micro in micro_batches if micro for s in micro]
    local_targets = sum(sum(1 for t in s["labels"] if t != IGNORE_INDEX) for s in samples)
    local_tokens = sum(len(s["tokens"]) for s in samples)
    global_targets, global_tokens = _all_reduce([local_targets, local_tokens], world.device)
    # FSDP averages gradients over ranks: scaling by world size makes that a sum over the global batch. Replicas
    # (and one process) sum them (all_reduce_gradients).
    scale = (world.world_size if plan.sharded else 1) / max(global_targets, 1)
    loss_sum = torch.zeros((), device=world.device, dtype=torch.float64)
    try:
        for micro in micro_batches:
            batch = model_inputs(micro, plan, pad_id)
            injected_fault(batch["tokens"].numel())
            docs = batch.get("documents")
            loss = token_loss_sum(state.model, batch["tokens"].to(world.device), batch["labels"].to(world.device),
                                  chunked=plan.chunked_loss, documents=docs)
            (loss * scale).backward()
            loss_sum += loss.detach().double()
    except Exception as e:  # nothing is applied yet: the step can run again (out_of_memory.py)
        if is_out_of_memory(e):
            raise StepOutOfMemory(e) from e
        raise
    if plan.replicate:
        all_reduce_gradients(state.model)
    (total_loss,) = _all_reduce([loss_sum.item()], world.device)
    grad_norm = clip_gradients(state.model, max_grad_norm)
    finite = math.isfinite(total_loss) and math.isfinite(grad_norm)  # the same verdict on every rank
    if finite:  # a NaN/inf step is never applied: the weights stay those of the last good step
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=total_loss / max(global_targets, 1), tokens=int(global_tokens),
                      target_tokens=int(global_targets), grad_norm=grad_norm, finite=finite)


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


def train_loop(state: TrainState, inputs: RunInputs, choice: PlanChoice, settings: LoopSettings, world: World,
               log: RunLog | None) -> None:
    """Run the run's steps as `choice` planned them, resuming from `inputs.resume_from`: the same global
    batches on any flavor.

    Saves a checkpoint every `settings.checkpoint_every` steps and when asked to stop; stops with a UserError
    naming the step after more than `settings.skip_nonfinite_steps` steps with a NaN/inf loss or gradient.
    """
    plan, batches = choice.chosen.plan, inputs.batches
    first = 0
    if inputs.resume_from is not None:
        meta = load_checkpoint(inputs.resume_from, state, world)
        first = meta["step"]
        batches.resume(first, meta)
        if log:
            log.info(f"Resumed from {inputs.resume_from} (step {first}, saved on {meta['flavor']} with "
                     f"{meta['world_size']} process(es)); continuing at step {first + 1}")
    about = {"flavor": choice.flavor, "plan": choice.chosen.as_dict()}
    save = lambda step: save_checkpoint(inputs.out, state, {"step": step, **batches.position(step), **about},
                                        world=world, keep=settings.checkpoint_keep)
    nonfinite = 0
    if world.device.type == "cpu":  # the logits of a micro-batch, in fp32: the largest tensor of a step
        keep_freed_memory_for(plan.token_budget * inputs.workload.spec.vocab_size * 4)
    meter, step_times = PeakMemory(world.device), []
    # What exists now (the imports' half a million objects, the model) lives to the end of the process: out of
    # the collector's reach, neither the full collections during training nor the one at exit walk it again
    # (that last one took 1.0 s of a 3M model's run here; with it frozen, 0.02 s).
    gc.freeze()
    state.model.train()
    with _StopRequest() as stop:
        for step in range(first, inputs.total_steps):
            samples = batches.samples(step)
            shapes = micro_batch_shapes(plan, samples, world.world_size) if meter.tracked else None
            with StepTimer(world.device) as timer, meter.step(state.model, state.optimizer, shapes):
                result, changed = _step_within_memory(state, samples, choice, world, settings, step + 1, log,
                                                      pad_id=inputs.tokenizer.pad_id, out=inputs.out)
                if changed:  # an out-of-memory step ran again with a smaller plan: the run goes on with it
                    choice, plan = changed, changed.chosen.plan
                    about = {"flavor": choice.flavor, "plan": choice.chosen.as_dict()}
                lr = state.scheduler.get_last_lr()[0]
                state.scheduler.step()
            step_times.append(timer.seconds)
            if not result.finite:
                nonfinite += 1
                last = complete_checkpoints(inputs.out)
                if nonfinite > settings.skip_nonfinite_steps:
                    raise UserError(f"step {step + 1}: the loss or the gradient is not finite (loss {result.loss}, "
                                    f"grad norm {result.grad_norm}); stopped without applying it. "
                                    f"{f'The last good checkpoint is {last[-1]}. ' if last else ''}"
                                    "Lower optimizer.lr, or tolerate such steps with skip_nonfinite_steps=K")
            # One collective for all: the peaks of any rank, and whether any rank was asked to stop.
            peak, steady_peak, host_peak, stopping = _all_reduce(
                [meter.peak, meter.steady[0], host_peak_bytes(), float(stop.signame is not None)], world.device,
                op=dist.ReduceOp.MAX)
            done = step + 1
            evaluated = {}
            if inputs.val_dataset is not None and (done == inputs.total_steps or (
                    settings.eval_every and done % settings.eval_every == 0)):
                evaluated = evaluate(state.model, inputs.val_dataset, plan=plan, world=world,
                                     batch_size=batches.batch_size, pad_id=inputs.tokenizer.pad_id)
            if log:
                log.step(step=done, loss=result.loss, lr=lr, tokens=result.tokens,
                         tokens_per_sec=result.tokens / timer.seconds, step_time_s=timer.seconds,
                         grad_norm=result.grad_norm, peak_memory_bytes=int(peak), host_peak_bytes=int(host_peak),
                         target_tokens=result.target_tokens, skipped=not result.finite, **evaluated)
            every = settings.checkpoint_every
            if stopping or (every and done % every == 0 and done < inputs.total_steps):
                path, seconds, size = save(done)
                if log:
                    log.checkpoint(step=done, path=path, seconds=seconds, size=size)
                if stopping:
                    raise Stopped(done, path, stop.signame or "SIGTERM")
    if log and step_times:
        measured = Measured(peak_bytes=int(steady_peak), shapes=meter.steady[1], step_times=step_times)
        kind = "gpu" if world.device.type == "cuda" else "cpu"
        accuracy = compare(choice, inputs.workload, measured, kind)
        for line in accuracy.lines():
            log.info(line)
        log.summary(**accuracy.as_dict())
        record(choice, inputs.workload, measured, accuracy, model_name=inputs.model_name, device_kind=kind)
    state.model.eval()


def _step_within_memory(state: TrainState, samples: list[dict], choice: PlanChoice, world: World,
                        settings: LoopSettings, step: int, log: RunLog | None, *, pad_id: int, out: Path):
    """train_step on the plan's micro-batches of `samples`; after an out-of-memory error, the same global batch again
    with the next smaller plan (train/out_of_memory.py). Returns the result and the new choice (None: unchanged)."""
    changed = None
    while True:
        plan = choice.chosen.plan
        try:
            result = train_step(state, rank_micro_batches(plan, samples, world), plan=plan, world=world,
                                max_grad_norm=settings.max_grad_norm, pad_id=pad_id)
            return result, changed
        except StepOutOfMemory as oom:
            release_memory(state.optimizer)
            smaller = smaller_plan(choice, plan, step=step, error=oom.error)
            change = {"step": step, "error": str(oom.error).splitlines()[0][:300], "from": plan.as_dict(),
                      "to": smaller.plan.as_dict()}
            if world.world_size > 1:  # the others wait inside a collective: start them all again, smaller
                restart_smaller(out, change, micro_batch_size=smaller.plan.micro_batch_size)
            changed = choice = replace(choice, chosen=smaller)
            if log:
                log.plan_changed(choice.as_dict(), change)


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
