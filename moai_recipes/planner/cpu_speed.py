"""How fast this machine's CPU is, measured: the planner's peak figures for the CPU flavors.

A GPU's peak FLOP/s and memory bandwidth come from its data sheet (flavors.DEVICES); a CPU's vary by
machine, so they are measured here once, for the threads one process of a flavor gets, and cached
beside the layer traces. Measuring takes a fraction of a second.

A measurement taken while other processes kept the cores it needs busy (a test suite, a build, another run) reads
the CPU slower than it is, and a cached low peak would show MFUs over 100% and slow predicted steps for good. So
each measurement records whether the machine was quiet (the other processes' CPU time over its window, from
/proc/stat); one that was not is kept only for a while (MEASURE_BUSY_AGAIN_S) and then measured again, each rate
the best of all its measurements: another process only ever slows a measurement down.
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
from moai_recipes.files import cache_dir, write_json


@dataclass(frozen=True)
class CpuSpeed:
    fp32_flops: float  # per second, a large fp32 matmul
    bytes_per_s: float  # memory read and written per second by a large elementwise op
    bf16_flops: float  # per second, a large bf16 matmul (faster than fp32 where the CPU has bf16 dot products)
    quiet: bool = True  # no other process used the cores measured while they were measured
    measured_at: float = 0.0  # time.time() of the last measurement


MEASURE_BUSY_AGAIN_S = 600  # a measurement of a busy machine is taken again after this long


def process_threads(num_processes: int) -> int:
    """The intra-op threads of one of `num_processes` processes on this machine: the user's OMP_NUM_THREADS (as
    torchrun honours it), else an equal share of the cores. What train/process.py gives each training process."""
    return env.omp_threads() or max(1, (os.cpu_count() or 1) // num_processes)


def cpu_speed(threads: int) -> CpuSpeed:
    """This machine's CPU with `threads` threads, measured once and cached (measured again later if the machine was
    busy)."""
    key = speed_key(threads)
    path = cache_dir() / "cpu-speed.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    old = known.get(key)
    if old is None or (not old.get("quiet", True) and time.time() - old.get("measured_at", 0) > MEASURE_BUSY_AGAIN_S):
        known[key] = _best_of(old, _measure_apart(threads))
        if not known[key]["quiet"]:
            print(f"note: this CPU was measured ({threads} threads) while other processes kept its cores busy; MFU "
                  f"and predicted step times may read high until it is measured again, in {MEASURE_BUSY_AGAIN_S // 60} "
                  "minutes or more", file=sys.stderr, flush=True)
        try:  # a cache: a read-only home only costs the measurement next time
            write_json(path, known)
        except OSError:
            pass
    return CpuSpeed(**known[key])


def speed_key(threads: int) -> str:
    """This machine's entry in the cache file (cpu-speed.json): its kernels' instruction set too, which a user may hold
    below the CPU's (ATEN_CPU_CAPABILITY=avx2, as scripts/as_avx2.sh does: bf16 then runs emulated, 300 times
    slower)."""
    return (f"{_cpu_name()}|{os.cpu_count()}|{threads}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}"
            "|3")  # |3: whether it was quiet too


def _best_of(old: dict | None, new: dict) -> dict:
    """A new measurement kept with an older one: each rate the faster of the two (load only slows a measurement
    down); quiet if either was."""
    if old is None:
        return new
    rates = {k: max(old[k], new[k]) for k in ("fp32_flops", "bytes_per_s", "bf16_flops")}
    return {**rates, "quiet": old["quiet"] or new["quiet"], "measured_at": new["measured_at"]}


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


def _busy_seconds() -> float | None:
    """CPU seconds all processes of this machine have used since it started (/proc/stat), None where unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _bf16_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """A bf16 product's rate. Measured on a 256-square product first: a CPU without bf16 dot products (AVX2 only)
    emulates them at about 1 GFLOP/s, where the 1024-square product would take 2 s a run and the measurement 5 s or
    more; only a CPU that is fast there measures the larger one, whose rate it reaches only at that size."""
    a16, b16 = a[:256, :256].bfloat16(), b[:256, :256].bfloat16()
    small = _best_rate(2 * 256**3, lambda: torch.mm(a16, b16), seconds=0.05)
    if small < 10e9:
        return small
    a16, b16 = a.bfloat16(), b.bfloat16()
    return _best_rate(2 * 1024**3, lambda: torch.mm(a16, b16))


def _measure(threads: int) -> CpuSpeed:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    busy, own, start = _busy_seconds(), time.process_time(), time.perf_counter()
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        flops = _best_rate(2 * 1024**3, lambda: torch.mm(a, b))
        bf16_flops = _bf16_rate(a, b)
        # 128 MiB each: beyond the caches (virtual machines report L3 caches of hundreds of MiB).
        x, y = torch.randn(2**25), torch.randn(2**25)
        out = torch.empty_like(x)
        bandwidth = _best_rate(3 * x.numel() * 4, lambda: torch.add(x, y, out=out))
    finally:
        torch.set_num_threads(before)
    # The cores other processes used meanwhile; quiet when they left this measurement its threads' cores (0.15 of
    # a core spare: the kernel's own work, a shell).
    others = 0.0
    if busy is not None and (now := _busy_seconds()) is not None:
        others = (now - busy - (time.process_time() - own)) / (time.perf_counter() - start)
    quiet = others <= (os.cpu_count() or 1) - threads + 0.15
    return CpuSpeed(fp32_flops=flops, bytes_per_s=bandwidth, bf16_flops=bf16_flops, quiet=quiet,
                    measured_at=time.time())

