"""What a run measured against what its plan predicted, like for like: the lines at the end of a run, the W&B
summary, and the machine's calibration record (planner/calibration.py).

Peak memory: the most bytes tensors held at once in step TRACKED_STEPS (train/peak_memory.py: the first whose
optimizer state exists throughout) against the planner's tensor bytes (MemoryBreakdown.allocated) for the
largest micro-batch that step formed. The plan
itself reserves memory for the worst micro-batch the data can form, plus the allocator's slack and the
runtime: that figure is said beside it. Step time: the median of the steps after the first TRACKED_STEPS
(which warm up the allocator and the caches, and on the CPU are followed tensor by tensor) against the
planner's step time at the data's real lengths.
"""

from dataclasses import dataclass, replace

from moai_recipes.planner import calibration
from moai_recipes.planner.memory import MemoryBreakdown, predict_memory
from moai_recipes.planner.plan import Plan, Workload
from moai_recipes.planner.search import PlanChoice
from moai_recipes.train.peak_memory import TRACKED_STEPS

GiB = 2**30


@dataclass(frozen=True)
class Measured:
    """What a process measured of its steps (the largest over ranks)."""

    peak_bytes: int | None  # tensors, at most at once, in the steady measured step (PeakMemory.steady); None: not
    # counted (compiled layers on the CPU)
    shapes: list[tuple[int, int, int]]  # that step's micro-batches (train/micro_batches.micro_batch_shapes)
    step_times: list[float | None]  # every step this process ran, in order; None: a profiled step (profile_steps)
    not_measured: str | None = None  # why peak_bytes is None
    compile_cache_readers: int = 0  # processes that read the layers compiled by the first (train/compile_turn.py)


@dataclass(frozen=True)
class Accuracy:
    predicted_peak_bytes: int  # at the measured micro-batch
    measured_peak_bytes: int | None  # None: not counted (compiled layers on the CPU: train/peak_memory.py)
    planned_peak_bytes: int  # what the plan reserves (the worst micro-batch, slack and runtime included)
    predicted_step_s: float
    measured_step_s: float | None  # None: no step after the warm-up ones
    steady_steps: int
    largest: tuple[int, int]  # (rows, tokens per row) of the measured step's largest micro-batch
    memory: MemoryBreakdown  # the planner's, default constants, at the measured step's micro-batches
    compiled_graphs: int | None = None  # graphs torch.compile captured in this process (plan.compile); None: eager
    compile_cache_readers: int = 0  # as Measured's
    not_measured: str | None = None  # why measured_peak_bytes is None
    peak_step: int = TRACKED_STEPS  # the measured step: the TRACKED_STEPS-th this process ran, or its last

    @property
    def peak_error(self) -> float | None:
        if self.measured_peak_bytes is None:
            return None
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / max(self.predicted_peak_bytes, 1)

    @property
    def step_error(self) -> float | None:
        if self.measured_step_s is None:
            return None
        return (self.measured_step_s - self.predicted_step_s) / max(self.predicted_step_s, 1e-9)

    def lines(self) -> list[str]:
        rows, tokens = self.largest
        if self.measured_peak_bytes is None:
            lines = [f"Peak tensor memory per device: predicted {self.predicted_peak_bytes / GiB:.3f} GiB; not measured "
                     f"({self.not_measured}); the plan reserves "
                     f"{self.planned_peak_bytes / GiB:.3f} GiB for the worst the data can form"]
        else:
            lines = [f"Peak tensor memory per device: predicted {self.predicted_peak_bytes / GiB:.3f} GiB, measured "
                     f"{self.measured_peak_bytes / GiB:.3f} GiB ({self.peak_error:+.1%}) in step {self.peak_step}, whose "
                     f"largest micro-batch was {rows} x {tokens} tokens; the plan reserves "
                     f"{self.planned_peak_bytes / GiB:.3f} GiB for the worst the data can form"]
        if self.measured_step_s is None:
            lines.append(f"Step time: predicted {self.predicted_step_s:.3g} s; too few steps to measure "
                         f"(the first {TRACKED_STEPS} warm up)")
        else:
            lines.append(f"Step time: predicted {self.predicted_step_s:.3g} s, measured {self.measured_step_s:.3g} s "
                         f"(the median of {self.steady_steps} step(s), {self.step_error:+.1%})")
        if self.compiled_graphs is not None:  # what the compile the step time includes amounted to
            lines.append(f"torch.compile captured {self.compiled_graphs} graph(s) of the layers"
                         + (f"; {self.compile_cache_readers} other process(es) read them from inductor's cache"
                            if self.compile_cache_readers else ""))
        return lines

    def as_dict(self) -> dict:
        return {"predicted_peak_bytes": self.predicted_peak_bytes, "measured_peak_bytes": self.measured_peak_bytes,
                "planned_peak_bytes": self.planned_peak_bytes, "predicted_step_s": self.predicted_step_s,
                "measured_step_s": self.measured_step_s}


