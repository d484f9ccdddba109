"""Throughput against torchtune, side by side, on the CPU: the same model, data, batch, steps and optimizer.

    python bench/vs_torchtune.py                 # the default job: ~4 minutes on 2 idle cores, 7-13 loaded
    python bench/vs_torchtune.py --threads 1     # every process single-threaded: steadier on a busy machine
    python bench/vs_torchtune.py --model-size small --rounds 1   # a quick look
    python bench/vs_torchtune.py --only torchtune                # ours flavor=cpu against torchtune only
    python bench/vs_torchtune.py --batch-size 8 --seq-len 512 --steps 10 --model-size large   # a bigger job

docs/benchmarks.md records a run and what it means.

It runs three jobs as separate processes, alternately (round 2 runs them in the reverse order, so
that a slow phase of a shared machine does not fall on one tool only):

  ours-cpu     python -m recipes.full_finetune flavor=cpu     (1 process, from the repository root)
  torchtune    tune run full_finetune_single_device --config <generated yaml>   (from a folder outside
               the repository: torchtune's wheel installs a top-level `recipes` that ours would shadow)
  ours-cpu-2   python -m recipes.full_finetune flavor=cpu-2   (2 processes, gloo, one core each)

What is the same in every job:
  * the model: a Llama checkpoint written by transformers' save_pretrained into the work folder (as
    tests/conftest.py make_hf_checkpoint does, with the dimensions of --model-size); both tools load
    it from that folder, torchtune with FullModelHFCheckpointer (model_type LLAMA3) into
    torchtune.models.llama3.llama3 with the dimensions our build_model passes to the same builder;
  * the tokenizer: the checkpoint's tokenizer.json (torchtune through its HuggingFaceBaseTokenizer,
    bench/torchtune_components.py);
  * the data: plain-text rows, each longer than --seq-len tokens, so every sample is cut to exactly
    --seq-len tokens (BOS + text) and no batch holds padding. torchtune reads them in the order our
    seeded sampler visits them, so step k sees the same sequences in both tools (the losses match);
  * batch --batch-size sequences per optimizer step, no gradient accumulation, no activation
    checkpointing, no compile, fp32 weights and compute, AdamW(lr, betas 0.9/0.95, eps 1e-8, no weight
    decay, fused) with the same cosine schedule and warm-up, gradients clipped to norm 1.0,
    plain cross-entropy, a metric line every step.

Tokens are counted alike: ours logs `tokens` = non-padding input tokens of the global batch;
torchtune logs tokens_per_second_per_gpu from (labels != ignore_index) counted BEFORE its label
shift, which for text data is also every non-padding token. Without padding both are
batch_size * seq_len per step, checked below. Steps/s (1 / median step time) needs no definition.
Steady state: the first --warmup steps of each run are dropped, the median of the rest is reported.
Exit status 1 if any job fails (its log is printed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # our recipes/ and moai_recipes/ before torchtune's `recipes`

# (hidden, layers, heads, kv heads, intermediate); vocabulary: the demo-trained BPE (512).
MODEL_SIZES = {
    "small": (256, 4, 4, 2, 704),     # ~3M parameters
    "medium": (512, 8, 8, 4, 1408),   # ~24M
    "large": (768, 8, 12, 4, 2048),   # ~51M
    "smollm2": (576, 30, 9, 3, 1536),  # SmolLM2-135M's layers (~107M with this 512-token vocabulary)
    "llama3_2_1b": (2048, 16, 32, 8, 8192),  # Llama-3.2-1B's layers (scripts/gpu_check.py, on a GPU)
}
ROPE_THETA = 500000.0
NORM_EPS = 1e-5
BETAS, EPS, MAX_GRAD_NORM = (0.9, 0.95), 1e-8, 1.0


# --- the job's inputs --------------------------------------------------------------------------------


def make_checkpoint(folder: Path, size: str, *, max_positions: int, seed: int = 0) -> Path:
    """A Llama checkpoint by transformers' save_pretrained, as tests/conftest.py make_hf_checkpoint writes one."""
    import torch
    import transformers

    from moai_recipes.models.tiny import demo_texts, write_tokenizer

    hidden, layers, heads, kv_heads, inter = MODEL_SIZES[size]
    vocab = write_tokenizer(folder, demo_texts(), vocab_size=512)
    ids = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=NORM_EPS, rope_theta=ROPE_THETA, bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|end_of_text|>"], pad_token_id=ids["<|pad|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    gen = folder / "generation_config.json"
    if not gen.exists():  # a real checkpoint has one; torchtune's HF tokenizer reads it for BOS/EOS
        gen.write_text(json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                                   "pad_token_id": cfg.pad_token_id}))
    return folder


