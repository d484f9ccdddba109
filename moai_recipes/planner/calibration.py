"""Calibration from use: what every run predicted and measured, kept on the machine, and the planner's constants
refitted from it (`moai calibrate`).

Each training run appends one line to `calibration/runs.jsonl` under moai_home() at its end (rank 0): the
device, the plan and the data's shape, the step-time terms the planner added up (timing.TERMS, under its
default constants) with the median step measured, and the peak memory predicted for the micro-batches
measured (split into what is counted exactly: parameters, gradients, optimizer state, gathered layers; and
what is traced: activations and logits) with the peak measured.

`moai calibrate` fits, per device, a scale for each step-time term and one for the traced memory: least
squares on the log of predicted over measured, pulled towards 1 so that a term the runs barely exercise keeps
its default. It writes `calibration/fit.json`, which the planner reads from then on (each term times its
scale), and prints the error before and after, the after also held out (each fifth of the runs predicted by
a fit to the other four fifths). `moai calibrate --reset` goes back to the defaults.
"""

import functools
import json
import os
import statistics
import time
from pathlib import Path

from moai_recipes.config.user_settings import moai_home
from moai_recipes.errors import UserError
from moai_recipes.files import write_json
from moai_recipes.planner.timing import TERMS, combine

RUNS = "runs.jsonl"
FIT = "fit.json"
MEMORY = "traced_memory"  # the scale of the traced activations and logits
PRIOR = 0.01  # weight of the pull of each log-scale towards 0 (a scale of 1) against the squared log errors
FOLDS = 5


def folder() -> Path:
    return moai_home() / "calibration"


