"""A process's peak memory, measured by PyTorch's own counters: the bytes tensors hold at once, which the planner
predicts (MemoryBreakdown.allocated).

On a GPU that is the caching allocator's `max_memory_allocated`. The CPU's allocator keeps no such statistics (and
its resident memory also holds the runtime, the libraries and what the allocator keeps after frees), so over the
step the planner predicts PyTorch's MemTracker (torch.distributed._tools.mem_tracker) follows every tensor storage
as it is made, resized (FSDP2 frees and refills gathered parameters in place) and freed, and keeps the peak of their
sum. It is not the planner's ledger (planner/live_storages.py): a counting mistake there cannot hide in the
measurement. Following every operator slows that step (SmolLM2: about 1.5x a plain step), so only one step of a
process is followed: its TRACKED_STEPS-th (the first whose optimizer state exists from its start, as the planner
predicts), or its last in a shorter run. The step-time median leaves out the first TRACKED_STEPS anyway
(train/plan_accuracy.py), and `measure_memory=false` follows none (bench/memory_measurement.py measures the cost).
Until 2026-11-29 the first step was followed too, and nothing read its peak but the metrics' running maximum: in the
suite that step was 5% of all the CPU time (a sampled profile of the whole suite put MemTracker at 10%).
The process's resident peak (`host_peak_bytes`) is reported beside it: what the machine gives the process.

Not with compiled layers or pipeline stages on the CPU (for the pipeline: see PeakMemory): a layer whose first call runs under a dispatch mode is never compiled
(dynamo leaves the frame to eager for good, as tests/test_compile.py found), and once compiled, its kernels
allocate outside the dispatcher where no mode sees them. There the tensor peak is not measured.
"""

import contextlib
import resource

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.nn.modules.module import register_module_forward_pre_hook

# The step of a process whose tensors are followed on the CPU: the first makes the optimizer state, the second
# is a step as every later one runs it.
TRACKED_STEPS = 2


