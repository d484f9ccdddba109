"""One epoch of variable-length text against torchtune 0.6.1's own recipes, unpacked and packed, on the CPU.

    python bench/packing_epoch.py                   # 800 samples, max_seq_len 1024, batch 8, 3 rounds (~12 min)
    python bench/packing_epoch.py --samples 200 --rounds 1     # a quick look
    python bench/packing_epoch.py --only ours                  # ours cpu against ours cpu-2
    python bench/packing_epoch.py --only lora                  # LoRA and QLoRA beside full fine-tuning, both tools
    python bench/packing_epoch.py --only cold                  # first runs on a machine (empty caches), both tools
    python bench/packing_epoch.py --only compile               # each tool eager against its compiled layers
    python bench/packing_epoch.py --model-size smollm2 --max-steps 6 --only torchtune --rounds 1   # SmolLM2's layers
    python bench/packing_epoch.py --jobs ours-cpu ours-lora torchtune-packed-lora   # any jobs of the list below

docs/packing.md and docs/benchmarks.md record runs and what they mean. The jobs, alternated (each round after the
first runs them in reverse order of the one before):

  ours-cpu          python -m recipes.full_finetune flavor=cpu     (the planner decides: packing, budget)
  ours-cpu-2        the same on flavor=cpu-2 (2 processes, one core each)
  ours-lora         python -m recipes.lora_finetune flavor=cpu, rank 8 on q_proj and v_proj, alpha 16
  ours-qlora        the same with lora.quantize_base=true (the base in NF4)
  ours-compiled     ours-cpu with plan.compile=true, each run with a cold inductor cache (its first step's time is
                    the compile time a first run pays)
  ours-cpu-cold     ours-cpu with an empty MOAI_CACHE of its own: the CPU's speed measured, the layers traced, the
                    data tokenised, as a user's first run on a machine pays them
  torchtune         tune run full_finetune_single_device, batch 8, packed: false
  torchtune-packed  the same with packed: true, batch 2 rows of max_seq_len tokens (torchtune's packing changes
                    what a batch is: its steps are not ours, its tokens are)
  torchtune-packed-compiled  torchtune-packed with compile: true (its layers and loss by inductor, cold cache)
  torchtune-packed-cold      torchtune-packed with an empty datasets cache of its own (its Arrow cache, packing)
  torchtune-packed-lora / -qlora  tune run lora_finetune_single_device, packed, lora_llama3 with the LoRA above
                    (quantize_base: true for QLoRA)

What is the same: the checkpoint (a Llama of --model-size by transformers, bench/vs_torchtune.py), the
tokenizer (its tokenizer.json; torchtune through bench/torchtune_components.py), the text rows, in the
order our seeded sampler visits them, fp32, AdamW, the cosine schedule, clipping. Before anything runs the
script tokenises the file with both tools and refuses to go on unless they make the same tokens (the same
count in total, sample by sample). What is measured: each process's wall time, start to exit (imports,
loading, tokenising, the epoch, saving the model), the median over rounds with the spread; tokens/s is the
epoch's tokens over that time. Before the rounds each job runs one untimed step, so that what a tool does once
per machine is not in them (ours: measuring the CPU and tracing the layers for the planner, about 3 s, kept in
MOAI_CACHE; torchtune: datasets' Arrow cache of the file; a -cold job never shares them); --no-warmup times
every job cold. Beside it, the steady training speed each tool logs per step (tokens/s, the median of the steps
after the first two, the same window on both sides: start-up, loading and saving left out), and the MFU at that
speed: the same model FLOPs per token for both tools' jobs of a method (planner/flops.py, LoRA's frozen base
counted apart) against the fp32 matmul peak measured for the job's threads. --max-steps cuts the epoch short
(ours max_steps, torchtune max_steps_per_epoch: a packed torchtune step holds other tokens than ours, so compare
tokens/s there, not walls). Exit 1 if a job fails.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from vs_torchtune import (  # noqa: E402
    ROOT,
    child_env,
    make_checkpoint,
    run_logged,
    torchtune_config,
    write_jsonl,
)

sys.path.insert(0, str(ROOT))


def make_varied_rows(count: int, *, seed: int) -> list[dict]:
    """Texts of 10 to 900 words (median about 100, a long tail), words drawn from the demo data."""
    from moai_recipes.models.tiny import demo_texts

    words = " ".join(demo_texts()).split()
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(words) for _ in range(min(900, max(10, int(rng.lognormvariate(4.6, 0.8))))))}
            for _ in range(count)]


def our_lengths(checkpoint: Path, data: Path, seq_len: int) -> list[int]:
    from moai_recipes.data.datasets import DataSource, load_dataset
    from moai_recipes.data.tokenizer import Tokenizer

    ds = load_dataset(DataSource(kind="text", path=str(data)), Tokenizer.from_checkpoint(checkpoint), max_seq_len=seq_len)
    return list(ds.lengths)


def torchtune_lengths(checkpoint: Path, data: Path, seq_len: int) -> list[int]:
    from torchtune.datasets import text_completion_dataset
    from torchtune_components import hf_text_tokenizer

    tok = hf_text_tokenizer(str(checkpoint), max_seq_len=seq_len + 1)  # it keeps max_seq_len - 1 tokens, as the job
    ds = text_completion_dataset(tok, source="json", data_files=str(data), column="text", split="train", add_eos=True)
    return [len(ds[i]["tokens"]) for i in range(len(ds))]


# LoRA as both tools' LoRA jobs have it: rank 8 on the query and value projections, alpha 16, no dropout.
LORA_RANK, LORA_ALPHA = 8, 16
ALL_JOBS = ("ours-cpu", "ours-cpu-2", "ours-cpu-cold", "ours-compiled", "ours-lora", "ours-qlora", "torchtune",
            "torchtune-packed", "torchtune-packed-cold", "torchtune-packed-compiled", "torchtune-packed-lora",
            "torchtune-packed-qlora")
PRESETS = {"all": ["ours-cpu", "torchtune", "torchtune-packed", "ours-cpu-2"],
           "ours": ["ours-cpu", "ours-cpu-2"],
           "torchtune": ["ours-cpu", "torchtune", "torchtune-packed"],
           "compile": ["ours-cpu", "ours-compiled", "torchtune-packed", "torchtune-packed-compiled"],
           "lora": ["ours-cpu", "ours-lora", "ours-qlora", "torchtune-packed", "torchtune-packed-lora",
                    "torchtune-packed-qlora"],
           "cold": ["ours-cpu", "ours-cpu-cold", "torchtune-packed", "torchtune-packed-cold"]}


def processes(name: str) -> int:
    """The job's training processes: cpu-2's two, one otherwise."""
    return 2 if name == "ours-cpu-2" else 1


def method(name: str) -> str:
    """full, lora or qlora: what a job's name says it trains."""
    return "qlora" if name.endswith("-qlora") else "lora" if name.endswith("-lora") else "full"


