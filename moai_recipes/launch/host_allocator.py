"""On the CPU, the C allocator keeps the memory that freed tensors held, so the next ones need no fresh pages.

glibc serves an allocation above its mmap threshold (at most 32 MiB) with fresh pages from the kernel and
returns them on free; every new tensor that large then pays a page fault per 4 KiB and the kernel's zeroing.
A training step makes such tensors over and over (the logits of a 49K vocabulary: 86 MiB for 440 tokens), and
on this machine writing a fresh 86 MiB tensor takes 27 ms against 5 ms for one in reused memory (4.8x slower;
32 MiB: 10.4 ms against 1.6 ms). With mmap off and trimming off, freed memory stays in the process for the
next step: its resident size stays at its peak, which a training process reaches anyway.
Only where a step makes tensors that large: on the packing benchmark's 3M model (16 MiB at most), cpu-2
measured 27.6 and 28.4 s without it against 32.3 and 29.9 s with it (40 steps), inside a noisy machine's
spread but not a gain.
"""

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest dynamic mmap threshold on 64-bit: larger blocks always fault in


def keep_freed_memory_for(largest_tensor_bytes: int) -> bool:
    """keep_freed_memory() where a step's largest tensor (the logits of a micro-batch) is above what glibc would
    keep anyway."""
    return largest_tensor_bytes > MMAP_THRESHOLD_MAX and keep_freed_memory()


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks, and its trimming below 2 GiB (the most its int takes), in this process;
    False where libc is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # musl and others: nothing to tune
        return False