def host_peak_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Each measured step's peak tensor bytes, as `with meter.step(model, optimizer, largest):` around each step
    runs them: on a GPU every step (the allocator's own count), on the CPU one of the `steps` this process runs: its
    TRACKED_STEPS-th, or its last."""

    def __init__(self, device: torch.device, *, steps: int, compiled: bool = False, pipelined: bool = False,
                 wanted: bool = True):
        self.device = device
        self.measured_step = max(1, min(TRACKED_STEPS, steps))  # of this process's steps, counted from 1
        self.begun = 0  # steps of this process begun so far
        # Where tensors are counted at all: a GPU's allocator always; the CPU's MemTracker only for eager layers
        # outside a pipeline (the schedule infers its stages' gradients with autograd.grad, which MemTracker's
        # gradient hooks refuse), and only where the user wants it (measure_memory).
        self.not_counted = (None if device.type == "cuda" else
                            "measure_memory=false" if not wanted else
                            "on the CPU PyTorch's tensor counting sees neither compiled layers nor pipeline stages"
                            if compiled or pipelined else None)
        self.counts = self.not_counted is None
        self.peaks: list[int] = []  # of the measured steps, in order
        self.shapes: list[list[tuple[int, int, int]]] = []  # their micro-batches (train/micro_batches.py)

    @property
    def tracked(self) -> bool:
        """Whether the next step is measured."""
        return self.device.type == "cuda" or self.begun + 1 == self.measured_step

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shapes: list[tuple[int, int, int]]):
        """A context around one step; `shapes`: its micro-batches, as micro_batch_shapes gives them."""
        tracked = self.tracked
        self.begun += 1
        return _Step(self, model, optimizer, shapes) if tracked else contextlib.nullcontext()

    @property
    def peak(self) -> int:
        """The most bytes tensors held at once in any measured step so far (0 before one is)."""
        return max(self.peaks, default=0)

    @property
    def steady(self) -> tuple[int, list[tuple[int, int, int]]]:
        """(peak, micro-batches) of the measured step: the process's TRACKED_STEPS-th (or its last, in a shorter
        run), the first whose optimizer state exists from its start, as in every later step and in the planner's
        prediction. (0, []) where nothing was measured."""
        i = min(self.measured_step, len(self.peaks)) - 1  # the CPU keeps that step's alone: index 0
        return (self.peaks[i], self.shapes[i]) if i >= 0 else (0, [])


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _MemTracker(MemTracker):
    """MemTracker as torch 2.13 has it hooks every parameter's gradient as its module runs, and fails on a frozen
    one (LoRA's base, sharded or gathered by FSDP2): those are marked as hooked already, with handles that remove
    nothing. What it counts is unchanged."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        hooked = self._param_to_grad_hook_handles
        hooked.update({p: (_NO_HOOK, _NO_HOOK) for p in module.parameters() if not p.requires_grad and p not in hooked})
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        # MemTracker also keeps each module's own peak: after every operator it walks every module it has seen
        # (450 in SmolLM2 with LoRA) and copies the snapshot of each active one at a new peak, which made a
        # traced step 12 times slower than a plain one. Only the process's peak is read (peak_bytes): kept alone.
        for device, snapshot in self._curr_mem_snap.items():
            total = snapshot[_TOTAL_KEY]
            if self._peak_mem.get(device, 0) < total:
                self._peak_mem[device] = total

    def get_tracker_snapshot(self, type: str = "current"):
        # Taken at every module's entry and exit: {device: {kind: bytes}} copied two levels deep (what deepcopy
        # does to it, at a tenth of the cost). The peak keeps its totals only (_update_peak_stats).
        if type == "peak":
            return {device: {_TOTAL_KEY: total} for device, total in self._peak_mem.items()}
        return {device: dict(kinds) for device, kinds in self._curr_mem_snap.items()}

    def peak_bytes(self) -> int:
        """The most bytes tensors held at once while the tracker was on, over all devices."""
        return sum(self._peak_mem.values())

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        # A bf16 compute copy's gradient (train/mixed_precision.py) is added to its fp32 master and dropped by a
        # hook that runs before the tracker's own post-accumulate one, which then finds None (and warns): it was
        # counted on its way in, by the tracker's gradient hook, so there is nothing left to count.
        return set() if t is None else super()._update_and_maybe_create_winfos(t, reftype, update_existing)


class _Step:
    def __init__(self, meter: PeakMemory, model, optimizer, shapes):
        self.meter, self.model, self.optimizer, self.shapes = meter, model, optimizer, shapes

    def __enter__(self):
        if self.meter.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.meter.device)
            return self
        if not self.meter.counts:  # the step's micro-batches only: what the planner predicts for
            return self
        self.tracker = _MemTracker()
        self.tracker.track_external(self.model, self.optimizer)  # what exists before the step: weights, state
        # MemTracker follows one forward of each top-level module per iteration; a step runs several (the model
        # once per micro-batch, the chunked loss's norm and output once per chunk). That module's statistics
        # (which we do not read) are dropped before each such call outside the backward; the peak stays.
        # Registered before the tracker's own hooks (on entering), so it runs first.
        self.hook = register_module_forward_pre_hook(self._before_forward)
        self.tracker.__enter__()
        return self

    def _before_forward(self, module, args) -> None:
        modules = self.tracker._mod_tracker
        if not modules.is_bw and set(modules.parents) <= {"Global"}:
            self.tracker.memory_tracking.pop(module, None)

    def __exit__(self, *exc):
        if self.meter.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.meter.device)
        elif not self.meter.counts:
            peak = 0
        else:
            self.tracker.__exit__(*exc)
            self.hook.remove()
            peak = self.tracker.peak_bytes()
        self.meter.peaks.append(int(peak))
        self.meter.shapes.append(self.shapes)