def torchtune_yaml(args, *, checkpoint: Path, data: Path, out: Path, name: str) -> str:
    text = torchtune_config(args, checkpoint=checkpoint, data=data, out=out)
    text = text.replace("max_steps_per_epoch: 0", f"max_steps_per_epoch: {args.max_steps or 'null'}")
    # A packed row holds max_seq_len + 1 tokens (the tokenizer's, whose samples keep max_seq_len): the RoPE cache
    # must cover it (positions restart per document; only torchtune's length check reads it).
    text = text.replace(f"  max_seq_len: {args.seq_len}\n  norm_eps", f"  max_seq_len: {args.seq_len + 1}\n  norm_eps")
    if "-packed" in name:  # rows of max_seq_len tokens, each document attending to itself; 2 rows a step as its docs do
        text = text.replace("  packed: false", "  packed: true").replace(f"batch_size: {args.batch_size}\n",
                                                                          f"batch_size: {args.packed_rows}\n")
    if name.endswith("-compiled"):  # each layer and the loss compiled by torch.compile (inductor's C++ on the CPU)
        text = text.replace("compile: false", "compile: true")
    if method(name) != "full":  # torchtune's own LoRA builder and its NF4 base for QLoRA
        text = text.replace("  _component_: torchtune.models.llama3.llama3\n",
                            "  _component_: torchtune.models.llama3.lora_llama3\n"
                            "  lora_attn_modules: [q_proj, v_proj]\n  apply_lora_to_mlp: false\n"
                            "  apply_lora_to_output: false\n"
                            f"  lora_rank: {LORA_RANK}\n  lora_alpha: {LORA_ALPHA}\n  lora_dropout: 0.0\n"
                            f"  quantize_base: {'true' if method(name) == 'qlora' else 'false'}\n")
    return text


