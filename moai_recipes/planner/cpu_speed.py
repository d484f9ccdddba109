"""How fast this machine's CPU is, measured: the planner's peak figures for the CPU flavors.

A GPU's peak FLOP/s and memory bandwidth come from its data sheet (flavors.DEVICES); a CPU's vary by
machine, so they are measured here once, for the threads one process of a flavor gets, and cached
beside the layer traces. Measuring takes a fraction of a second.
"""

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moai_recipes import env
from moai_recipes.files import cache_dir


@dataclass(frozen=True)
class CpuSpeed:
    fp32_flops: float  # per second, a large fp32 matmul
    bytes_per_s: float  # memory read and written per second by a large elementwise op
    bf16_flops: float  # per second, a large bf16 matmul (faster than fp32 where the CPU has bf16 dot products)


def process_threads(num_processes: int) -> int:
    """The intra-op threads of one of `num_processes` processes on this machine: the user's OMP_NUM_THREADS (as
    torchrun honours it), else an equal share of the cores. What train/process.py gives each training process."""
    return env.omp_threads() or max(1, (os.cpu_count() or 1) // num_processes)


def cpu_speed(threads: int) -> CpuSpeed:
    """This machine's CPU with `threads` threads, measured once and cached."""
    key = speed_key(threads)
    path = cache_dir() / "cpu-speed.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = _measure_apart(threads)
        try:  # a cache: a read-only home only costs the measurement next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return CpuSpeed(**known[key])


def speed_key(threads: int) -> str:
    """This machine's entry in the cache file (cpu-speed.json)."""
    return f"{_cpu_name()}|{os.cpu_count()}|{threads}|{torch.__version__}|2"  # |2: bf16 measured too


_APART = "import sys, json, dataclasses; from moai_recipes.planner.cpu_speed import _measure; " \
         "print(json.dumps(dataclasses.asdict(_measure(int(sys.argv[1])))))"


def _measure_apart(threads: int) -> dict:
    """Measure in a process of its own: its arrays (384 MiB) and thread settings must not stay in a training
    process, whose peak memory is measured (ru_maxrss would keep them for good)."""
    try:
        done = subprocess.run([sys.executable, "-c", _APART, str(threads)], capture_output=True,
                              text=True, timeout=120, check=True)
        return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return asdict(_measure(threads))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best_rate(work: float, op, seconds: float = 0.15) -> float:
    """`work` units per second of `op`, the best of repeated runs: other load only ever slows it."""
    op()  # warm up (thread pool, allocations)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        op()
        best = max(best, work / (time.perf_counter() - start))
    return best


def _measure(threads: int) -> CpuSpeed:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        flops = _best_rate(2 * 1024**3, lambda: torch.mm(a, b))
        a16, b16 = a.bfloat16(), b.bfloat16()
        bf16_flops = _best_rate(2 * 1024**3, lambda: torch.mm(a16, b16))
        # 128 MiB each: beyond the caches (virtual machines report L3 caches of hundreds of MiB).
        x, y = torch.randn(2**25), torch.randn(2**25)
        out = torch.empty_like(x)
        bandwidth = _best_rate(3 * x.numel() * 4, lambda: torch.add(x, y, out=out))
    finally:
        torch.set_num_threads(before)
    return CpuSpeed(fp32_flops=flops, bytes_per_s=bandwidth, bf16_flops=bf16_flops)

