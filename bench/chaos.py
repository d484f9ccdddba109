"""Chaos: kill a cpu-2 run outright (SIGKILL to the launcher and every worker at once, as a lost machine or the
kernel's OOM killer would) at random moments, run the same command again each time, and check that the run ends
with the weights and the losses of an uninterrupted run, bit for bit.

    python bench/chaos.py --kills 30 --seed 0          # about 10 minutes on 2 cores

Moments are drawn from three kinds, a third each:
- `time`: a uniform moment of the run (start-up, tokenising, a step, a save, the export, the exit);
- `save`: while one of the step checkpoints still to come, drawn, is half-written (its .step-*.tmp folder exists;
  MOAI_FAULT_SAVE_DELAY holds it open 0.5 s so that the kill lands inside it);
- `export`: while the final model is half-written (its .model.tmp-* folder exists, held open alike).
A trial is one run folder killed up to 3 times, then let to finish. Prints one line per kill and a summary; exit 1
if any trial ends unlike the reference.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["flavor=cpu-2", "logger=stdout", "epochs=2", "batch_size=8", "max_steps=12", "optimizer.lr=3e-3",
        "optimizer.warmup_steps=2", "checkpoint_every=2", "sample_max_new_tokens=0"]
SAVES = [2, 4, 6, 8, 10]  # the step checkpoints ARGS make (none at the last step: the model is written instead)
ENV = {"WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "MOAI_FAULT_SAVE_DELAY": "0.5"}


def start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "recipes.full_finetune", *ARGS, f"output_dir={out}"], cwd=ROOT,
                            env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it, at once: no handler runs anywhere."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.communicate()
    psutil.wait_procs(family, timeout=30)


def wait_until(proc, ready, timeout=120) -> bool:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if ready():
            return True
        time.sleep(0.002)
    return False


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def same(out: Path, reference: Path) -> bool:
    a, b = load_file(reference / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and losses(out) == losses(reference)


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # each kill shows as it happens, also into a file
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/moai-chaos"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    shutil.rmtree(args.folder, ignore_errors=True)
    reference = args.folder / "reference"
    began = time.time()
    proc = start(reference)
    log = proc.communicate()[0]
    assert proc.returncode == 0, log
    duration = time.time() - began
    print(f"reference: {duration:.1f} s uninterrupted")

    kills, trials, bad, landed = 0, 0, [], {"time": 0, "save": 0, "export": 0, "missed": 0}
    while kills < args.kills:
        trials += 1
        out = args.folder / f"trial-{trials}"
        for _ in range(rng.randint(1, 3)):
            if kills >= args.kills:
                break
            kind = rng.choice(["time", "save", "export"])
            proc = start(out)
            if kind == "time":
                hit = not wait_until(proc, lambda: False, timeout=rng.uniform(0, duration))
            elif kind == "save":  # one of the saves still to come, drawn: not always the first
                saved = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*")] if out.exists() else []
                target = rng.choice([s for s in SAVES if s > max(saved, default=0)] or SAVES)
                hit = wait_until(proc, lambda: (out / "checkpoints" / f".step-{target:06d}.tmp").exists())
            else:
                hit = wait_until(proc, lambda: any(out.glob(".model.tmp-*")))
            if proc.poll() is not None:  # it ended first (finished, or nothing left to save): not a kill
                proc.communicate()
                landed["missed"] += 1
                print(f"trial {trials}: the run ended before the {kind} kill")
                continue
            kill_all(proc)
            kills += 1
            landed[kind] += hit
            steps = len(losses(out)) if (out / "metrics.jsonl").exists() else 0
            print(f"trial {trials}: kill {kills} ({kind}{'' if hit else ', not in it'}) after {steps} logged step(s)")
        proc = start(out)
        log = proc.communicate()[0]
        if (out / "model").exists() and proc.returncode in (0, 2) and same(out, reference):
            print(f"trial {trials}: finished, bit for bit the reference's weights and losses")
        else:
            bad.append(trials)
            print(f"trial {trials}: DIFFERS or failed (exit {proc.returncode})\n{log[-3000:]}")
    print(f"\n{kills} kills in {trials} trials ({landed['time']} at random moments, {landed['save']} inside a step "
          f"checkpoint, {landed['export']} inside the export; {landed['missed']} drawn moments came after the run's "
          f"end): {trials - len(bad)} of {trials} trials ended bit for bit as the uninterrupted run"
          + (f"; differing: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
