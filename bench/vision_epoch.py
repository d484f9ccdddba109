"""One epoch of picture rows on a small Qwen2.5-VL-shaped model: ours (recipes.full_finetune) against TRL's SFTTrainer
with the same processor and rows, on the CPU.

    python bench/vision_epoch.py                      # 400 rows, 3 rounds (a few minutes)
    python bench/vision_epoch.py --rows 64 --rounds 1  # a quick look

The jobs, alternated (each round after the first runs them in reverse order of the one before), each a process of its
own, timed start to exit (imports, loading, reading the rows, the epoch, saving the model), its peak resident memory
read by /usr/bin/time:
  ours  python -m recipes.full_finetune on the rows (dataset=chat: messages with an image part, an images column)
  trl   bench/trl_vision_sft.py: SFTTrainer on the same rows as prompt-completion rows with their pictures (the loss
        on the completions, as ours is on the assistant turns), the same processor
What is the same: the checkpoint (models/tiny_vision at --scale: four text layers of width 256 and a four-block vision
tower of width 128 at scale 4), the rows and pictures (data/pictures.py, 56 to 392 pixels high: 4 to ~200 image tokens
each, Qwen's dynamic resolution), the
processor (so the same tokens: both tools' totals are checked equal), fp32, AdamW (betas 0.9, 0.95), a cosine schedule
after 2 warm-up steps, clipping at 1.0, batches of --batch-size rows (TRL pads them; ours packs or pads them as its
planner decides). Each job runs once untimed before the
rounds (ours measures the CPU and traces its layers once per machine). Medians over rounds with their spread; exit 1
if a job fails or the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from any_model_epoch import run  # noqa: E402
from trl_vision_sft import BETAS, EPS, MAX_GRAD_NORM, WARMUP  # noqa: E402
from vs_torchtune import ROOT, child_env  # noqa: E402

sys.path.insert(0, str(ROOT))

# Pictures of 56 to 392 pixels high, as a dataset of photos and scans comes in sizes: Qwen's processor makes each into
# as many image tokens as its size asks (4 to about 200 here), up to MAX_IMAGE_TOKENS.
SIZES, MAX_IMAGE_TOKENS = (56, 392), 256


def command(name: str, args, *, model: Path, rows: Path, out: Path, steps: int | None = None) -> list[str]:
    if name == "trl":
        return [sys.executable, str(BENCH / "trl_vision_sft.py"), str(model), str(rows), str(out),
                f"--batch-size={args.batch_size}", f"--lr={args.lr}", f"--seed={args.seed}"]
    return [sys.executable, "-m", "recipes.full_finetune", "flavor=cpu", f"model.checkpoint_dir={model}", "dataset=chat",
            f"dataset.path={rows}", f"batch_size={args.batch_size}", "max_seq_len=512", "epochs=1", "dtype=fp32",
            "logger=stdout", f"output_dir={out}", f"seed={args.seed}", f"optimizer.lr={args.lr}",
            f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]", f"optimizer.eps={EPS}", "optimizer.weight_decay=0.0",
            f"optimizer.warmup_steps={WARMUP}", f"optimizer.max_grad_norm={MAX_GRAD_NORM}", "sample_max_new_tokens=0",
            "measure_memory=false", *([f"max_steps={steps}"] if steps else [])]


def trained_tokens(name: str, out: Path, log: Path) -> int:
    if name == "trl":
        return json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])["tokens"]
    return sum(json.loads(line)["tokens"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()

    from moai_recipes.data.pictures import write_picture_rows
    from moai_recipes.models.tiny_vision import write_tiny_vl

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moai-vision-epoch-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(work, pythonpath=None, threads=None)
    model = write_tiny_vl(work / "checkpoint", scale=args.scale, max_tokens=MAX_IMAGE_TOKENS)
    rows = write_picture_rows(work / "rows", args.rows, seed=args.seed, size=SIZES)
    names = ["ours", "trl"]
    print(f"{args.rows} picture rows, batches of {args.batch_size}, scale {args.scale}; {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    out = work / "ours-warmup"  # what a first run on a machine pays once (TRL's has nothing to keep)
    rc, wall, _ = run(command("ours", args, model=model, rows=rows, out=out, steps=1), env=env,
                      log=out.with_suffix(".log"), timeout=args.timeout)
    if rc:
        print(f"ours failed warming up (exit {rc}); its log: {out.with_suffix('.log')}")
        return 1
    print(f"  warm-up ours {wall:6.1f} s (1 step, untimed)", flush=True)

    walls: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out = work / f"{name}-r{r + 1}"
            log = out.with_suffix(".log")
            rc, wall, peak = run(command(name, args, model=model, rows=rows, out=out), env=env, log=log,
                                 timeout=args.timeout)
            if rc:
                print(f"{name} failed (exit {rc}); its log: {log}\n" + "\n".join(log.read_text().splitlines()[-20:]))
                return 1
            tokens[name] = trained_tokens(name, out, log)
            walls[name].append(wall)
            peaks[name].append(peak)
            print(f"  round {r + 1} {name:<5} {wall:6.1f} s, peak {peak / 2**20:.2f} GiB, {tokens[name]:,} tokens",
                  flush=True)
    if tokens["ours"] != tokens["trl"]:
        print(f"refused: ours trained {tokens['ours']:,} tokens, TRL {tokens['trl']:,}")
        return 1
    med = {n: statistics.median(w) for n, w in walls.items()}
    print("\n| job | wall (median, min-max) | tokens / s | peak resident memory (median) |\n| --- | ---: | ---: | ---: |")
    for n in names:
        print(f"| {n} | {med[n]:.1f} s ({min(walls[n]):.1f}-{max(walls[n]):.1f}) | {tokens[n] / med[n]:,.0f} | "
              f"{statistics.median(peaks[n]) / 2**20:.2f} GiB |")
    print(f"\nours / TRL's SFTTrainer: {med['trl'] / med['ours']:.2f}x the speed (the goal: at least 1.3x)")
    print(f"\n$ python bench/vision_epoch.py --rows {args.rows} --scale {args.scale} --rounds {args.rounds}; "
          f"{time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
