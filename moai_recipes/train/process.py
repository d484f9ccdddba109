"""A training process prepared for its loop, in one visible step (`prepare_process`, called by the recipe).

What it sets is process-wide, so it is set once, here, and nowhere below:
- threads: the process's share of this machine's cores (the planner priced its steps with that many);
- the C allocator (CPU): glibc keeps the memory freed tensors held, where a step's tensors are large (below);
- the garbage collector: what exists before the loop is frozen out of its reach;
- fault injection (tests): MOAI_FAULT_OOM_TOKENS, MOAI_FAULT_MEMORY_HEADROOM, MOAI_FAULT_STEP_DELAY and
  MOAI_FAULT_NAN_STEP read once
  into the settings the loop gets.

The allocator. glibc serves an allocation above its mmap threshold (at most 32 MiB) with fresh pages from the
kernel and returns them on free; every new tensor that large then pays a page fault per 4 KiB and the kernel's
zeroing. A training step makes such tensors over and over (the logits of a 49K vocabulary: 86 MiB for 440
tokens), and on this machine writing a fresh 86 MiB tensor takes 27 ms against 5 ms for one in reused memory
(4.8x slower; 32 MiB: 10.4 ms against 1.6 ms). With mmap off and trimming off, freed memory stays in the process
for the next step: its resident size stays at its peak, which a training process reaches anyway.
Only where a step makes tensors that large: on the packing benchmark's 3M model (16 MiB at most), cpu-2
measured 27.6 and 28.4 s without it against 32.3 and 29.9 s with it (40 steps), inside a noisy machine's
spread but not a gain.
"""

import ctypes
import gc
import sys
from dataclasses import dataclass

import torch

from moai_recipes import env
from moai_recipes.flavors import Flavor
from moai_recipes.planner.cpu_speed import process_threads
from moai_recipes.planner.plan import Plan, Workload
from moai_recipes.planner.timing import device_speed
from moai_recipes.train.world import World

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest dynamic mmap threshold on 64-bit: larger blocks always fault in


def keep_freed_memory_for(largest_tensor_bytes: int) -> bool:
    """keep_freed_memory() where a step's largest tensor (the logits of a micro-batch) is above what glibc would
    keep anyway."""
    return largest_tensor_bytes > MMAP_THRESHOLD_MAX and keep_freed_memory()


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks, and its trimming (mallopt(3): -1 disables it; a threshold, even
    2 GiB, the most its int takes, would hand a larger model's freed step back to the kernel), in this process; False
    where libc is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):  # musl and others: nothing to tune
        return False


@dataclass(frozen=True)
class ProcessSettings:
    """What prepare_process read for the loop (what it set is the process's own state)."""

    fault_oom_tokens: int | None  # MOAI_FAULT_OOM_TOKENS: larger micro-batches fail as out of memory (tests)
    fault_step_delay: float  # MOAI_FAULT_STEP_DELAY: seconds each step waits first (tests)
    fault_memory_headroom: int | None = None  # MOAI_FAULT_MEMORY_HEADROOM: a real memory limit after step 1 (tests)
    fault_nan_step: int | None = None  # MOAI_FAULT_NAN_STEP: the step whose embedding gradient is NaN (tests)
    peak_flops: float = 0.0  # this process's device, in the plan's compute dtype: MFU's denominator (0: unknown)


def prepare_process(plan: Plan, work: Workload, flavor: Flavor, world: World) -> ProcessSettings:
    """Set this process up for the loop `plan` runs: threads, allocator, collector; read the fault injection."""
    if world.device.type == "cpu":
        torch.set_num_threads(process_threads(flavor.num_devices))  # as the planner priced the steps
        keep_freed_memory_for(plan.token_budget * work.spec.vocab_size * 4)  # a micro-batch's fp32 logits: the largest
    # What exists now (the imports' half a million objects, the data) lives to the end of the process: out of the
    # collector's reach, neither the full collections during training nor the one at exit walk it again (that
    # last one took 1.0 s of a 3M model's run here; with it frozen, 0.02 s).
    gc.freeze()
    # The device's peak as the planner prices it: a GPU's data sheet (dense), the CPU's matmul measured at the threads
    # each of the flavor's processes gets (cached).
    peak, _ = device_speed(flavor.device, compute_dtype=plan.param_dtype, num_devices=flavor.num_devices)
    return ProcessSettings(fault_oom_tokens=env.fault_oom_tokens(), fault_step_delay=env.fault_step_delay(),
                           fault_memory_headroom=env.fault_memory_headroom(), fault_nan_step=env.fault_nan_step(),
                           peak_flops=peak)
