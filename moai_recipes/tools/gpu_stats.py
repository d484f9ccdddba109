"""What this machine's GPUs report for `moai smi`: memory used and total, utilisation, memory per process.

Asked of NVML (`pynvml`) when it imports, else of `nvidia-smi` or `rocm-smi`; None without GPUs.
Test: `python -m pytest tests/test_cli.py -q -k gpu` (a stand-in nvidia-smi on PATH).
"""

import json
import shutil
import subprocess
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class GpuReading:
    used_mib: float  # over all GPUs
    total_mib: float
    utilization: float  # mean over the GPUs, percent
    per_pid_mib: dict[int, float] | None  # None: the tool cannot tell (rocm-smi)


def read_gpus() -> GpuReading | None:
    """The first answer of NVML, nvidia-smi or rocm-smi; None when none is there or none answers."""
    for reader in (_nvml, _nvidia_smi, _rocm_smi):
        try:
            reading = reader()
        except Exception:  # a broken driver or tool must not break `moai smi`: try the next
            reading = None
        if reading is not None:
            return reading
    return None


def _nvml() -> GpuReading | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        used = total = util = 0.0
        per_pid: dict[int, float] = {}
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            used, total = used + mem.used / MiB, total + mem.total / MiB
            util += pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                per_pid[p.pid] = per_pid.get(p.pid, 0.0) + (p.usedGpuMemory or 0) / MiB
        return GpuReading(used, total, util / count, per_pid) if count else None
    finally:
        pynvml.nvmlShutdown()


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout


def _number(text: str) -> float:
    """nvidia-smi writes `[N/A]` for what it cannot measure (utilisation under MIG): count it as 0."""
    try:
        return float(text)
    except ValueError:
        return 0.0


def _nvidia_smi() -> GpuReading | None:
    if not shutil.which("nvidia-smi"):
        return None
    rows = [[_number(x) for x in line.split(",")] for line in
            _run("nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu",
                 "--format=csv,noheader,nounits").splitlines() if line.strip()]
    if not rows:
        return None
    per_pid: dict[int, float] = {}
    for line in _run("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits").splitlines():
        if line.strip():
            pid, mib = (x.strip() for x in line.split(","))
            per_pid[int(pid)] = per_pid.get(int(pid), 0.0) + _number(mib)
    return GpuReading(sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows) / len(rows), per_pid)


def _rocm_smi() -> GpuReading | None:
    if not shutil.which("rocm-smi"):
        return None
    cards = {k: v for k, v in json.loads(_run("rocm-smi", "--showmeminfo", "vram", "--showuse", "--json")).items()
             if k.startswith("card")}
    if not cards:
        return None
    used = sum(float(c["VRAM Total Used Memory (B)"]) for c in cards.values()) / MiB
    total = sum(float(c["VRAM Total Memory (B)"]) for c in cards.values()) / MiB
    util = sum(float(c.get("GPU use (%)", 0)) for c in cards.values()) / len(cards)
    return GpuReading(used, total, util, None)