def record(entry: dict) -> None:
    """Append one run's predictions and measurements; a machine where the file cannot be written loses only it."""
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **entry}) + "\n"
    try:
        folder().mkdir(parents=True, exist_ok=True)
        # One write of one line to a file opened for appending: concurrent runs never interleave their lines.
        fd = os.open(folder() / RUNS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read_runs() -> list[dict]:
    """The recorded runs; a damaged line (a full disk mid-write) is skipped."""
    try:
        text = (folder() / RUNS).read_text()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UserError(f"cannot read {folder() / RUNS} ({e.strerror or e}); check its permissions") from None
    runs = []
    for line in text.splitlines():
        try:
            runs.append(json.loads(line))
        except ValueError:
            continue
    return runs


def scales(device: str) -> dict:
    """The fitted scales of `device` ({} when never calibrated): timing.TERMS and MEMORY. Read from the fit file as it
    is now: a process that plans again after `moai calibrate`, or under another MOAI_HOME, sees that one's."""
    path = folder() / FIT
    try:
        st = path.stat()
    except OSError:
        return {}
    fitted = _fit_file(str(path), (st.st_ino, st.st_mtime_ns, st.st_size)).get(device, {})
    return dict(fitted.get("scales", {})) if isinstance(fitted, dict) else {}


@functools.lru_cache(maxsize=8)
def _fit_file(path: str, stamp: tuple) -> dict:
    """fit.json's contents as of `stamp` (its inode, modification time and size: a rewrite is a new file, renamed
    into place), {} if unreadable."""
    try:
        fit = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return fit if isinstance(fit, dict) else {}


def _time_error(run: dict, fitted: dict) -> float:
    """(measured - predicted) / predicted, as a run's last lines say it."""
    predicted = combine(run["time_terms"], run["kind"], fitted)["total_s"]
    return run["measured_step_s"] / predicted - 1


def _memory_error(run: dict, fitted: dict) -> float:
    predicted = run["memory_exact"] + run["memory_traced"] * fitted.get(MEMORY, 1.0)
    return run["measured_peak_bytes"] / predicted - 1


def fit(runs: list[dict]) -> dict:
    """Scales of one device's runs: the log-scales that minimise the mean squared log error plus the prior (L-BFGS)."""
    import torch

    timed = [r for r in runs if r.get("measured_step_s")]
    peaks = [r for r in runs if r.get("measured_peak_bytes")]
    log_s = torch.zeros(len(TERMS) + 1, dtype=torch.float64, requires_grad=True)
    columns = {k: torch.tensor([r["time_terms"].get(k, 0.0) for r in timed], dtype=torch.float64) for k in TERMS}
    measured = torch.tensor([r["measured_step_s"] for r in timed], dtype=torch.float64)
    kind = timed[0]["kind"] if timed else "cpu"  # a device has one kind
    exact = torch.tensor([r["memory_exact"] for r in peaks], dtype=torch.float64)
    traced = torch.tensor([r["memory_traced"] for r in peaks], dtype=torch.float64)
    peak = torch.tensor([r["measured_peak_bytes"] for r in peaks], dtype=torch.float64)
    opt = torch.optim.LBFGS([log_s], max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def objective():
        opt.zero_grad()
        s = {k: log_s[i].exp() for i, k in enumerate(TERMS)}
        loss = PRIOR * (log_s ** 2).sum()
        if timed:
            total = combine(columns, kind, s, maximum=torch.maximum)["total_s"]
            loss = loss + ((total.clamp_min(1e-12).log() - measured.log()) ** 2).mean()
        if peaks:
            loss = loss + (((exact + traced * log_s[-1].exp()).log() - peak.log()) ** 2).mean()
        loss.backward()
        return loss

    opt.step(objective)
    values = log_s.detach().exp().tolist()
    return {**{k: round(values[i], 4) for i, k in enumerate(TERMS)}, MEMORY: round(values[-1], 4)}


def _median_abs(errors: list[float]) -> float | None:
    return statistics.median(abs(e) for e in errors) if errors else None


def _held_out(runs: list[dict]) -> tuple[list[float], list[float]]:
    """Each run's errors as predicted by a fit to the runs outside its fifth (every fifth run, by position)."""
    time_errors, memory_errors = [], []
    for k in range(min(FOLDS, len(runs))):
        rest = [r for i, r in enumerate(runs) if i % FOLDS != k]
        fitted = fit(rest)
        for r in runs[k::FOLDS]:
            if r.get("measured_step_s"):
                time_errors.append(_time_error(r, fitted))
            if r.get("measured_peak_bytes"):
                memory_errors.append(_memory_error(r, fitted))
    return time_errors, memory_errors


def calibrate(*, reset: bool = False) -> list[str]:
    """Refit every device's scales from the recorded runs and write fit.json; the report, a line each."""
    path = folder() / FIT
    if reset:
        path.unlink(missing_ok=True)
        return [f"Removed {path}: plans on this machine use the default constants again."]
    runs = read_runs()
    by_device: dict[str, list[dict]] = {}
    for r in runs:
        by_device.setdefault(r["device"], []).append(r)
    usable = {d: rs for d, rs in by_device.items() if len(rs) >= 3}
    if not usable:
        raise UserError(f"{len(runs)} run(s) recorded in {folder() / RUNS}: calibrating needs 3 at least on one device. "
                        "Every training run records itself at its end (runs of 3 steps or more give a step time); "
                        "train on this machine, then run moai calibrate again")
    lines, fits = [f"Calibration of the planner on this machine from {len(runs)} recorded run(s) ({folder() / RUNS}):"], {}
    for device, rs in sorted(usable.items()):
        fitted = fit(rs)
        held_time, held_memory = _held_out(rs)
        summary = {}
        for what, error, held in (("step time", _time_error, held_time), ("peak memory", _memory_error, held_memory)):
            key = "measured_step_s" if what == "step time" else "measured_peak_bytes"
            measured = [r for r in rs if r.get(key)]
            before = [error(r, {}) for r in measured]
            after = [error(r, fitted) for r in measured]
            if not measured:
                continue
            summary[what] = {"runs": len(measured), "before": _median_abs(before), "after": _median_abs(after),
                             "held_out": _median_abs(held), "worst_before": max(map(abs, before)),
                             "worst_after": max(map(abs, after))}
            s = summary[what]
            lines.append(f"  {device}, {what} ({s['runs']} runs): median |error| {s['before']:.1%} with the defaults, "
                         f"{s['after']:.1%} calibrated ({s['held_out']:.1%} held out); worst {s['worst_before']:.1%} -> "
                         f"{s['worst_after']:.1%}")
        used = {k for r in rs for k, v in r.get("time_terms", {}).items() if v > 0}
        lines.append(f"  {device}, scales: " + ", ".join(
            f"{k} {v:.3g}" + ("" if k in used or k == MEMORY else " (no run used it)") for k, v in fitted.items()))
        fits[device] = {"scales": fitted, "runs": len(rs), "error": summary}
    try:
        write_json(path, fits)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}); set MOAI_HOME to a folder you can write") from None
    lines.append(f"Written to {path}: plans on this machine use it from now on (moai calibrate --reset: the defaults).")
    return lines


def run_entry(about: dict, *, time_terms: dict, memory, measured_step_s: float | None,
              measured_peak_bytes: int) -> dict:
    """One line of runs.jsonl: `about` the run (device, kind, recipe, flavor, plan, workload, shapes), the planner's
    step-time terms and its MemoryBreakdown at the measured micro-batches, and what was measured."""
    traced = memory.activations + memory.logits
    return {**about, "time_terms": time_terms, "measured_step_s": measured_step_s,
            "memory_exact": memory.allocated - traced, "memory_traced": traced,
            "measured_peak_bytes": measured_peak_bytes}