def command(name: str, args, *, work: Path, checkpoint: Path, data: Path, tt_data: Path, out: Path):
    """The job's command line, environment and folder. A `-cold` job gets empty caches of its own, as a user's first
    run on a machine has them: ours MOAI_CACHE (the CPU's speed, the layers' traces, the tokens), torchtune's
    datasets' Arrow cache."""
    env = child_env(work, pythonpath=str(BENCH) if name.startswith("torchtune") else None, threads=args.threads)
    if name.endswith("-cold"):
        env.update(MOAI_CACHE=str(out) + "-moai-cache", HF_DATASETS_CACHE=str(out) + "-hf-datasets")
    if name.endswith("-compiled"):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out) + "-inductor"  # cold: nothing compiled before
    if name.startswith("torchtune"):
        out.mkdir()
        cfg = out.with_suffix(".yaml")
        cfg.write_text(torchtune_yaml(args, checkpoint=checkpoint, data=tt_data, out=out, name=name))
        recipe = "full_finetune_single_device" if method(name) == "full" else "lora_finetune_single_device"
        return [sys.executable, "-m", "torchtune._cli.tune", "run", recipe, "--config", str(cfg)], env, work
    flavor = "cpu" if processes(name) == 1 else f"cpu-{processes(name)}"
    lora = [] if method(name) == "full" else [
        f"lora.rank={LORA_RANK}", f"lora.alpha={LORA_ALPHA}", "lora.attn_modules=[q_proj,v_proj]",
        "lora.apply_to_mlp=false", "lora.apply_to_output=false", "lora.dropout=0.0",
        f"lora.quantize_base={'true' if method(name) == 'qlora' else 'false'}"]
    cmd = [sys.executable, "-m", f"recipes.{'full' if method(name) == 'full' else 'lora'}_finetune", f"flavor={flavor}",
           "model=tiny", f"model.checkpoint_dir={checkpoint}", "dataset=text", f"dataset.path={data}",
           f"batch_size={args.batch_size}", f"max_seq_len={args.seq_len}", "epochs=1", "dtype=fp32", "logger=stdout",
           f"output_dir={out}", f"seed={args.seed}", f"optimizer.lr={args.lr}", "optimizer.betas=[0.9,0.95]",
           "optimizer.eps=1e-8", "optimizer.weight_decay=0.0", "optimizer.warmup_steps=2",
           "optimizer.max_grad_norm=1.0", "sample_max_new_tokens=0", *lora,
           *([f"max_steps={args.max_steps}"] if args.max_steps else []), *args.ours,
           *(["plan.compile=true"] if name == "ours-compiled" else [])]
    return cmd, env, ROOT


def flops_per_token(name: str, checkpoint: Path, lengths: list[int]) -> float:
    """The model FLOPs of a token of this data (planner/flops.py: matmuls, attention at the documents' lengths, the
    frozen base and the adapters counted apart under LoRA), the same for both tools' jobs of a method."""
    from moai_recipes.models.lora import lora_options
    from moai_recipes.models.spec import read_spec
    from moai_recipes.planner.flops import ModelFlops

    spec = read_spec(checkpoint)
    lora = None if method(name) == "full" else lora_options(
        {"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": False, "apply_to_output": False, "rank": LORA_RANK,
         "alpha": LORA_ALPHA, "dropout": 0.0, "quantize_base": method(name) == "qlora"}, spec=spec)
    return ModelFlops.of(spec, lora).step(lengths).model / sum(lengths)


def peak_flops(name: str, threads: int | None) -> float:
    """The fp32 matmul peak of the job's processes together: the CPU's measured at the threads each gets."""
    from moai_recipes.planner.cpu_speed import cpu_speed, process_threads

    return processes(name) * cpu_speed(threads or process_threads(processes(name))).fp32_flops


def first_step_s(out: Path) -> float:
    import json

    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step_time_s"]


