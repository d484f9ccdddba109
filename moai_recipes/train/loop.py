"""The training loop every recipe runs: global batch -> this rank's share -> micro-batches -> optimizer step.

A step runs the global batch as micro-batches on every rank and normalises the loss by the number
of target tokens in the WHOLE global batch, so the loss and the gradients are the same whatever
the flavor, the micro-batch size or the number of accumulation steps. The Plan alone decides how the
global batch splits into ranks and micro-batches.
"""

import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from moai_recipes.checkpoint.output_dir import add_skipped_step, complete_checkpoints
from moai_recipes.checkpoint.steps import TrainState, resume, save_checkpoint
from moai_recipes.errors import RedoSkipping, Stopped, UserError
from moai_recipes.inputs import RunInputs
from moai_recipes.models.loss import IGNORE_INDEX, token_loss_sum
from moai_recipes.models.moe import Routing, RoutingTotals, routing_recorded
from moai_recipes.planner.flops import ModelFlops
from moai_recipes.planner.plan import Plan
from moai_recipes.planner.search import PlanChoice
from moai_recipes.train.micro_batches import (
    micro_batch_shapes,
    model_inputs,
    rank_micro_batches,
)
from moai_recipes.train.optim import clip_gradients
from moai_recipes.train.out_of_memory import (
    SmallerOnOutOfMemory,
    StepOutOfMemory,
    address_space_limit,
    injected_fault,
    is_out_of_memory,
)
from moai_recipes.train.context_parallel import share_batch
from moai_recipes.train.heap import freed_memory_returned
from moai_recipes.train.compile_turn import read_from_cache
from moai_recipes.train.parallel import all_reduce_gradients
from moai_recipes.train.pipeline import run_pipeline
from moai_recipes.train.tensor_parallel import parallel_loss, sequence_share, summed_over_shares
from moai_recipes.train.peak_memory import PeakMemory, host_peak_bytes
from moai_recipes.train.plan_accuracy import Measured
from moai_recipes.train.process import ProcessSettings
from moai_recipes.train.profiling import StepProfiler
from moai_recipes.train.metrics_log import MetricsLog, StepMetrics
from moai_recipes.train.mixed_precision import in_compute_dtype
from moai_recipes.train.world import World


@dataclass(frozen=True)
class LoopSettings:
    """What the user sets about the loop itself (not about the model, the data or the plan)."""

    max_grad_norm: float | None  # None: no clipping
    checkpoint_every: int | None  # steps; None: only when asked to stop
    checkpoint_keep: int
    skip_nonfinite_steps: int  # NaN/inf steps tolerated (skipped) before stopping
    eval_every: int | None = None  # steps between validation losses; None: at the end only
    fault_oom_tokens: int | None = None  # micro-batches of more tokens fail as out of memory (tests; ProcessSettings)
    fault_step_delay: float = 0.0  # seconds each step waits first (tests; ProcessSettings)
    fault_memory_headroom: int | None = None  # a real address-space limit after the first step (tests; ProcessSettings)
    fault_nan_step: int | None = None  # the step whose embedding gradient is NaN (tests; ProcessSettings)
    objective: "Objective" = field(default_factory=lambda: TokenLoss())  # what a step optimises
    peak_flops: float = 0.0  # one device's, in the compute dtype (ProcessSettings): MFU's denominator
    profile_steps: tuple[int, ...] = ()  # steps measured by torch.profiler (train/profiling.py)
    measure_memory: bool = True  # the peak tensor memory measured (train/peak_memory.py)
    spec: object = None  # models.spec.ModelSpec: a Mixture-of-Experts model's balancing loss and experts (train_loop)

    @classmethod
    def from_config(cls, cfg, process: ProcessSettings, objective=None) -> "LoopSettings":
        return cls(max_grad_norm=cfg.optimizer.max_grad_norm, checkpoint_every=cfg.checkpoint_every,
                   checkpoint_keep=cfg.checkpoint_keep, skip_nonfinite_steps=cfg.skip_nonfinite_steps,
                   eval_every=cfg.eval_every, fault_oom_tokens=process.fault_oom_tokens,
                   fault_step_delay=process.fault_step_delay, fault_memory_headroom=process.fault_memory_headroom,
                   fault_nan_step=process.fault_nan_step, peak_flops=process.peak_flops,
                   objective=objective or TokenLoss(), profile_steps=tuple(cfg.profile_steps),
                   measure_memory=cfg.measure_memory)


