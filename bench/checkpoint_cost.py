"""Checkpoint cost: seconds and MiB of a step checkpoint of the tiny model, against a step of the same run.

    python bench/checkpoint_cost.py                           # 3 runs of 12 steps, a checkpoint every 2 (~1 min)
    python bench/checkpoint_cost.py --steps 24 --every 4      # longer runs, checkpoints further apart
    python bench/checkpoint_cost.py --workdir /tmp/ckpt-cost  # keep the run folders and their logs

Run it from the repository root. Each run is the command a user types:

    python -m recipes.full_finetune model=tiny logger=stdout flavor=cpu   checkpoint_every=2 max_steps=12 ...
    python -m recipes.full_finetune model=tiny logger=stdout flavor=cpu-2 checkpoint_every=2 max_steps=12 ...
    python -m recipes.lora_finetune model=tiny logger=stdout flavor=cpu-2 checkpoint_every=2 max_steps=12 ...

and the numbers are what the run recorded: checkpoints.jsonl (each checkpoint's seconds and bytes, from
moai_recipes.checkpoint.steps.save_checkpoint: every rank's DCP shards of the trainable parameters and their
optimizer state, RNG, scheduler, meta.json, the rename and the rotation, barrier to barrier) and
metrics.jsonl (step_time_s; step 1 left out, it warms up). The table gives medians over the run's
checkpoints and steps, and the ratio: a checkpoint costs that many steps. docs/benchmarks.md
("Checkpoint cost") records a run. Exit status 1 if a run fails (the end of its log is printed).
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"full, cpu": ("full_finetune", "cpu"), "full, cpu-2": ("full_finetune", "cpu-2"),
        "lora, cpu-2": ("lora_finetune", "cpu-2")}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(name: str, args, work: Path) -> dict:
    recipe, flavor = RUNS[name]
    out = work / name.replace(", ", "-")
    cmd = [sys.executable, "-m", f"recipes.{recipe}", "model=tiny", "logger=stdout", f"flavor={flavor}",
           f"checkpoint_every={args.every}", f"max_steps={args.steps}", f"batch_size={args.batch_size}",
           "epochs=100", "sample_max_new_tokens=0", f"output_dir={out}"]  # epochs: max_steps is the limit
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    log = work / f"{out.name}.log"
    with open(log, "w") as f:  # its own process group: a timeout kills the workers of cpu-2 too
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        sys.exit(f"{name} failed ({rc}): {' '.join(cmd)}\n{log.read_text()[-4000:]}\nThe whole log: {log}")
    ckpts, steps = rows(out / "checkpoints.jsonl"), [m["step_time_s"] for m in rows(out / "metrics.jsonl")[1:]]
    seconds = [c["seconds"] for c in ckpts]
    return {"command": " ".join(["python -m", f"recipes.{recipe}", *cmd[3:-1]]), "count": len(ckpts),
            "s": statistics.median(seconds), "s_range": (min(seconds), max(seconds)),
            "mib": statistics.median(c["bytes"] for c in ckpts) / 2**20, "step_s": statistics.median(steps)}


def table(results: dict[str, dict]) -> str:
    lines = ["| run | checkpoints | s per checkpoint (min-max) | MiB per checkpoint | s per step | checkpoint / step |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lo, hi = r["s_range"]
        lines.append(f"| {name} | {r['count']} | {r['s']:.3f} ({lo:.3f}-{hi:.3f}) | {r['mib']:.2f} | "
                     f"{r['step_s']:.3f} | {r['s'] / r['step_s']:.1f} steps |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    p.add_argument("--every", type=int, default=2, help="checkpoint_every (default 2: 5 checkpoints in 12 steps)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences (default 8)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run is given up (default 600)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the runs here (default: a temporary folder, removed on success)")
    args = p.parse_args()
    if args.steps <= args.every:
        p.error("--steps must be larger than --every: the last step saves the model, not a checkpoint")
    import torch

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moai-checkpoint-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    results = {name: run(name, args, work) for name in RUNS}  # a failed run exits, its folder and log kept
    weights = sum(f.stat().st_size for f in (work / "full-cpu" / "model").glob("*.safetensors")) / 2**20
    if args.workdir is None:
        shutil.rmtree(work)
    print(f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"1-minute load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; the tiny model's weights "
          f"{weights:.2f} MiB (fp32); batch {args.batch_size}, {args.steps} steps, a checkpoint every {args.every}\n")
    print(table(results) + "\n")
    for name, r in results.items():
        print(f"{name}: {r['command']}")
    print(f"\nCommand: python bench/checkpoint_cost.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
