"""The planner's peak against the measured one (MemTracker) for each storage of the weights and moments, SmolLM2-135M,
full fine-tuning and LoRA, one process and cpu-2 (FSDP2 shards): precision=mixed (bf16 compute, fp32 masters),
precision=bf16, and int8 moments over fp32 masters. Two steps each on the demo's facts (the second is the measured
one: the optimizer state exists from its start). Prints a markdown table.

Run: python bench/precision_memory.py   (about ten minutes on two cores)
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["model=smollm2_135m", "dataset=facts", "batch_size=8", "max_steps=2", "logger=stdout",
          "sample_max_new_tokens=0", "save_merged=false", "optimizer.warmup_steps=0"]
PRECISIONS = {"mixed": ["dtype=bf16"], "bf16": ["precision=bf16"], "int8": ["dtype=bf16", "optimizer.states=int8"]}
METHODS = {"full": "recipes.full_finetune", "lora": "recipes.lora_finetune"}
FLAVORS = {"cpu": ["flavor=cpu"], "cpu-2": ["flavor=cpu-2", "plan.replicate=false"]}
PEAK = re.compile(r"Peak tensor memory per device: predicted ([\d.]+) GiB, measured ([\d.]+) GiB \(([+-][\d.]+)%\)")


def main() -> None:
    print("| method | flavor | precision | layout | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for method, module in METHODS.items():
            for flavor, flavor_args in FLAVORS.items():
                for precision, args in PRECISIONS.items():
                    out = Path(tmp) / f"{method}-{flavor}-{precision}"
                    extra = [a for a in COMMON if method == "lora" or a != "save_merged=false"]
                    r = subprocess.run([sys.executable, "-m", module, *extra, *flavor_args, *args, f"output_dir={out}"],
                                       cwd=ROOT, capture_output=True, text=True)
                    peak = PEAK.search(r.stdout)
                    layout = "sharded" if "distribute_param true" in r.stdout else "plain"
                    if r.returncode != 0 or not peak:
                        print(f"| {method} | {flavor} | {precision} | exit {r.returncode} | | | "
                              f"{(r.stderr or r.stdout).strip().splitlines()[-1][:120]} |", flush=True)
                        continue
                    print(f"| {method} | {flavor} | {precision} | {layout} | {peak[1]} | {peak[2]} | {peak[3]}% |",
                          flush=True)


if __name__ == "__main__":
    main()
