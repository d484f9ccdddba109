"""The SmolLM2 demo (`make demo`: LoRA on the facts) with each storage of the weights and AdamW's moments, side by side:
precision=mixed (bf16 compute, fp32 masters and moments), precision=bf16 (all bf16), and int8 moments over fp32
masters. Prints the loss of every step of each run as a markdown table (docs/planner.md has it) and each run's
answers after training.

Run: python bench/precision_curves.py   (about 8 minutes on two cores: three demo runs)
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ["model=smollm2_135m", "dataset=facts", "flavor=cpu", "epochs=6", "batch_size=8", "optimizer.lr=2e-3",
        "optimizer.warmup_steps=4", "lora.rank=16", "lora.alpha=32", "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]",
        "lora.apply_to_mlp=true", "logger=stdout", "save_merged=false"]
RUNS = {
    "mixed (bf16 compute, fp32 masters and moments)": ["dtype=bf16", "precision=mixed"],
    "bf16 (weights, gradients, moments)": ["precision=bf16"],
    "int8 moments (bf16 compute, fp32 masters)": ["dtype=bf16", "optimizer.states=int8"],
}


def main() -> None:
    curves, answers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            out = Path(tmp) / str(len(curves))
            r = subprocess.run([sys.executable, "-m", "recipes.lora_finetune", *DEMO, *extra, f"output_dir={out}"],
                               cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            curves[name] = [row["loss"] for row in rows if "loss" in row]
            answers[name] = [line for line in r.stdout.splitlines() if "after:" in line]
            print(f"{name}: {len(curves[name])} steps, last loss {curves[name][-1]:.4f}", file=sys.stderr, flush=True)
    names = list(curves)
    print("| step | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for step in range(max(len(c) for c in curves.values())):
        print(f"| {step + 1} | " + " | ".join(f"{c[step]:.4f}" if step < len(c) else "" for c in curves.values()) + " |")
    for name in names:
        print(f"\n{name}:")
        for line in answers[name]:
            print("   ", line.strip())


if __name__ == "__main__":
    main()