def make_text_rows(checkpoint: Path, *, count: int, min_tokens: int, seed: int = 0) -> list[dict]:
    """`count` rows of plain text, each at least `min_tokens` tokens long (words drawn from the demo data)."""
    from tokenizers import Tokenizer

    from moai_recipes.models.tiny import demo_texts

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    words = " ".join(demo_texts()).split()
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        parts: list[str] = []
        while True:
            parts.extend(rng.choice(words) for _ in range(min_tokens // 2))
            text = " ".join(parts)
            if len(tok.encode(text, add_special_tokens=False).ids) >= min_tokens:
                break
        rows.append({"text": text})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_inputs(args, work: Path, size: str) -> tuple[Path, Path, Path]:
    """The job's checkpoint of `size` and its rows: as ours reads them, and in the order our seeded sampler visits
    them, as torchtune (no shuffling) reads them."""
    from moai_recipes.data.batches import GlobalBatches

    checkpoint = make_checkpoint(work / "checkpoint", size, max_positions=max(512, args.seq_len))
    n = args.steps * args.batch_size
    rows = make_text_rows(checkpoint, count=n, min_tokens=args.seq_len + 8, seed=args.seed)
    ours_data = write_jsonl(work / "text.jsonl", rows)
    order = [i for step in range(args.steps)
             for i in GlobalBatches(num_samples=n, batch_size=args.batch_size, epochs=1,
                                    seed=args.seed).global_indices(step)]
    return checkpoint, ours_data, write_jsonl(work / "text_in_our_order.jsonl", [rows[i] for i in order])


# --- the three jobs ----------------------------------------------------------------------------------


@dataclass
class Job:
    name: str
    what: str
    steps: list[dict] = field(default_factory=list)  # per optimizer step: step, loss, tokens, seconds
    wall_s: list[float] = field(default_factory=list)  # whole process, startup and saving included
    failed: bool = False


def child_env(work: Path, *, pythonpath: str | None, threads: int | None) -> dict:
    env = dict(os.environ)
    # By default each tool picks its own threads as a user would get them: torch's default (all cores)
    # in one process, and our launcher's cores / processes for cpu-2. An inherited value would
    # override both, so it is dropped; --threads N sets it for every process of every job.
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(WANDB_MODE="disabled", WANDB_SILENT="true", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(work / "hf-datasets"), MOAI_CACHE=str(work / "moai-cache"),
               TOKENIZERS_PARALLELISM="false")
    return env


def ours_command(args, *, processes: int, checkpoint: Path, data: Path, out: Path, flavor: list[str] | None = None,
                 dtype: str = "fp32") -> list[str]:
    """`flavor`: the flavor's overrides (default: cpu, or cpu-N for `processes`); `dtype`: the compute dtype (a GPU's
    bf16; torchtune's dtype of the same name)."""
    flavor = flavor or [f"flavor={'cpu' if processes == 1 else f'cpu-{processes}'}"]
    return [sys.executable, "-m", "recipes.full_finetune", *flavor,
            "model=tiny", f"model.checkpoint_dir={checkpoint}", "dataset=text", f"dataset.path={data}",
            f"batch_size={args.batch_size}", f"max_seq_len={args.seq_len}", "epochs=1", f"max_steps={args.steps}",
            f"dtype={dtype}", "plan.compile=false", "logger=stdout", f"output_dir={out}", f"seed={args.seed}",
            f"optimizer.lr={args.lr}", f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]", f"optimizer.eps={EPS}",
            "optimizer.weight_decay=0.0", f"optimizer.warmup_steps={args.warmup_lr_steps}",
            f"optimizer.max_grad_norm={MAX_GRAD_NORM}", "plan.recompute=none",
            f"plan.micro_batch_size={args.batch_size // processes}", "checkpoint_every=null",
            # What torchtune's recipe does not do either: sample answers before and after (the process's wall), and
            # on the CPU follow every tensor of the second step (MemTracker: about 1.5x as slow), in the medians.
            "sample_max_new_tokens=0", "measure_memory=false"]


def torchtune_config(args, *, checkpoint: Path, data: Path, out: Path, device: str = "cpu",
                     dtype: str = "fp32") -> str:
    """The YAML for torchtune's full_finetune_single_device recipe, mirroring ours (on `device`, in `dtype`)."""
    from moai_recipes.models.spec import read_spec

    s = read_spec(checkpoint)
    shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    return f"""# Generated by bench/vs_torchtune.py: torchtune's full_finetune_single_device on our job.
output_dir: {out}
model:  # what moai_recipes.models.build_model calls for a llama checkpoint without rope_scaling
  _component_: torchtune.models.llama3.llama3
  vocab_size: {s.vocab_size}
  num_layers: {s.num_layers}
  num_heads: {s.num_heads}
  num_kv_heads: {s.num_kv_heads}
  embed_dim: {s.embed_dim}
  intermediate_dim: {s.intermediate_dim}
  max_seq_len: {args.seq_len}
  norm_eps: {s.norm_eps}
  rope_base: {s.rope_base}
tokenizer:  # tokenizer.json through torchtune's HuggingFaceBaseTokenizer (bench/torchtune_components.py)
  _component_: torchtune_components.hf_text_tokenizer
  checkpoint_dir: {checkpoint}
  max_seq_len: {args.seq_len + 1}  # text_completion_dataset keeps max_seq_len - 1 tokens: {args.seq_len}, as ours
dataset:  # the same rows, in the order our seeded sampler visits them
  _component_: torchtune.datasets.text_completion_dataset
  source: json
  data_files: {data}
  column: text
  split: train
  add_eos: true
  packed: false
seed: {args.seed}
shuffle: false
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {checkpoint}
  checkpoint_files: {json.dumps(shards)}
  recipe_checkpoint: null
  output_dir: {out}
  model_type: LLAMA3
resume_from_checkpoint: false
batch_size: {args.batch_size}
epochs: 1
max_steps_per_epoch: {args.steps}
gradient_accumulation_steps: 1
optimizer:
  _component_: torch.optim.AdamW
  lr: {args.lr}
  betas: [{BETAS[0]}, {BETAS[1]}]
  eps: {EPS}
  weight_decay: 0.0
  fused: true  # ours runs fused AdamW (train/optim.py); torch's CPU default is the per-tensor loop
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: {args.warmup_lr_steps}
loss:
  _component_: torch.nn.CrossEntropyLoss  # ours: plain cross-entropy on the full logits too
optimizer_in_bwd: false
clip_grad_norm: {MAX_GRAD_NORM}
compile: false
device: {device}
dtype: {dtype}
enable_activation_checkpointing: false
enable_activation_offloading: false
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: {out}/logs
log_every_n_steps: 1
log_peak_memory_stats: false
"""


def run_logged(cmd: list[str], *, cwd: Path, env: dict, log: Path, timeout: float) -> tuple[int, float]:
    """Run `cmd` in its own process group (cpu-2 has worker processes), output to `log`; (exit code, seconds).

    On a timeout, Ctrl-C or SIGTERM the whole group is killed, so no worker outlives the benchmark.
    """
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + f"\n(cwd {cwd})\n\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            f.write(f"\n[bench] killed after {timeout:.0f} s\n")
            rc = 124
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, time.perf_counter() - start


def read_ours(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "loss": r["loss"], "tokens": r["tokens"], "target_tokens": r["target_tokens"],
             "seconds": r["step_time_s"]} for r in rows]


