"""The dry run a user tries first (`python -m recipes.plan ...`), cold: a new process and an empty trace cache, as on a
fresh machine. Each model's command is timed `--rounds` times, alternating with another checkout where `--against`
names one (say a `git worktree` of an earlier commit), and both outputs are compared line for line (the same plan
chosen, the same predictions), apart from the line that says how long planning took.

Run: python bench/dry_runs.py --against /tmp/old-checkout --rounds 2
Measured: see the closing note of issue 51 (2026-11-28).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("deepseek_v3", "gpt_oss_120b", "gemma3_27b", "qwen3_5_35b_a3b", "llama3_70b")


def dry_run(checkout: Path, model: str, args: list[str]) -> tuple[float, list[str]]:
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "recipes.plan", f"model={model}", *args], cwd=checkout,
                           env={**os.environ, "MOAI_CACHE": cache}, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if r.returncode not in (0, 2):  # 2: the user's mistake, said in one message (nothing fits, say): compared too
        raise SystemExit(f"{checkout}: {model}: exit {r.returncode}\n{r.stderr[-2000:]}")
    said = [line for line in (r.stdout + r.stderr).splitlines() if not line.startswith("Planned in")]
    return seconds, [f"exit {r.returncode}", *said]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout, timed in alternation with this one")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("args", nargs="*", default=["flavor=4xlarge", "batch_size=64", "max_seq_len=4096"])
    args = parser.parse_args()
    checkouts = [ROOT] + ([args.against.resolve()] if args.against else [])
    for model in args.models.split(","):
        times = {c: [] for c in checkouts}
        outputs = {}
        for _ in range(args.rounds):
            for checkout in checkouts:
                seconds, outputs[checkout] = dry_run(checkout, model, args.args)
                times[checkout].append(seconds)
        same = "" if len(checkouts) == 1 else (
            ", the same output" if outputs[ROOT] == outputs[checkouts[1]] else ", OUTPUTS DIFFER")
        print(f"{model}: " + "; ".join(f"{c.name}: median {statistics.median(t):.1f} s (spread {min(t):.1f}-"
                                       f"{max(t):.1f})" for c, t in times.items()) + same, flush=True)


if __name__ == "__main__":
    main()