@dataclass(frozen=True)
class StepContext:
    """What a step is given besides the state and its micro-batches: which step it is (1 first), the plan it runs
    (a smaller one after an out-of-memory step), the world, the loop's settings and the padding token."""

    number: int
    plan: Plan
    world: World
    settings: LoopSettings
    pad_id: int


class Objective(Protocol):
    """What a step optimises: the next-token loss (TokenLoss), recipes.dpo's preference loss
    (train/preference_step.PreferenceObjective) or recipes.grpo's generate, score and train
    (train/grpo_step.GRPOObjective)."""

    def step(self, state: TrainState, micro_batches: list[list[dict] | None], context: StepContext) -> "StepResult":
        """A step on this rank's micro-batches of the step's samples (rank_micro_batches): its forward, backward and
        optimizer step. Out of memory before anything is applied: StepOutOfMemory."""

    def micro_batch_shapes(self, plan: Plan, samples: list[dict]) -> list[tuple[int, int, int]]:
        """The micro-batches the step computes on (micro_batches.micro_batch_shapes): what its measured peak is
        compared at (train/peak_memory.py)."""


class TokenLoss:
    """The next-token loss over the target tokens of the global batch (recipes.full_finetune, lora_finetune)."""

    def step(self, state, micro_batches, context):
        return train_step(state, micro_batches, plan=context.plan, world=context.world, settings=context.settings,
                          pad_id=context.pad_id)

    def micro_batch_shapes(self, plan, samples):
        return micro_batch_shapes(plan, samples)


@dataclass
class StepResult:
    loss: float  # mean over the target tokens of the global batch
    tokens: int  # tokens processed (padding excluded), global
    target_tokens: int
    grad_norm: float
    finite: bool
    extra: dict = field(default_factory=dict)  # what else the objective measured (DPO: rewards/*), global


@dataclass(frozen=True)
class LoopResult:
    """What the loop hands back: the plan it ended with (smaller after an out-of-memory step) and what it measured."""

    choice: PlanChoice
    measured: Measured | None  # None: no step ran (a run resumed at its end)


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _losses(model: torch.nn.Module, batches: list[dict], *, plan: Plan, world: World, pad_id: int,
            scale: float | None, routed: RoutingTotals | None = None, optimizer=None) -> torch.Tensor:
    """The summed loss of this process's micro-batches (model_inputs), and with `scale` their backward, the loss
    scaled by it: through the pipeline's schedule, or one micro-batch at a time. Every device of a tensor-parallel
    group holds the same sum; under a pipeline only the last stage holds any (0 elsewhere).

    A Mixture-of-Experts model adds its samples' balancing losses, scaled by routed.aux_scale, to the backward, and
    what its routers decided to `routed` (None: nothing, as in evaluation). An optimizer that applies gradients in the
    backward (train/optimizer_in_backward.py) is armed for the last micro-batch's."""
    if plan.pipeline_stages > 1:
        return run_pipeline(model, batches, plan=plan, pad_id=pad_id, scale=scale, routed=routed)
    total = torch.zeros((), device=world.device, dtype=torch.float64)
    tensor = world.dim("tensor") if plan.tensor_parallel > 1 else None
    context = world.dim("context") if plan.context_parallel > 1 else None
    for i, batch in enumerate(batches):
        if optimizer is not None and plan.optimizer_in_backward:
            optimizer.armed = i == len(batches) - 1
        if context is not None:  # this device's share of the row's tokens (train/context_parallel.py)
            batch = share_batch(batch, context, plan.context_parallel_way)
        routing = None
        if routed is not None:
            samples = batch["samples"] if tensor is None else sequence_share(batch["samples"], tensor)
            routing = Routing(samples.to(world.device), batch["sample_count"], routed.spec)
        with parallel_loss(tensor is not None):  # vocabulary-cut logits: the loss and its backward
            with routing_recorded(model, routing):
                loss = token_loss_sum(model, batch["tokens"].to(world.device), batch["labels"].to(world.device),
                                      chunked=plan.chunked_loss, documents=batch.get("documents"),
                                      images=batch.get("images"))
            objective = loss * scale if scale is not None else None
            if routing is not None:
                # Under sequence or context parallelism a sample's tokens are spread over the tensor and context
                # devices: its routing is their sum, the same on each (each backpropagates its own tokens' share).
                stats = summed_over_shares(routing.stats(), tensor, context)
                if all(mesh is None or mesh.get_local_rank() == 0 for mesh in (tensor, context)):
                    routed.add(stats)
                if objective is not None and routed.aux_scale:
                    aux = routed.balancing_losses(stats).sum() * routed.aux_scale
                    if isinstance(objective, DTensor):  # the loss of vocabulary-cut logits, the same on every device
                        aux = DTensor.from_local(aux, tensor, [Replicate()], run_check=False)
                    objective = objective + aux
            if objective is not None:
                objective.backward()
        loss = loss.detach()
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).double()  # a replicated DTensor under TP
    return total


