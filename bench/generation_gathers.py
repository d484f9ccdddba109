"""recipes.grpo on FSDP2 shards whose layers reshard after the forward: sampling with each layer gathered at every
decode step (plan.gather_for_generation=false) against gathered once for the round (true), measured and predicted.

    python bench/generation_gathers.py            # SmolLM2-135M-Instruct, LoRA, cpu-2: about 3 minutes
    python bench/generation_gathers.py rounds=3   # more alternating rounds

Each round runs both settings, alternating (this 2-core machine is noisy), 3 steps of 16 completions of 12 tokens;
a run's sampling time is the median of its steps' time/generate, and its step time the planner's prediction against
the loop's measured median. The two settings must give the same losses bit for bit (the same gathered weights).
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["model=smollm2_135m", "dataset=additions", "method=lora", "flavor=cpu-2", "plan.replicate=false",
          "plan.reshard_after_forward=true", "max_steps=3", "batch_size=16", "num_generations=8",
          "max_completion_length=12", "max_seq_len=96", "logger=stdout"]


def run(gather: bool, out: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "recipes.grpo", *COMMON, f"plan.gather_for_generation={str(gather).lower()}",
                        f"output_dir={out}"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stdout[-2000:] + r.stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((out / "plan.json").read_text())["chosen"]
    assert plan["gather_for_generation"] == gather and plan["reshard_after_forward"], plan
    step = next(line for line in r.stdout.splitlines() if line.startswith("Step time:"))
    return {"generate": statistics.median(row["time/generate"] for row in rows), "losses": [row["loss"] for row in rows],
            "predicted_step_s": plan["predicted_step_s"], "step": step}


def main(argv: list[str]) -> None:
    rounds = int(dict(a.split("=", 1) for a in argv).get("rounds", 2))
    found = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        for k in range(rounds):
            for gather in (False, True):
                found[gather].append(run(gather, Path(folder) / f"{k}-{gather}"))
    assert all(r["losses"] == found[False][0]["losses"] for runs in found.values() for r in runs), "losses differ"
    print("| plan.gather_for_generation | sampling per step, median s (each round) | step predicted s | step measured |")
    print("|---|---|---|---|")
    for gather, runs in found.items():
        each = [r["generate"] for r in runs]
        print(f"| {str(gather).lower()} | {statistics.median(each):.2f} ({', '.join(f'{x:.2f}' for x in each)}) | "
              f"{runs[0]['predicted_step_s']:.2f} | {runs[0]['step'].removeprefix('Step time: ')} |")
    ratio = statistics.median(r["generate"] for r in found[False]) / statistics.median(r["generate"] for r in found[True])
    print(f"sampling {ratio:.2f}x faster gathered once; the same losses bit for bit in all {2 * rounds} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
