"""One epoch of the same tokens through our native layers, through transformers' own modules on our loop, and through
TRL's SFTTrainer (packed rows, as a TRL user runs it), on the CPU: what running any architecture through transformers'
modules costs, and what it gains over the trainer people use for them.

    python bench/any_model_epoch.py                          # a Llama: native, transformers' modules, TRL (~15 min)
    python bench/any_model_epoch.py --model qwen3_5          # Qwen3.5 (Gated DeltaNet beside full attention): ours, TRL
    python bench/any_model_epoch.py --samples 100 --rounds 1  # a quick look

The jobs, alternated (each round after the first runs them in reverse order of the one before), each a process of
its own, timed start to exit (imports, loading, the epoch, saving the model), its peak resident memory read by
/usr/bin/time:
  ours-native        python -m recipes.full_finetune model.implementation=native (Llama only: our torchtune layers)
  ours-transformers  the same with model.implementation=transformers (transformers' LlamaForCausalLM's modules,
                     our attention plugged in)
  trl                bench/trl_sft.py: SFTTrainer, packing (best-fit decreasing, padding-free), rows of max_seq_len;
                     for Qwen3.5 padded batches of --batch-size documents (TRL refuses to pack it without the
                     causal_conv1d kernel, which keeps its convolution to each document)
What is the same: the checkpoint (a Llama by bench/vs_torchtune.py, or a Qwen3.5 by tests/architectures.py, scaled
up), the very token ids (ours tokenised once; TRL takes them as a tokenised dataset, so both train the same documents'
tokens: checked, in total), fp32, AdamW (betas 0.9, 0.95), a cosine schedule after 2 warm-up steps, clipping at 1.0.
What differs by design: a step of ours is `--batch-size` documents, packed as the planner decides; a step of TRL's is
`--rows` packed rows of max_seq_len tokens (its packing changes what a batch is), so compare whole epochs, not steps.
Each job runs once untimed before the rounds (ours measures the CPU and traces its layers once per machine; TRL's
datasets caches the file). Medians over rounds with their spread; exit 1 if a job fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from packing_epoch import make_varied_rows  # noqa: E402
from vs_torchtune import ROOT, child_env, make_checkpoint, write_jsonl  # noqa: E402

sys.path.insert(0, str(ROOT))

BETAS, EPS, MAX_GRAD_NORM, WARMUP = (0.9, 0.95), 1e-8, 1.0, 2


def qwen3_5_checkpoint(folder: Path) -> Path:
    """A Qwen3.5 of the tiny architecture of tests/architectures.py, widened to the Llama's size here."""
    from tests.architectures import make_checkpoint as make_architecture

    return make_architecture(folder, "qwen3_5", hidden_size=256, intermediate_size=704, head_dim=64,
                             linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096)


def tokenised(checkpoint: Path, data: Path, seq_len: int) -> list[list[int]]:
    """Each document's token ids as our `text` dataset makes them (BOS, the text, EOS)."""
    from moai_recipes.data.datasets import DataSource, load_dataset
    from moai_recipes.data.tokenizer import Tokenizer

    ds = load_dataset(DataSource(kind="text", path=str(data)), Tokenizer.from_checkpoint(checkpoint), max_seq_len=seq_len)
    return [[int(t) for t in ds[i]["tokens"]] for i in range(len(ds))]


def command(name: str, args, *, checkpoint: Path, data: Path, tokens: Path, out: Path) -> list[str]:
    if name == "trl":
        # Qwen3.5 on the CPU: TRL refuses packed rows without the causal_conv1d kernel (its convolution would cross
        # the documents), so a TRL user pads batches of as many documents as ours.
        packed = args.model != "qwen3_5"
        return [sys.executable, str(BENCH / "trl_sft.py"), str(checkpoint), str(tokens), str(out),
                f"--max-length={args.seq_len}", f"--rows={args.rows if packed else args.batch_size}", f"--lr={args.lr}",
                f"--seed={args.seed}", *([] if packed else ["--no-packing"])]
    return [sys.executable, "-m", "recipes.full_finetune", "flavor=cpu", f"model.checkpoint_dir={checkpoint}",
            f"model.implementation={name.removeprefix('ours-')}", "dataset=text", f"dataset.path={data}",
            f"batch_size={args.batch_size}", f"max_seq_len={args.seq_len}", "epochs=1", "dtype=fp32", "logger=stdout",
            f"output_dir={out}", f"seed={args.seed}", f"optimizer.lr={args.lr}",
            f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]", f"optimizer.eps={EPS}", "optimizer.weight_decay=0.0",
            f"optimizer.warmup_steps={WARMUP}", f"optimizer.max_grad_norm={MAX_GRAD_NORM}", "sample_max_new_tokens=0",
            "measure_memory=false", *([f"max_steps={args.max_steps}"] if args.max_steps else [])]