def evaluate(model: torch.nn.Module, dataset, *, plan: Plan, world: World, batch_size: int, pad_id: int) -> dict:
    """The validation loss: every sample of `dataset` in order, a global batch at a time split as the plan splits
    training's, forward only, normalised by the target tokens of the whole set. The same on any flavor.
    Returns {"eval_loss": ..., "eval_time_s": ...}."""
    start = time.perf_counter()
    model.eval()
    loss_sum, targets = 0.0, 0
    with torch.no_grad(), in_compute_dtype(model, plan):
        for first in range(0, len(dataset), batch_size):
            samples = [dataset[i] for i in range(first, min(first + batch_size, len(dataset)))]
            batches = [model_inputs(micro, plan, pad_id) for micro in rank_micro_batches(plan, samples, world)]
            loss_sum += _losses(model, batches, plan=plan, world=world, pad_id=pad_id, scale=None).item()
            targets += sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    model.train()
    copies = plan.tensor_parallel * plan.pipeline_stages * plan.context_parallel  # as in train_step
    total, total_targets = _all_reduce([loss_sum / plan.tensor_parallel, targets / copies], world.device)
    return {"eval_loss": total / max(total_targets, 1), "eval_time_s": time.perf_counter() - start}


def evaluate_tasks(model: torch.nn.Module, inputs: RunInputs, *, plan: Plan, world: World) -> dict | None:
    """eval_tasks through lm-eval, each rank scoring its share of the documents in step with the others (a sharded
    model's forwards need them all); rank 0 gets `task/metric` -> value, the others None."""
    from moai_recipes.inference.harness import MoaiLM, Scoring, headline, run_tasks

    model.eval()
    scoring = Scoring(batch_size=max(1, plan.micro_batch_size), max_length=plan.row_length)
    with torch.no_grad(), in_compute_dtype(model, plan):
        out = run_tasks(MoaiLM(model, inputs.tokenizer, scoring, device=world.device), inputs.eval_tasks)
    model.train()
    return headline(out["results"]) if out is not None else None


