"""A process's peak memory, measured as the planner predicts it: the bytes tensors hold (MemoryBreakdown.allocated).

On a GPU that is the caching allocator's `max_memory_allocated`. The CPU has no such counter (its resident
memory also holds the runtime, the libraries and what the allocator keeps after frees), so over the first
steps a dispatch mode follows every tensor storage as it is made, resized and freed, and keeps the peak of
their sum: the same quantity. A Python hook on every operator slows those steps down, so only the first
TRACKED_STEPS steps of a process are followed; the step-time median leaves them out anyway (train/loop.py).
The process's resident peak (`host_peak_bytes`) is reported beside it: what the machine gives the process.
"""

import contextlib
import resource

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_map_only

from moai_recipes.planner.live_storages import LiveStorages

# Steps of a process whose tensors are followed on the CPU: the first makes the optimizer state, the second
# is a step as every later one runs it.
TRACKED_STEPS = 2


def host_peak_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor: its own, or those of a wrapper subclass's inner tensors (NF4, DTensor)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()]


class TensorBytes(TorchDispatchMode):
    """While active: the bytes of every tensor storage alive and the most at once (`storages`, the same ledger
    the planner's layer traces count with: planner/live_storages.py).

    A storage is counted when an operator returns it (or when `add` is called on a tensor made earlier),
    resized when FSDP2 frees or refills a gathered parameter in place (UntypedStorage.resize_ does not go
    through the dispatcher, so it is wrapped while active), and uncounted when it is freed (a weak
    reference's callback; a storage's Python object lives as long as the storage). Temporaries inside one
    operator are not seen, as a GPU allocator sees them: the measured peak can only be lower by those.
    """

    def __init__(self):
        super().__init__()
        self.storages = LiveStorages()
        self._resize = torch.UntypedStorage.resize_

    def add(self, t: torch.Tensor) -> None:
        for st in _storages(t):
            if st.device.type != "meta":
                self.storages.add(st)

    def add_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Count what exists before the mode sees it made: parameters, buffers, gradients, optimizer state."""
        for t in [*model.parameters(), *model.buffers()]:
            self.add(t)
            if t.grad is not None:
                self.add(t.grad)
        if optimizer is not None:
            for state in optimizer.state.values():
                tree_map_only(torch.Tensor, self.add, state)

    def __enter__(self):
        resize, storages = self._resize, self.storages

        def resize_(st, n):
            resize(st, n)
            storages.resized(st)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A DTensor's operator runs on its local tensors, each seen here as it runs.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.add, out)
        return out


class PeakMemory:
    """Each measured step's peak tensor bytes, as `with meter.step(model, optimizer, largest):` around each step
    runs them: on a GPU every step (the allocator's own count), on the CPU the first TRACKED_STEPS."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: list[int] = []  # of the measured steps, in order
        self.shapes: list[list[tuple[int, int, int]]] = []  # their micro-batches (train/micro_batches.py)
        self._tracker = TensorBytes() if device.type != "cuda" else None

    @property
    def tracked(self) -> bool:
        """Whether the next step is measured."""
        return self._tracker is None or len(self.peaks) < TRACKED_STEPS

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shapes: list[tuple[int, int, int]]):
        """A context around one step; `shapes`: its micro-batches, as micro_batch_shapes gives them."""
        return _Step(self, model, optimizer, shapes) if self.tracked else contextlib.nullcontext()

    @property
    def peak(self) -> int:
        """The most bytes tensors held at once in any measured step so far."""
        return max(self.peaks, default=0)

    @property
    def steady(self) -> tuple[int, list[tuple[int, int, int]]]:
        """(peak, micro-batches) of the TRACKED_STEPS-th step (or the last, in a shorter run): the first
        whose optimizer state exists from its start, as in every later step and in the planner's prediction."""
        i = min(TRACKED_STEPS, len(self.peaks)) - 1
        return (self.peaks[i], self.shapes[i]) if i >= 0 else (0, [])


class _Step:
    def __init__(self, meter: PeakMemory, model, optimizer, shapes):
        self.meter, self.model, self.optimizer, self.shapes = meter, model, optimizer, shapes
        self.tracker = meter._tracker

    def __enter__(self):
        if self.tracker is None:
            torch.cuda.reset_peak_memory_stats(self.meter.device)
        else:
            self.tracker.add_state(self.model, self.optimizer)
            self.tracker.storages.reset_peak()
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.tracker is None:
            peak = torch.cuda.max_memory_allocated(self.meter.device)
        else:
            self.tracker.__exit__(*exc)
            peak = self.tracker.storages.peak
        self.meter.peaks.append(int(peak))
        self.meter.shapes.append(self.shapes)
