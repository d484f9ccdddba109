"""A process's peak memory, measured to compare with what the planner predicts."""

import resource

import psutil
import torch

_BASELINE_RSS = 0


def mark_memory_baseline() -> None:
    """What the process holds before its model exists (the runtime, the libraries, the data, the process
    group): the CPU's measured peak counts from here, to compare with what the planner predicts training
    allocates. Call it just before building the model."""
    global _BASELINE_RSS
    _BASELINE_RSS = psutil.Process().memory_info().rss


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: allocated device memory on a GPU; resident memory above the baseline on the CPU
    (which also holds what the allocator keeps after frees: an upper bound of the tensors' peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - _BASELINE_RSS)
