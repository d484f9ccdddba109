"""`moai smi`: the current flavor as one virtual MoAI Accelerator and the recipes running on it, as moreh-smi shows them.

Figures are measured, not predicted. On the CPU flavors a run's memory is the resident memory of its
process tree (the recipe and the workers it launched) and its utilisation the share of this
machine's cores it keeps busy; on GPU flavors both come from NVML, nvidia-smi or rocm-smi
(gpu_stats.py). A run on a flavor other than the current one (flavor= on its command line) shows
that flavor as one more device. Test: `python -m pytest tests/test_cli.py -q`.
"""

import time
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version

import psutil

from moai_recipes.config.shipped_flavors import FlavorOption
from moai_recipes.launch.registry import Run, process_tree, running
from moai_recipes.tools.gpu_stats import MiB, read_gpus

COMMAND_WIDTH = 60  # longer command lines are cut, so that the table stays readable


@dataclass(frozen=True)
class Usage:
    memory_mib: float | None  # None: nothing to report, shown as "-"
    utilization: float | None  # percent
    gpus_used_mib: float | None = None  # all of this machine's GPUs: the device's figure when per process is unknown


@dataclass(frozen=True)
class Device:
    name: str  # the flavor: 4xLarge.2048GB
    total_mib: float
    runs: list[Run]


def measure(runs: list[Run], seconds: float = 0.5) -> dict[int, Usage]:
    """Each run's memory and utilisation, by pid: CPU figures sampled over `seconds`, GPU ones from the driver."""
    trees = {r.pid: process_tree(r.pid) for r in runs}
    for procs in trees.values():
        _sum(procs, lambda p: p.cpu_percent(None))  # the first call starts the measurement
    if any(r.device_kind == "cpu" for r in runs):
        time.sleep(seconds)
    gpu = read_gpus() if any(r.device_kind == "gpu" for r in runs) else None
    usage = {}
    for r in runs:
        procs = trees[r.pid]
        if r.device_kind == "cpu":
            usage[r.pid] = Usage(_sum(procs, lambda p: p.memory_info().rss) / MiB,
                                 _sum(procs, lambda p: p.cpu_percent(None)) / (psutil.cpu_count() or 1))
        elif gpu is None:
            usage[r.pid] = Usage(None, None)
        else:  # "-" where the tool cannot tell memory per process (rocm-smi; nvidia-smi in a container)
            mine = [gpu.per_pid_mib[p.pid] for p in procs if p.pid in (gpu.per_pid_mib or {})]
            usage[r.pid] = Usage(sum(mine) if mine else None, gpu.utilization, gpu.used_mib)
    return usage


def _sum(procs: list[psutil.Process], read) -> float:
    total = 0.0
    for p in procs:
        try:
            total += read(p)
        except psutil.Error:  # a worker that ended in between
            pass
    return total


def devices(current: FlavorOption, runs: list[Run]) -> list[Device]:
    """Device 0 is the current flavor; any other flavor a run uses is one more device."""
    found = {current.name: Device(current.name, current.flavor.total_memory_gb * 1024, [])}
    for r in runs:
        found.setdefault(r.flavor, Device(r.flavor, r.total_memory_gb * 1024, [])).runs.append(r)
    return list(found.values())


def _box(headers: list[str], rows: list[list[str]], aligns: str, title: str | None = None) -> list[str]:
    """A moreh-smi table; `aligns` has one letter per column: l (indented two), c, r."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 4 for i, h in enumerate(headers)]
    inner = sum(widths) + len(widths) - 1
    rule = "+" + "-" * inner + "+"
    align = {"l": lambda t, w: ("  " + t).ljust(w), "c": lambda t, w: t.center(w), "r": lambda t, w: (t + "  ").rjust(w)}
    lines = [rule] + (["|" + (title + "  ").rjust(inner) + "|", rule] if title else [])
    lines.append("|" + "|".join(h.center(w) for h, w in zip(headers, widths)) + "|")
    lines.append("+" + "=" * inner + "+")
    lines += ["|" + "|".join(align[a](t, w) for t, w, a in zip(r, widths, aligns)) + "|" for r in rows]
    return lines + [rule]


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} MiB"


def render(now: datetime, devices: list[Device], usage: dict[int, Usage]) -> list[str]:
    """The lines of `moai smi`: the time, the devices and, while recipes run, their processes."""
    rows, processes = [], []
    for i, d in enumerate(devices):
        figures = [usage[r.pid] for r in d.runs]
        memory = [u.memory_mib for u in figures if u.memory_mib is not None]
        memory = sum(memory) if memory else max((u.gpus_used_mib for u in figures if u.gpus_used_mib), default=None)
        busy = [u.utilization for u in figures if u.utilization is not None]
        # CPU runs each keep their share of the cores busy; GPU runs all report the same GPUs' figure.
        busy = (max if d.runs and d.runs[0].device_kind == "gpu" else sum)(busy) if busy else None
        rows.append([f"{'* ' if i == 0 else '  '}{i}", "MoAI Accelerator", d.name, _mib(memory),
                     _mib(d.total_mib), "-" if busy is None else f"{busy:.0f} %"])
        for r in d.runs:
            command = " ".join(r.command.split())  # one line, even for `python -c '<a script>'`
            command = command if len(command) <= COMMAND_WIDTH else command[:COMMAND_WIDTH - 3] + "..."
            processes.append([str(i), r.job_id, str(r.pid), command, _mib(usage[r.pid].memory_mib)])
    lines = [now.strftime("%H:%M:%S %B %d, %Y")]
    lines += _box(["Device", "Name", "Model", "Memory Usage", "Total Memory", "Utilization"], rows, "lcllll",
                  title=f"moai-recipes Version: {_version()}")
    if processes:
        lines += ["", "Processes:"]
        lines += _box(["Device", "Job ID", "PID", "Process", "Memory Usage"], processes, "rcccl")
    return lines


def _version() -> str:
    try:
        return version("moai-recipes")
    except PackageNotFoundError:
        return "unknown"


def smi_lines(current: FlavorOption) -> list[str]:
    runs = running()
    return render(datetime.now(), devices(current, runs), measure(runs))