def train_step(state: TrainState, micro_batches: list[list[dict] | None], *, plan: Plan, world: World,
               settings: LoopSettings, pad_id: int) -> StepResult:
    """One optimizer step on this rank's micro-batches (rank_micro_batches). Out of memory before anything is
    applied: StepOutOfMemory, and the step can run again."""
    samples = [s for micro in micro_batches if micro for s in micro]
    local_targets = sum(sum(1 for t in s["labels"] if t != IGNORE_INDEX) for s in samples)
    local_tokens = sum(len(s["tokens"]) for s in samples)
    # Summed over every process, then over one copy of each data rank's share: its tensor, pipeline and context
    # devices all counted the same samples.
    copies = plan.tensor_parallel * plan.pipeline_stages * plan.context_parallel
    global_targets, global_tokens, global_samples = (
        v / copies for v in _all_reduce([local_targets, local_tokens, len(samples)], world.device))
    # FSDP averages gradients over the data x context devices it shards over: scaling by their number makes that a
    # sum over the global batch's tokens. Replicas (and one process) sum them (all_reduce_gradients).
    scale = plan.shards / max(global_targets, 1)
    # A Mixture-of-Experts model adds its load-balancing loss, a mean over the global batch's samples.
    spec = settings.spec
    routed = None
    if spec is not None and spec.is_moe:
        per_sample = scale * global_targets / max(global_samples, 1)  # the token loss's scale, per sample instead
        routed = RoutingTotals(spec, aux_scale=per_sample * spec.router_aux_loss_coef)
    try:
        batches = []
        for micro in micro_batches:
            batch = model_inputs(micro, plan, pad_id)
            injected_fault(batch["tokens"].numel(), settings.fault_oom_tokens)
            batches.append(batch)
        with in_compute_dtype(state.model, plan, state.optimizer):
            loss_sum = _losses(state.model, batches, plan=plan, world=world, pad_id=pad_id, scale=scale,
                               routed=routed, optimizer=state.optimizer)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        failed = str(e)  # not the error itself: its frames hold the partial forward's graph and activations
    else:
        failed = None
    if failed is not None:
        applied = getattr(state.optimizer, "applied", 0)
        if applied and world.world_size == 1:  # several processes start again from the last checkpoint instead
            raise UserError(f"out of memory in the backward ({failed.splitlines()[0][:200]}) after the optimizer had "
                            f"updated {applied} weights (plan.optimizer_in_backward): the step cannot run again in "
                            "place. Run the same command again (resume=auto continues from the last checkpoint) with "
                            "plan.recompute=full or a smaller plan.micro_batch_size")
        raise StepOutOfMemory(failed)
    if plan.replicate:
        all_reduce_gradients(state.model)
    # Every tensor-parallel device holds the same loss; only a pipeline's last stage holds any.
    summed = _all_reduce([loss_sum.item(), *(routed.as_list() if routed else [])], world.device)
    total_loss = summed[0] / plan.tensor_parallel
    stages = world.dim("pipeline").get_group() if plan.pipeline_stages > 1 else None
    extra = {}
    if plan.optimizer_in_backward:  # most gradients applied already: their norm was measured on the way
        grad_norm = state.optimizer.gradient_norm()
        # What the backward applied, of this rank's trainable tensors (the rest step() applies): 1 where every
        # tensor got its last gradient in the step's last micro-batch.
        extra["applied_in_backward"] = state.optimizer.applied / max(len(state.optimizer.param_groups[0]["params"]), 1)
    else:
        pipelined = plan.pipeline_stages > 1
        if pipelined:  # a tied embedding's two copies, the first stage's and the last's, take the same step
            state.model.sync_tied_gradients()
        grad_norm = clip_gradients(state.model, settings.max_grad_norm, stages=stages,
                                   counted_elsewhere=state.model.counted_elsewhere() if pipelined else ())
    finite = math.isfinite(total_loss) and math.isfinite(grad_norm)  # the same verdict on every rank
    if finite:  # a NaN/inf step is never applied: the weights stay those of the last good step
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    # Each sample's routing was added once: by the process that computes its loss (one tensor device of it).
    extra.update(routed.metrics(summed[1:], global_samples) if routed else {})
    return StepResult(loss=total_loss / max(global_targets, 1), tokens=int(global_tokens),
                      target_tokens=int(global_targets), grad_norm=grad_norm, finite=finite, extra=extra)


@contextmanager
def _nan_embedding_gradient(model: torch.nn.Module, injected: bool):
    """Within the block, if `injected`, the gradient reaching the token embeddings' output is NaN (MOAI_FAULT_NAN_STEP):
    the embeddings' weight gradient is not finite, every other finite (tests)."""
    if not injected:
        yield
        return

    def poison(module, args, output):
        if output.requires_grad:
            output.register_hook(lambda grad: grad * math.nan)

    handle = model.tok_embeddings.register_forward_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def _redo_skipping(inputs: RunInputs, step: int, world: World, result: StepResult) -> None:
    """The optimizer in the backward applied some gradients of `step` before others proved not finite, where a step
    after the backward applies none of them (a skipped step leaves every weight as it was). What it applied cannot be
    taken back without the copy of the weights it exists not to hold: the run goes back to its last checkpoint (or its
    first step) and redoes the steps since then, the same batches, this one skipped whole (inputs.skipped_steps).
    Every rank comes here (the norm is one verdict); rank 0 records the step before any rank leaves."""
    if world.is_main:
        add_skipped_step(inputs.out, step)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    last = complete_checkpoints(inputs.out)
    raise RedoSkipping(f"step {step}: a gradient is not finite (loss {result.loss}, grad norm {result.grad_norm}) "
                       "after the optimizer in the backward had applied others; starting again from "
                       f"{last[-1] if last else 'the first step'} to redo the steps since, this one skipped whole")


