"""What measuring a run's peak memory costs it: the same command with `measure_memory=true` (the default: on the
CPU MemTracker follows every tensor of the second step; of the first two until 2026-11-29) and
`measure_memory=false`, whole runs timed.

    python bench/memory_measurement.py                  # the demo (one process) and its cpu-2 full twin, 3 rounds
    python bench/memory_measurement.py --rounds 1 --jobs demo

The jobs:
  demo     `make demo`'s command: LoRA on SmolLM2-135M, flavor=cpu, 24 steps
  cpu-2    the same model and data, full fine-tuning on flavor=cpu-2 (FSDP2 over two gloo processes), 24 steps

Each command runs in a new process (the model converted once before, outside the timing); the two settings
alternate within each round. Measured: the wall time of the whole command, and from its step lines the first
two steps' and the later steps' durations. The ratio is the median total with the measurement over the median
without it; the spread is the lowest and highest run of each.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ["model=smollm2_135m", "dataset=facts", "epochs=6", "batch_size=8", "logger=stdout"]
JOBS = {
    "demo": ("recipes.lora_finetune", [*SMOLLM2, "flavor=cpu", "optimizer.lr=2e-3", "optimizer.warmup_steps=4",
                                       "lora.rank=16", "lora.alpha=32",
                                       "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]",
                                       "lora.apply_to_mlp=true"]),
    "cpu-2": ("recipes.full_finetune", [*SMOLLM2, "flavor=cpu-2", "optimizer.lr=1e-5"]),
}
STEP = re.compile(r"\[Step (\d+)/\d+\].*?Duration: ([\d.]+)")


def run(module: str, args: list[str], out: Path) -> dict:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", module, *args, f"output_dir={out}"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "WANDB_SILENT": "true"})
    total = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"{module} {' '.join(args)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    steps = {int(n): float(s) for n, s in STEP.findall(r.stdout)}
    later = [v for k, v in steps.items() if k > 2]
    return {"total": total, "first two": steps.get(1, 0) + steps.get(2, 0),
            "later": statistics.median(later) if later else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # The model's conversion (once per machine) is not what is measured.
        module, args = JOBS["demo"]
        run(module, [*args, "max_steps=1", "sample_max_new_tokens=0"], Path(tmp) / "warm")
        results = {(job, measured): [] for job in opts.jobs for measured in (True, False)}
        for i in range(opts.rounds):
            for job in opts.jobs:
                for measured in ((True, False) if i % 2 == 0 else (False, True)):
                    module, args = JOBS[job]
                    r = run(module, [*args, f"measure_memory={str(measured).lower()}"],
                            Path(tmp) / f"{job}-{measured}-{i}")
                    results[job, measured].append(r)
                    print(f"round {i + 1} {job:6} measure_memory={str(measured).lower():5}: {r['total']:6.1f} s "
                          f"(steps 1-2 {r['first two']:5.2f} s, later steps {r['later']:.2f} s)", flush=True)
    print(f"\n{'job':6} | measured: total (min-max) | not measured: total (min-max) | ratio | steps 1-2: measured, not")
    for job in opts.jobs:
        on, off = results[job, True], results[job, False]
        med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
        span = lambda rs: f"{min(r['total'] for r in rs):.1f}-{max(r['total'] for r in rs):.1f}"  # noqa: E731
        print(f"{job:6} | {med(on, 'total'):6.1f} s ({span(on)}) | {med(off, 'total'):6.1f} s ({span(off)}) | "
              f"{med(on, 'total') / med(off, 'total'):.3f} | {med(on, 'first two'):.2f} s, {med(off, 'first two'):.2f} s")


if __name__ == "__main__":
    main()