def steady_speeds(name: str, out: Path, skip: int = 2) -> list[float]:
    """Tokens/s of each step after the first `skip`, as the tool logged it."""
    if name.startswith("torchtune"):
        from vs_torchtune import _TT_LINE

        log = sorted((out / "logs").glob("log_*.txt"))[-1]
        rows = [dict(kv.split(":", 1) for kv in m.group(2).split()) for m in map(_TT_LINE.match, log.read_text().splitlines())
                if m]
        return [float(r["tokens_per_second_per_gpu"]) for r in rows if "tokens_per_second_per_gpu" in r][skip:]
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["tokens"] / r["step_time_s"] for r in rows][skip:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=800)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, ours and unpacked torchtune")
    p.add_argument("--packed-rows", type=int, default=2, help="rows of seq-len tokens per step, packed torchtune")
    p.add_argument("--model-size", default="small", help="bench/vs_torchtune.py MODEL_SIZES (default small, ~3M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=tuple(PRESETS), default="all", help="a preset list of jobs (see the top)")
    p.add_argument("--jobs", nargs="+", choices=ALL_JOBS, default=None, help="these jobs instead of a preset")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="stop each job after this many steps (default: the epoch)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first runs on a cold machine too (default: one untimed step of each job first)")
    p.add_argument("--ours", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for our jobs")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    args.steps, args.warmup_lr_steps = 0, 2  # what torchtune_config reads: the whole epoch, our warm-up

    from moai_recipes.data.batches import GlobalBatches

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moai-packing-"))
    work.mkdir(parents=True, exist_ok=True)
    start, load = time.perf_counter(), os.getloadavg()
    try:
        checkpoint = make_checkpoint(work / "checkpoint", args.model_size, max_positions=max(512, args.seq_len))
        rows = make_varied_rows(args.samples, seed=args.seed)
        data = write_jsonl(work / "varied.jsonl", rows)
        batches = GlobalBatches(num_samples=len(rows), batch_size=args.batch_size, epochs=1, seed=args.seed)
        order = [i for s in range(batches.total_steps) for i in batches.global_indices(s)]
        tt_data = write_jsonl(work / "varied_in_our_order.jsonl", [rows[i] for i in order])
        ours, theirs = our_lengths(checkpoint, data, args.seq_len), torchtune_lengths(checkpoint, tt_data, args.seq_len)
        if sorted(ours) != sorted(theirs) or [ours[i] for i in order] != theirs:
            print(f"refused: the tools tokenise the file differently ({sum(ours)} against {sum(theirs)} tokens)")
            return 1
        tokens = sum(ours)
        print(f"{len(rows)} samples, {tokens:,} tokens alike in both tools (median {statistics.median(ours):.0f}, "
              f"longest {max(ours)}); max_seq_len {args.seq_len}; model {args.model_size}; {os.cpu_count()} cores",
              flush=True)
        names = args.jobs or PRESETS[args.only]
        if args.warmup:  # what a first run on a machine pays once, kept out of the rounds for both tools
            once = argparse.Namespace(**{**vars(args), "max_steps": 1})
            for name in [n for n in names if not n.endswith("-cold")]:  # a cold job's caches are its own
                out = work / f"{name}-warmup"
                cmd, env, cwd = command(name, once, work=work, checkpoint=checkpoint, data=data, tt_data=tt_data, out=out)
                rc, wall = run_logged(cmd, cwd=cwd, env=env, log=out.with_suffix(".log"), timeout=args.timeout)
                if rc != 0:
                    print(f"{name} failed (exit {rc}) warming up; its log: {out.with_suffix('.log')}")
                    return 1
                print(f"  warm-up {name:<17} {wall:6.1f} s (1 step, untimed)", flush=True)
        walls: dict[str, list[float]] = {n: [] for n in names}
        speeds: dict[str, list[float]] = {n: [] for n in names}
        firsts: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                out = work / f"{name}-r{r + 1}"
                cmd, env, cwd = command(name, args, work=work, checkpoint=checkpoint, data=data, tt_data=tt_data, out=out)
                rc, wall = run_logged(cmd, cwd=cwd, env=env, log=out.with_suffix(".log"), timeout=args.timeout)
                if rc != 0:
                    print(f"{name} failed (exit {rc}); its log: {out.with_suffix('.log')}")
                    print("\n".join(out.with_suffix(".log").read_text().splitlines()[-30:]))
                    return 1
                walls[name].append(wall)
                speeds[name] += steady_speeds(name, out)
                first = first_step_s(out) if name.startswith("ours") else None
                if first is not None:
                    firsts[name].append(first)
                print(f"  round {r + 1} {name:<17} {wall:6.1f} s" + (f" (first step {first:.1f} s)" if first else ""),
                      flush=True)
        med = {n: statistics.median(w) for n, w in walls.items()}
        fast = {n: statistics.median(v) for n, v in speeds.items()}
        # MFU at the steady speed: the same FLOPs per token for both tools' jobs of a method, against the fp32 matmul
        # peak of the job's processes (the CPU's measured; planner/cpu_speed.py).
        mfu = {n: fast[n] * flops_per_token(n, checkpoint, ours) / peak_flops(n, args.threads) for n in names}
        print("\n| job | wall (median, min-max) | epoch tokens / wall | steady tokens/s (median, min-max) | steady MFU |\n"
              "| --- | ---: | ---: | ---: | ---: |")
        for n, w in walls.items():
            v = speeds[n]
            print(f"| {n} | {med[n]:.1f} s ({min(w):.1f}-{max(w):.1f}) | {tokens / med[n]:,.0f} | "
                  f"{fast[n]:,.0f} ({min(v):,.0f}-{max(v):,.0f}) | {100 * mfu[n]:.1f}% |")
        per = "run" if args.max_steps else "epoch"
        if "torchtune-packed" in fast and "ours-cpu" in fast:
            print(f"steady tokens/s, ours cpu / torchtune packed: {fast['ours-cpu'] / fast['torchtune-packed']:.2f}x")
        theirs = [n for n in ("torchtune", "torchtune-packed", "torchtune-packed-compiled") if n in med]
        if theirs and "ours-cpu" in med:
            fastest = min(theirs, key=med.get)
            print(f"\nours cpu / the fastest torchtune full fine-tuning ({fastest}): {med[fastest] / med['ours-cpu']:.2f}x "
                  f"per {per}")
        for m in ("lora", "qlora"):
            if f"ours-{m}" in med and f"torchtune-packed-{m}" in med:
                print(f"ours {m} / torchtune packed {m}: {med[f'torchtune-packed-{m}'] / med[f'ours-{m}']:.2f}x per {per}")
            if f"ours-{m}" in med and "ours-cpu" in med:
                print(f"ours {m} / ours full: {med['ours-cpu'] / med[f'ours-{m}']:.2f}x per {per}, steady step "
                      f"{fast[f'ours-{m}'] / fast['ours-cpu']:.2f}x the tokens/s")
        for n in ("ours-cpu-cold", "torchtune-packed-cold"):
            warm = n.removesuffix("-cold")
            if n in med and warm in med:
                print(f"{n}: a first run on this machine takes {med[n] - med[warm]:.1f} s longer than a warm one "
                      f"({med[n]:.1f} s against {med[warm]:.1f} s)")
        if "torchtune-packed-compiled" in med and "torchtune-packed" in med:
            print(f"torchtune packed, compiled / eager: {med['torchtune-packed'] / med['torchtune-packed-compiled']:.2f}x "
                  f"per {per}")
        if "ours-compiled" in med and "ours-cpu" in med:
            print(f"compiled / eager, ours cpu: {med['ours-cpu'] / med['ours-compiled']:.2f}x per "
                  f"{'run' if args.max_steps else 'epoch'}, {fast['ours-compiled'] / fast['ours-cpu']:.2f}x steady "
                  f"tokens/s; first step (compiling) {statistics.median(firsts['ours-compiled']):.1f} s against "
                  f"{statistics.median(firsts['ours-cpu']):.2f} s eager")
        if "ours-cpu-2" in med and "ours-cpu" in med:
            print(f"ours cpu-2 / ours cpu: {med['ours-cpu'] / med['ours-cpu-2']:.2f}x per epoch")
        for n in [n for n in names if n.startswith("ours")]:
            plan = next((line for line in (work / f"{n}-r1.log").read_text().splitlines()
                         if line.startswith("Configuration for parallelism")), "")
            print(f"{n}'s plan: {plan.partition(': ')[2]}")
        print(f"\nCommand: python bench/packing_epoch.py {' '.join(sys.argv[1:])}".rstrip())
        print(f"Bench wall {time.perf_counter() - start:.0f} s; {platform.platform()}; load {load[0]:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