def train_loop(state: TrainState, inputs: RunInputs, choice: PlanChoice, settings: LoopSettings, world: World,
               log: MetricsLog | None) -> LoopResult:
    """Run the run's steps as `choice` planned them, from the checkpoint `inputs.resume_from` (if any): the same
    global batches on any flavor.

    Saves a checkpoint every `settings.checkpoint_every` steps and when asked to stop (then raises Stopped);
    stops with a UserError naming the step after more than `settings.skip_nonfinite_steps` steps with a NaN/inf
    loss or gradient.
    """
    batches, pad_id = inputs.batches, inputs.tokenizer.pad_id
    settings = replace(settings, spec=inputs.spec)
    first = 0
    if inputs.resume_from is not None:
        meta = resume(inputs.resume_from, state, batches, world)
        first = meta["step"]
        if log:
            log.info(f"Resumed from {inputs.resume_from} (step {first}, saved on {meta['flavor']} with "
                     f"{meta['world_size']} process(es)); continuing at step {first + 1}")
    flops = ModelFlops.of(inputs.spec, inputs.lora)
    runner = SmallerOnOutOfMemory(choice, world=world, out=inputs.out, hint=inputs.out_of_memory_hint, log=log)
    meter, step_times, nonfinite = PeakMemory(world.device, steps=inputs.total_steps - first,
                                              compiled=runner.plan.compile,
                                              pipelined=runner.plan.pipeline_stages > 1,
                                              wanted=settings.measure_memory), [], 0
    if inputs.eval_tasks is not None and (runner.plan.pipeline_stages > 1 or runner.plan.tensor_parallel > 1
                                          or runner.plan.context_parallel > 1):
        raise UserError(f"eval_tasks run on data-parallel plans only, and this run's plan has "
                        f"{runner.plan.pipeline_stages} pipeline stage(s), tensor parallelism "
                        f"{runner.plan.tensor_parallel} and context parallelism {runner.plan.context_parallel}; "
                        f"drop eval_tasks here and run recipes.eval on the model the "
                        "run writes (model.checkpoint_dir=OUTPUT_DIR/model tasks=[...])")
    profiler = StepProfiler(settings.profile_steps, inputs.out, rank=world.rank, device=world.device)
    state.model.train()
    # Split rows on the CPU: glibc's freed pages returned as the layers go (train/heap.py).
    trimmed = freed_memory_returned(world.device.type == "cpu" and runner.plan.context_parallel > 1)
    with _StopRequest() as stop, address_space_limit(settings.fault_memory_headroom) as limit_memory, trimmed:
        for step in range(first, inputs.total_steps):
            done = step + 1
            if settings.fault_step_delay:  # tests that signal a run mid-way, whatever the machine's speed
                time.sleep(settings.fault_step_delay)
            samples = batches.samples(step)
            traced = meter.tracked and meter.counts and world.device.type == "cpu"
            # What the step's micro-batches are (GRPO's: its completions, not its prompts).
            shapes = settings.objective.micro_batch_shapes(runner.plan, samples) if meter.tracked else None
            skipped_whole = done in inputs.skipped_steps  # redone after the optimizer in the backward applied part
            if runner.plan.optimizer_in_backward:
                state.optimizer.discarding = skipped_whole
            with profiler.step(done), StepTimer(world.device) as timer, \
                    meter.step(state.model, state.optimizer, shapes), \
                    _nan_embedding_gradient(state.model, done == settings.fault_nan_step):
                result = runner.run(lambda plan: settings.objective.step(
                    state, rank_micro_batches(plan, samples, world), StepContext(done, plan, world, settings, pad_id)),
                    step=done, optimizer=state.optimizer)
                lr = float(state.scheduler.get_last_lr()[0])  # torchao keeps it as a tensor
                state.scheduler.step()
            profiled = profiler.profiled(done)
            # The profiler slows the steps it records: they do not say what a step costs (None keeps the positions).
            step_times.append(None if profiled else timer.seconds)
            # A sample's documents: itself, or a preference pair's two sequences (each attends to itself only).
            work = flops.step([n for s in samples for n in s.get("documents", (len(s["tokens"]),))],
                              recompute=runner.plan.recompute)
            mfu, hfu = work.utilisation(timer.seconds, settings.peak_flops, world.world_size)
            if done == first + 1:
                limit_memory()  # tests: a real memory limit from the second step (MOAI_FAULT_MEMORY_HEADROOM)
            if skipped_whole:  # as the first time: a step with a gradient that is not finite, applied nowhere
                result = replace(result, finite=False)
            if not result.finite:
                nonfinite += 1
                if nonfinite > settings.skip_nonfinite_steps:
                    last = complete_checkpoints(inputs.out)
                    raise UserError(f"step {done}: the loss or the gradient is not finite (loss {result.loss}, "
                                    f"grad norm {result.grad_norm}); stopped without applying it. "
                                    f"{f'The last good checkpoint is {last[-1]}. ' if last else ''}"
                                    "Lower optimizer.lr, or tolerate such steps with skip_nonfinite_steps=K")
                if runner.plan.optimizer_in_backward and state.optimizer.applied_some:
                    _redo_skipping(inputs, done, world, result)
            # One collective for all: the peaks of any rank, and whether any rank was asked to stop.
            peak, host_peak, stopping = _all_reduce(
                [meter.peak, host_peak_bytes(), float(stop.signame is not None)], world.device, op=dist.ReduceOp.MAX)
            evaluated = {}
            if done == inputs.total_steps or (settings.eval_every and done % settings.eval_every == 0):
                if inputs.val_dataset is not None:
                    evaluated = evaluate(state.model, inputs.val_dataset, plan=runner.plan, world=world,
                                         batch_size=batches.batch_size, pad_id=pad_id)
                if inputs.eval_tasks is not None:
                    evaluated["tasks"] = evaluate_tasks(state.model, inputs, plan=runner.plan, world=world)
            if log:
                log.step(StepMetrics(step=done, loss=result.loss, lr=lr, tokens=result.tokens,
                                     tokens_per_sec=result.tokens / timer.seconds, step_time_s=timer.seconds,
                                     grad_norm=result.grad_norm, peak_memory_bytes=int(peak),
                                     host_peak_bytes=int(host_peak), target_tokens=result.target_tokens,
                                     skipped=not result.finite,
                                     flops_per_token=work.model / max(result.tokens, 1),
                                     mfu=mfu, hfu=hfu, extra=result.extra or None, traced=traced,
                                     profiled=profiled, **evaluated))
                if profiled:
                    log.info(profiler.summary(done))
            every = settings.checkpoint_every
            if stopping or (every and done % every == 0 and done < inputs.total_steps):
                about = {"step": done, **batches.position(done), "flavor": runner.choice.flavor,
                         "plan": runner.choice.chosen.as_dict(), "identity": inputs.identity}
                path, seconds, size = save_checkpoint(inputs.out, state, about, world=world,
                                                      keep=settings.checkpoint_keep)
                if log:
                    log.checkpoint(step=done, path=path, seconds=seconds, size=size)
                if stopping:
                    raise Stopped(done, path, stop.signame or "SIGTERM")
    state.model.eval()
    # The steady step's peak, the largest of any rank (each measured its own).
    (steady_peak,) = _all_reduce([meter.steady[0]], world.device, op=dist.ReduceOp.MAX)
    # The processes that read the first one's compiled layers from the caches rather than compiling them again.
    (readers,) = _all_reduce([read_from_cache()], world.device) if runner.plan.compile else (0,)
    measured = Measured(peak_bytes=int(steady_peak) if meter.counts else None, shapes=meter.steady[1],
                        step_times=step_times, not_measured=meter.not_counted,
                        compile_cache_readers=int(readers)) if step_times else None
    return LoopResult(choice=runner.choice, measured=measured)


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