def run(cmd: list[str], *, env: dict, log: Path, timeout: float) -> tuple[int, float, int]:
    """(exit code, seconds, peak resident KB) of `cmd` under /usr/bin/time."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(["/usr/bin/time", "-f", "peak-rss-kb %M", *cmd], cwd=ROOT, env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - start
    peak = next((int(line.split()[1]) for line in reversed(log.read_text().splitlines())
                 if line.startswith("peak-rss-kb")), 0)
    return proc.returncode, wall, peak


def trained_tokens(name: str, out: Path, log: Path) -> int:
    if name == "trl":
        return json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])["tokens"]
    return sum(json.loads(line)["tokens"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama", "qwen3_5"), default="llama")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8, help="documents a step, ours")
    p.add_argument("--rows", type=int, default=4, help="packed rows of seq-len tokens a step, TRL")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="stop our jobs early (a quick look; TRL runs its epoch)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moai-any-model-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(work, pythonpath=None, threads=None)
    if args.model == "llama":
        checkpoint = make_checkpoint(work / "checkpoint", "small", max_positions=max(512, args.seq_len))
        names = ["ours-native", "ours-transformers", "trl"]
    else:
        checkpoint = qwen3_5_checkpoint(work / "checkpoint")
        names = ["ours-transformers", "trl"]
    data = write_jsonl(work / "varied.jsonl", make_varied_rows(args.samples, seed=args.seed))
    documents = tokenised(checkpoint, data, args.seq_len)
    if max(map(len, documents)) >= args.seq_len:
        print(f"refused: a document reaches --seq-len {args.seq_len}, and the tools would cut it differently")
        return 1
    tokens = write_jsonl(work / "tokens.jsonl", [{"input_ids": ids} for ids in documents])
    total = sum(map(len, documents))
    print(f"{args.model}: {len(documents)} documents, {total:,} tokens (median {statistics.median(map(len, documents)):.0f}, "
          f"longest {max(map(len, documents))}); {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}", flush=True)

    for name in names:  # what a first run on a machine pays once, out of the rounds for every tool
        out = work / f"{name}-warmup"
        cmd = command(name, argparse.Namespace(**{**vars(args), "max_steps": 1}), checkpoint=checkpoint, data=data,
                      tokens=tokens, out=out)
        if name == "trl":  # its warm-up is a whole epoch: datasets' cache of the file is what it keeps
            continue
        rc, wall, _ = run(cmd, env=env, log=out.with_suffix(".log"), timeout=args.timeout)
        if rc:
            print(f"{name} failed warming up (exit {rc}); its log: {out.with_suffix('.log')}")
            return 1
        print(f"  warm-up {name:<18} {wall:6.1f} s (1 step, untimed)", flush=True)

    walls: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out = work / f"{name}-r{r + 1}"
            log = out.with_suffix(".log")
            rc, wall, peak = run(command(name, args, checkpoint=checkpoint, data=data, tokens=tokens, out=out),
                                 env=env, log=log, timeout=args.timeout)
            if rc:
                print(f"{name} failed (exit {rc}); its log: {log}\n" + "\n".join(log.read_text().splitlines()[-20:]))
                return 1
            trained = trained_tokens(name, out, log)
            if not args.max_steps and trained != total:
                print(f"refused: {name} trained {trained:,} tokens, not the {total:,} of the data")
                return 1
            walls[name].append(wall)
            peaks[name].append(peak)
            print(f"  round {r + 1} {name:<18} {wall:6.1f} s, peak {peak / 2**20:.2f} GiB", flush=True)

    med = {n: statistics.median(w) for n, w in walls.items()}
    print("\n| job | wall (median, min-max) | tokens / s | peak resident memory (median) |\n| --- | ---: | ---: | ---: |")
    for n in names:
        print(f"| {n} | {med[n]:.1f} s ({min(walls[n]):.1f}-{max(walls[n]):.1f}) | {total / med[n]:,.0f} | "
              f"{statistics.median(peaks[n]) / 2**20:.2f} GiB |")
    if "ours-native" in med:
        print(f"\ntransformers' modules / our native layers: {med['ours-native'] / med['ours-transformers']:.2f}x the "
              "speed (the goal: at least 0.9x)")
    print(f"ours (transformers' modules) / TRL's SFTTrainer: {med['trl'] / med['ours-transformers']:.2f}x the speed "
          "(the goal: at least 1.3x)")
    print(f"\n$ python bench/any_model_epoch.py --model {args.model} --samples {args.samples} --rounds {args.rounds}; "
          f"{time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