_TT_LINE = re.compile(r"Step (\d+) \| (.*)")


def read_torchtune(out: Path, tokens_per_step: int) -> list[dict]:
    """Parse DiskLogger's `Step N | loss:X lr:Y tokens_per_second_per_gpu:Z` lines."""
    logs = sorted((out / "logs").glob("log_*.txt"))
    if not logs:
        raise FileNotFoundError(f"no DiskLogger file in {out / 'logs'}")
    rows = []
    for line in logs[-1].read_text().splitlines():
        m = _TT_LINE.match(line.strip())
        if not m:
            continue
        values = dict(kv.split(":", 1) for kv in m.group(2).split())
        if "tokens_per_second_per_gpu" not in values:
            continue
        tps = float(values["tokens_per_second_per_gpu"])
        # The recipe logs tokens/time only; with no padding its token count is batch * seq_len.
        rows.append({"step": int(m.group(1)), "loss": float(values["loss"]), "tokens": tokens_per_step,
                     "seconds": tokens_per_step / tps})
    return rows


def run_job(name: str, args, *, round_: int, work: Path, checkpoint: Path, data: Path, log: Path,
            device: str = "cpu", dtype: str = "fp32", flavor: list[str] | None = None) -> tuple[list[dict], float]:
    """Run one job to the end; its per-step rows and the process's wall time. Raises if it failed. `device`, `dtype`
    and `flavor` (ours' overrides): where it runs (scripts/gpu_check.py's on a GPU)."""
    out = work / f"{name}-r{round_}"
    if name == "torchtune":
        out.mkdir()
        cfg = work / f"torchtune-r{round_}.yaml"
        cfg.write_text(torchtune_config(args, checkpoint=checkpoint, data=data, out=out, device=device, dtype=dtype))
        cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", "full_finetune_single_device", "--config", str(cfg)]
        # Outside the repository, with only bench/ added to the path: torchtune's `recipes` must win there.
        env, cwd = child_env(work, pythonpath=str(BENCH), threads=args.threads), work
    else:
        cmd = ours_command(args, processes=2 if name == "ours-cpu-2" else 1, checkpoint=checkpoint, data=data, out=out,
                           flavor=flavor, dtype=dtype)
        env, cwd = child_env(work, pythonpath=None, threads=args.threads), ROOT
    rc, wall = run_logged(cmd, cwd=cwd, env=env, log=log, timeout=args.timeout)
    if rc != 0:
        raise RuntimeError(f"exit code {rc}")
    tokens_per_step = args.batch_size * args.seq_len
    steps = read_torchtune(out, tokens_per_step) if name == "torchtune" else read_ours(out)
    if len(steps) != args.steps:
        raise RuntimeError(f"{len(steps)} steps logged, {args.steps} expected")
    bad = [s for s in steps if s["tokens"] != tokens_per_step]
    if bad:
        raise RuntimeError(f"step {bad[0]['step']} has {bad[0]['tokens']} tokens, {tokens_per_step} expected "
                           "(padding?)")
    return steps, wall