def compare(choice: PlanChoice, work: Workload, measured: Measured, device_kind: str) -> Accuracy:
    from moai_recipes.train.parallel import compiled_graphs  # (a run that compiled has imported it)

    plan = choice.chosen.plan
    steady = sorted(t for t in measured.step_times[TRACKED_STEPS:] if t is not None)
    memory = predicted_memory(plan, work, measured.shapes, device_kind)
    scale = calibration.scales(choice.device).get(calibration.MEMORY, 1.0)  # as the planner applied it
    return Accuracy(predicted_peak_bytes=int(memory.allocated + (scale - 1) * (memory.activations + memory.logits)),
                    measured_peak_bytes=measured.peak_bytes, planned_peak_bytes=choice.chosen.memory.total,
                    predicted_step_s=choice.chosen.time.total_s,
                    measured_step_s=steady[len(steady) // 2] if steady else None, steady_steps=len(steady),
                    largest=max(((r, t) for _, r, t in measured.shapes), key=_size, default=(1, 1)), memory=memory,
                    compiled_graphs=compiled_graphs() if plan.compile else None, not_measured=measured.not_measured,
                    compile_cache_readers=measured.compile_cache_readers,
                    peak_step=max(1, min(TRACKED_STEPS, len(measured.step_times))))


def predicted_memory(plan: Plan, work: Workload, shapes: list[tuple[int, int, int]], device_kind: str) -> MemoryBreakdown:
    """The planner's memory (default constants) for a step of these micro-batches: the largest first micro-batch
    of a rank (no gradients from earlier ones yet) or the largest later one (with them), whichever is more."""
    first = max(((r, t) for i, r, t in shapes if i == 0), key=_size, default=(1, 1))
    later = max(((r, t) for i, r, t in shapes if i > 0), key=_size, default=None)
    predicted = [predict_memory(replace(plan, micro_batch_size=rows, accumulation_steps=accumulation),
                                replace(work, seq_len=tokens), device_kind)
                 for shape, accumulation in ((first, 1), (later, 2)) if shape for rows, tokens in [shape]]
    return max(predicted, key=lambda m: m.allocated)


def record(choice: PlanChoice, work: Workload, measured: Measured, accuracy: Accuracy, *, model_name: str,
           device_kind: str) -> None:
    """This run's line of the machine's calibration record (planner/calibration.py)."""
    plan = choice.chosen.plan
    about = {"device": choice.device, "kind": device_kind, "recipe": "lora" if work.lora else "full",
             "flavor": choice.flavor, "plan": plan.as_dict(), "shapes": measured.shapes,
             "workload": {"model": model_name, "params": work.sizes.total, "trainable": work.sizes.trainable,
                          "batch_size": work.batch_size, "seq_len": work.seq_len,
                          "mean_length": round(work.mean_length, 2)}}
    calibration.record(calibration.run_entry(about, time_terms=choice.chosen.time.terms, memory=accuracy.memory,
                                             measured_step_s=accuracy.measured_step_s,
                                             measured_peak_bytes=measured.peak_bytes))


def report_accuracy(choice: PlanChoice, measured: Measured, *, work: Workload, model_name: str, device_kind: str,
                    log) -> None:
    """At the end of a run, on the main process: the measured against the predicted in the log and W&B's summary,
    and this run's line of the machine's calibration record."""
    accuracy = compare(choice, work, measured, device_kind)
    for line in accuracy.lines():
        log.info(line)
    log.summary(**accuracy.as_dict())
    record(choice, work, measured, accuracy, model_name=model_name, device_kind=device_kind)


def _size(shape: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    return shape[0] * shape[1], shape
