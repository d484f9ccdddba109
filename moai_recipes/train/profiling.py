"""profile_steps=[...]: where the chosen steps' time goes, measured by torch.profiler (this module is its one boundary).

Each profiled step leaves, per rank, a Chrome/Perfetto trace (OUTPUT_DIR/profile/step<N>-rank<R>.json: open it in
https://ui.perfetto.dev) and the table of the ops that took the time (step<N>-rank<R>.txt); rank 0 prints the table's
head. A profiled step is slower than the others (the profiler records every op), so the step line says so, its
metrics row carries `profiled: true`, and the planner's step-time check leaves it out.
"""

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_TABLE_ROWS = 25  # the file's table; the log prints the first lines of it


class StepProfiler:
    def __init__(self, steps, out: Path, *, rank: int, device: torch.device):
        self.steps = set(steps or ())
        self.folder = Path(out) / "profile"
        self.rank = rank
        self.device = device
        self.tables: dict[int, str] = {}  # step -> this rank's op table, as written to its .txt

    def _name(self, step: int) -> str:
        """What this rank's files of step `step` are called (.json, .txt)."""
        return f"step{step}-rank{self.rank}"

    def profiled(self, step: int) -> bool:
        return step in self.steps

    def step(self, step: int):
        """A context that profiles step `step` if it was asked for, else does nothing."""
        return self._profile(step) if step in self.steps else nullcontext()

    @contextmanager
    def _profile(self, step: int):
        on_gpu = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities, record_shapes=True) as prof:
            yield
        self.folder.mkdir(parents=True, exist_ok=True)
        name = self._name(step)
        prof.export_chrome_trace(str(self.folder / f"{name}.json"))
        # Self time: an op's own time, not its children's, so the rows add up to the step and name the kernels.
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=_TABLE_ROWS)
        (self.folder / f"{name}.txt").write_text(table)
        self.tables[step] = table

    def summary(self, step: int, lines: int = 12) -> str | None:
        """The head of step `step`'s table (rank 0 logs it), or None when it was not profiled here."""
        if step not in self.tables:
            return None
        head = self.tables[step].splitlines()[:lines + 3]  # the header's rule, titles and rule
        name = self._name(step)
        return f"Profile of step {step} ({self.folder}/{name}.json, the whole table in {name}.txt):\n" + "\n".join(head)