# --- the report --------------------------------------------------------------------------------------


def steady(job: Job, warmup: int) -> list[dict]:
    return [r for r in job.steps if r["step"] > warmup]


def summary(job: Job, warmup: int) -> dict:
    rows = steady(job, warmup)
    seconds = statistics.median(r["seconds"] for r in rows)
    tps = [r["tokens"] / r["seconds"] for r in rows]
    spread = (min(tps), max(tps))
    return {"tokens_per_s": statistics.median(tps), "steps_per_s": 1 / seconds, "step_s": seconds,
            "spread": spread, "n": len(rows), "wall_s": statistics.median(job.wall_s)}


def table(jobs: dict[str, Job], args) -> str:
    s = {name: summary(job, args.warmup) for name, job in jobs.items() if not job.failed and steady(job, args.warmup)}
    base = s.get("ours-cpu")
    lines = ["| job | what | median tokens/s | (min-max) | median step s | steps/s | vs ours-cpu | "
             "process wall s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, job in jobs.items():
        if name not in s:
            lines.append(f"| {name} | {job.what} | failed | | | | | |")
            continue
        r = s[name]
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(f"| {name} | {job.what} | {r['tokens_per_s']:.0f} | {r['spread'][0]:.0f}-{r['spread'][1]:.0f} | "
                     f"{r['step_s']:.3f} | {r['steps_per_s']:.2f} | {ratio} | {r['wall_s']:.0f} |")
    out = "\n".join(lines)
    if base and "torchtune" in s:
        out += (f"\n\nours-cpu / torchtune: {base['tokens_per_s'] / s['torchtune']['tokens_per_s']:.2f}x tokens/s "
                f"({base['steps_per_s'] / s['torchtune']['steps_per_s']:.2f}x steps/s)")
    if base and "ours-cpu-2" in s:
        out += (f"\nours-cpu-2 / ours-cpu: {s['ours-cpu-2']['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s")
    return out


def loss_check(jobs: dict[str, Job]) -> str:
    """The same model, data and optimizer give the same losses: the first and last step of each job's round 1."""
    parts, first = [], {}
    for name, job in jobs.items():
        rows = [r for r in job.steps if r["round"] == 1]
        if rows:
            first[name] = rows[0]["loss"]
            parts.append(f"{name} {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")
    text = "Loss at the first -> last step (round 1): " + "; ".join(parts)
    if first and max(first.values()) - min(first.values()) > 1e-3:
        text += "\nWARNING: the first-step losses differ: the jobs did not run the same model on the same data"
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per job (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per optimizer step (default 2)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="medium", help="default medium (~24M)")
    p.add_argument("--rounds", type=int, default=2, help="each job runs once per round; round 2 reverses the order")
    p.add_argument("--only", choices=("all", "torchtune", "cpu-2"), default="all",
                   help="torchtune: ours-cpu and torchtune; cpu-2: ours-cpu and ours-cpu-2")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every process (default: unset, each tool's own default)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup-lr-steps", type=int, default=2, help="learning-rate warm-up steps (both tools)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds before a job is killed (default 600)")
    p.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp folder, removed)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_logged, which kills the job
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")
    if args.only in ("all", "cpu-2") and args.batch_size % 2:
        p.error("--batch-size must be even for flavor=cpu-2")

    import torch
    import torchtune

    from moai_recipes.models.spec import read_spec

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moai-vs-torchtune-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_before = time.perf_counter(), os.getloadavg()
    try:
        checkpoint, ours_data, tt_data = job_inputs(args, work, args.model_size)
        spec = read_spec(checkpoint)

        jobs = {"ours-cpu": Job("ours-cpu", "`recipes.full_finetune flavor=cpu` (1 process)"),
                "torchtune": Job("torchtune", "`tune run full_finetune_single_device`"),
                "ours-cpu-2": Job("ours-cpu-2", "`recipes.full_finetune flavor=cpu-2` (2 processes)")}
        if args.only == "torchtune":
            jobs.pop("ours-cpu-2")
        elif args.only == "cpu-2":
            jobs.pop("torchtune")

        print(f"Model: llama {args.model_size}, {spec.num_params() / 1e6:.1f}M parameters (hidden {spec.embed_dim}, "
              f"{spec.num_layers} layers, {spec.num_heads}/{spec.num_kv_heads} heads, vocab {spec.vocab_size}); "
              f"batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps, first {args.warmup} left out; "
              f"fp32 on CPU; {os.cpu_count()} cores, OMP_NUM_THREADS "
              f"{args.threads or 'unset (torch: all cores; ours cpu-2: cores / 2)'}; torch {torch.__version__}, "
              f"torchtune {torchtune.__version__}")
        print(f"Work folder: {work}", flush=True)
        for r in range(args.rounds):
            names = list(jobs) if r % 2 == 0 else list(reversed(jobs))
            for name in names:
                job = jobs[name]
                if job.failed:
                    continue
                log = work / f"{name}-r{r + 1}.log"
                try:
                    steps, wall = run_job(name, args, round_=r + 1, work=work, checkpoint=checkpoint,
                                          data=tt_data if name == "torchtune" else ours_data, log=log)
                except (RuntimeError, OSError, ValueError, KeyError) as e:
                    job.failed = True
                    tail = "\n".join(log.read_text().splitlines()[-40:]) if log.exists() else ""
                    print(f"\n{name} (round {r + 1}) FAILED: {e}; the end of {log}:\n{tail}\n", file=sys.stderr)
                    continue
                for s in steps:
                    s["round"] = r + 1
                job.steps.extend(s for s in steps if r == 0 or s["step"] > args.warmup)
                job.wall_s.append(wall)
                med = statistics.median(s["tokens"] / s["seconds"] for s in steps if s["step"] > args.warmup)
                print(f"  round {r + 1} {name:<11} {med:9.0f} tokens/s (median of steps "
                      f"{args.warmup + 1}-{args.steps}), process {wall:.0f} s", flush=True)
        # Medians pool the steady steps of every round; job.steps keeps round 1's warm-up steps only for the
        # loss check, and steady() drops them by step number.
        print()
        print(table(jobs, args))
        print()
        print(loss_check(jobs))
        print(f"\nCommand: python bench/vs_torchtune.py {' '.join(sys.argv[1:])}".rstrip())
        print(f"Bench wall time: {time.perf_counter() - t_start:.0f} s; {platform.platform()}; 1-minute load "
              f"average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (other jobs on the machine count)")
        return 1 if any(j.failed for j in jobs.values()) else 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
