"""The prepared device check: what a GPU session runs first, in one call, and records in docs/gpu.md.

    python scripts/gpu_check.py --out DIR          # on the device: its kernels, then training runs planned for it
    python scripts/gpu_check.py --cpu --out DIR    # the same sequence at tiny sizes on this CPU (the suite runs it)
    python scripts/gpu_check.py --wheels .whl --out DIR   # a bare GPU machine: scripts/gpu_wheels.sh's wheels first

It writes DIR/report.json and DIR/report.md: the card, the versions, each check (passed or not, what it measured,
its seconds) and each run. A check that fails or raises is recorded and the rest go on: one call must say as much
as it can about a machine lent for minutes.

1. Kernels against their references (bf16 on a GPU, fp32 on the CPU):
   - the experts' grouped product (models/moe.py) against one product per expert, outputs and gradients;
   - packed rows' attention (models/attention.py: varlen flash attention on a GPU in bf16, document by document on
     the CPU) against the whole row's in fp32 under each document's causal mask;
   - fused AdamW against the per-tensor loop; torchao's 8-bit AdamW against AdamW (how far its steps go);
   - NF4 weights (QLoRA): the quantization error, and a LoRA layer on NF4 against its dequantized weight;
   - a compiled block against the eager one; activation offload (the recomputed layer's input kept on the host,
     models/activation_offload.py) against plain recomputation.
2. Training runs planned for the device (random weights: nothing can be downloaded there): a Llama-3.2-1B-shaped
   model, a Qwen3-MoE-shaped one and a Qwen3.5-shaped one through transformers' modules, full fine-tuning and LoRA:
   the planner's peak and step time against the measured ones, and MFU, as each run prints them.
3. torchtune's own full_finetune_single_device recipe against recipes.full_finetune on the same Llama checkpoint
   (Llama-3.2-1B's layers on a GPU; bench/vs_torchtune.py's job, whose code it runs), the same rows in the same order,
   the same settings (no recomputation, no compile, fused AdamW, bf16 on a GPU): tokens/s side by side, the ratio,
   and the first step's loss of each.
4. A GRPO round (recipes.grpo, the Llama-shaped checkpoint, the additions prompts): the planner's sampling time of a
   round and its KV cache against the measured ones.
5. The suite's tests marked `gpu` (tests/test_gpu.py: the kernels as tests, CPU-offloaded state on NCCL with its norm
   over gloo, packed rows through the varlen kernel): their summary line and the names of any that failed. They skip
   on the CPU.
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NOT_YET: list[str] = []


# ---------------------------------------------------------------------------------------------------------------
# Kernels


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest magnitude."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def check_grouped_experts(device, dtype, tol):
    from moai_recipes.models.moe import _grouped, _per_expert, grouped_product_runs

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([9, 0, 23, 5, 17, 1, 0, 9])  # uneven, two experts without rows
    x = torch.randn(int(counts.sum()), 64, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(8, 128, 64, generator=g) / 8).to(device, dtype).requires_grad_()
    ends = counts.cumsum(0).to(device=device, dtype=torch.int32)
    out = _grouped(x, w, ends)
    out.float().square().sum().backward()
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    ref = _per_expert(x32, w32, ends)
    ref.square().sum().backward()
    errors = {"output": _close(out, ref), "x.grad": _close(x.grad, x32.grad), "w.grad": _close(w.grad, w32.grad)}
    path = "grouped product" if dtype == torch.bfloat16 and grouped_product_runs(x, w) or device.type == "cpu" \
        else "one product per expert"
    return max(errors.values()) <= tol, {"path": path, **errors}


def check_packed_attention(device, dtype, tol):
    from moai_recipes.models.attention import Documents, attend_documents

    g = torch.Generator().manual_seed(1)
    docs = Documents((37, 64, 27))
    q, k, v = ((torch.randn(1, 4, 128, 64, generator=g)).to(device, dtype).requires_grad_() for _ in range(3))
    out = attend_documents(q, k, v, docs, 0.0)
    out.float().square().sum().backward()
    # The reference: the whole row at once in fp32, under the mask of each token's own document up to itself.
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    doc = torch.repeat_interleave(torch.arange(len(docs.lengths)), torch.tensor(docs.lengths)).to(device)
    place = torch.arange(len(doc), device=device)
    mask = (doc[:, None] == doc[None, :]) & (place[None, :] <= place[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=mask)
    ref.square().sum().backward()
    errors = {"output": _close(out, ref), **{f"{n}.grad": _close(a.grad, b.grad)
                                            for n, a, b in zip("qkv", (q, k, v), ref_in)}}
    varlen = q.is_cuda and dtype in (torch.bfloat16, torch.float16)
    return max(errors.values()) <= tol, {"path": "varlen flash attention" if varlen else "per document", **errors}


def _adamw_steps(make, device, steps=3):
    g = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(256, 256, generator=g).to(device))
    opt = make([p])
    start = p.detach().clone()
    for i in range(steps):
        p.grad = (torch.randn(256, 256, generator=torch.Generator().manual_seed(10 + i)) * 1e-2).to(device)
        opt.step()
    return start, p.detach()


def check_fused_adamw(device, dtype, tol):
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _, fused = _adamw_steps(lambda ps: torch.optim.AdamW(ps, fused=True, **kwargs), device)
    _, loop = _adamw_steps(lambda ps: torch.optim.AdamW(ps, foreach=False, **kwargs), device)
    error = _close(fused, loop)
    return error <= 1e-5, {"against the per-tensor loop": error}


def check_adamw_8bit(device, dtype, tol):
    from torchao.optim import AdamW8bit

    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    # torchao compiles its step, as a device runs it; on the CPU the same step runs eager: a cold compile of it is
    # 14 of the CPU sequence's seconds, and the suite trains with the compiled one (tests/test_precision.py).
    stance = "default" if device.type == "cuda" else "force_eager"
    with torch.compiler.set_stance(stance):
        start, eight = _adamw_steps(lambda ps: AdamW8bit(ps, **kwargs), device)
    _, full = _adamw_steps(lambda ps: torch.optim.AdamW(ps, **kwargs), device)
    # How far the 8-bit moments' steps land from fp32 AdamW's, relative to how far those went.
    error = _close(eight - start, full - start)
    return error <= 0.1, {"step": "compiled" if stance == "default" else "eager", "step against AdamW's": error}


def check_nf4_lora(device, dtype, tol):
    from torchao.dtypes.nf4tensor import to_nf4
    from torchtune.modules.peft import LoRALinear

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 256, generator=g) / 16).to(device, torch.bfloat16)
    nf4 = to_nf4(w)
    rms = float((nf4.get_original_weight().float() - w.float()).square().mean().sqrt() / w.float().square().mean().sqrt())
    layer = LoRALinear(256, 256, rank=4, alpha=8, quantize_base=True).to(device)
    layer.weight = torch.nn.Parameter(to_nf4(w), requires_grad=False)
    torch.nn.init.normal_(layer.lora_b.weight, std=0.02)
    layer.lora_a.to(torch.bfloat16), layer.lora_b.to(torch.bfloat16)  # the adapters in the compute dtype, as QLoRA's
    x = torch.randn(8, 256, generator=g).to(device, torch.bfloat16)
    a, b = layer.lora_a.weight.float(), layer.lora_b.weight.float()
    ref = x.float() @ layer.weight.get_original_weight().float().T + (x.float() @ a.T @ b.T) * 2
    error = _close(layer(x), ref)
    return rms <= 0.12 and error <= 2e-2, {"nf4 relative rms error": rms, "lora on nf4 against dequantized": error}


def _block(device, dtype):
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64)).to(device, dtype)


def _grads(block, x):
    block.zero_grad()
    out = block(x)
    out.float().square().sum().backward()
    return out, [p.grad.clone() for p in block.parameters()]


def check_compile(device, dtype, tol):
    block = _block(device, dtype)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    eager, eager_grads = _grads(block, x)
    compiled_block = torch.compile(block)
    compiled, compiled_grads = _grads(compiled_block, x)
    errors = {"output": _close(compiled, eager), "grads": max(_close(a, b) for a, b in zip(compiled_grads, eager_grads))}
    return max(errors.values()) <= tol, errors


def check_activation_offload(device, dtype, tol):
    from moai_recipes.models.activation_offload import ActivationOffload
    from moai_recipes.models.recompute import apply_recompute

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    plain = torch.nn.ModuleList([_block(device, dtype), _block(device, dtype)])
    offloaded = torch.nn.ModuleList([_block(device, dtype), _block(device, dtype)])
    apply_recompute(plain, "full")
    apply_recompute(offloaded, "full", ActivationOffload())

    def run(layers):
        for p in layers.parameters():
            p.grad = None
        h = x
        for layer in layers:
            h = layer(h)
        h.float().square().sum().backward()
        return h, [p.grad for p in layers.parameters()]

    (a, ga), (b, gb) = run(plain), run(offloaded)
    errors = {"output": _close(b, a), "grads": max(_close(u, v) for u, v in zip(gb, ga))}
    return max(errors.values()) <= 1e-6, errors


CHECKS = [check_grouped_experts, check_packed_attention, check_fused_adamw, check_adamw_8bit, check_nf4_lora,
          check_compile, check_activation_offload]


def run_check(fn, device, dtype, tol) -> dict:
    name = fn.__name__.removeprefix("check_")
    start = time.perf_counter()
    try:
        ok, measured = fn(device, dtype, tol)
        error = None
    except Exception as e:  # recorded: the other checks still run
        ok, measured, error = False, {}, "".join(traceback.format_exception_only(e)).strip()[-600:]
    return {"name": name, "ok": bool(ok), "measured": measured, "error": error,
            "seconds": round(time.perf_counter() - start, 2)}


# ---------------------------------------------------------------------------------------------------------------
# Training runs


# Shapes at the device's sizes and at the CPU's: (model_type, config fields). Qwen3-MoE's is Qwen3-30B-A3B's layer
# with 4 of its 48 layers (full fine-tuning of it fits one 80 GB card); Qwen3.5's is its 0.8B's.
SHAPES = {
    "llama": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
              dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                    num_experts=128, num_experts_per_tok=8, vocab_size=151936),
                  dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       vocab_size=512)),
    "qwen3_5 (transformers' modules)": ("qwen3_5_text", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, vocab_size=248320), dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16)),
}


def random_checkpoint(folder: Path, model_type: str, fields: dict, dtype: torch.dtype) -> Path:
    """A Hugging Face folder of `model_type` with random weights, written by transformers, and the embedded demo
    model's tokenizer (its vocabulary is the first ids of the model's)."""
    import shutil

    import transformers

    from moai_recipes.models.tiny import tiny_checkpoint_dir

    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() and dtype == torch.bfloat16 else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    tokenizer = tiny_checkpoint_dir(folder.parent / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder / name)
    config_json = json.loads((folder / "config.json").read_text())
    tiny_config = json.loads((tokenizer / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config_json[key] = tiny_config.get(key)
    (folder / "config.json").write_text(json.dumps(config_json, indent=2))
    return folder


def training_run(out: Path, checkpoint: Path, method: str, flavor: list[str], precision: list[str],
                 steps: int, seq_len: int) -> dict:
    module = "recipes.lora_finetune" if method == "lora" else "recipes.full_finetune"
    args = [sys.executable, "-m", module, f"model.checkpoint_dir={checkpoint}", *flavor, *precision,
            f"max_steps={steps}", "batch_size=8", f"max_seq_len={seq_len}", "logger=stdout", "sample_max_new_tokens=0",
            "measure_memory=true", f"output_dir={out}"]
    start = time.perf_counter()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    found = {"command": " ".join(args[1:]), "returncode": r.returncode, "seconds": round(time.perf_counter() - start, 1)}
    peak = re.search(r"Peak tensor memory per device: predicted ([\d.]+) GiB, measured ([\d.]+) GiB \(([-+][\d.]+)%\)",
                     r.stdout)
    step = re.search(r"Step time: predicted ([\d.]+) s, measured ([\d.]+) s .*?([-+][\d.]+)%\)", r.stdout)
    plan = re.search(r"Configuration for parallelism is selected: (.*)", r.stdout)
    mfu = re.findall(r"MFU: ([\d.]+)%", r.stdout)
    if peak:
        found.update(predicted_peak_gib=float(peak[1]), measured_peak_gib=float(peak[2]), peak_off_pct=float(peak[3]))
    if step:
        found.update(predicted_step_s=float(step[1]), measured_step_s=float(step[2]), step_off_pct=float(step[3]))
    found.update(plan=plan[1].split(", cpu_offload")[0] if plan else None, mfu_pct=float(mfu[-1]) if mfu else None)
    if r.returncode:
        found["error"] = (r.stdout + r.stderr)[-1500:]
    return found


def grpo_round(out: Path, checkpoint: Path, flavor: list[str], precision: list[str], steps: int) -> dict:
    """recipes.grpo on `checkpoint` (full fine-tuning, the embedded additions prompts, a reward for a number alone):
    its sampling time of a round against the planner's, as the run prints them."""
    args = [sys.executable, "-m", "recipes.grpo", f"model.checkpoint_dir={checkpoint}", "dataset=additions",
            "method=full", *flavor, *precision, f"max_steps={max(steps, 3)}", "batch_size=8", "num_generations=4",
            "max_completion_length=32", "max_seq_len=128", "rewards=[moai_recipes.rewards.number_only]",
            "logger=stdout", "sample_max_new_tokens=0", f"output_dir={out}"]
    start = time.perf_counter()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    found = {"name": "GRPO round", "command": " ".join(args[1:]), "returncode": r.returncode,
             "seconds": round(time.perf_counter() - start, 1)}
    said = re.search(r"Sampling a round: predicted ([\d.e+-]+) s, measured ([\d.e+-]+) s .*?([-+][\d.]+)%\); KV cache "
                     r"predicted ([\d,]+) bytes", r.stdout)
    if said:
        found.update(predicted_sampling_s=float(said[1]), measured_sampling_s=float(said[2]),
                     sampling_off_pct=float(said[3]), predicted_kv_cache_bytes=int(said[4].replace(",", "")))
    if r.returncode or not said:
        found["error"] = (r.stdout + r.stderr)[-1500:]
        found["returncode"] = r.returncode or -1
    return found


def gpu_tests(timeout: int = 300) -> dict:
    """`pytest -m gpu` on tests/test_gpu.py: its summary line, and the tests that failed."""
    args = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            "tests/test_gpu.py"]
    start = time.perf_counter()
    try:
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": "tests marked gpu", "returncode": 124, "summary": f"killed after {timeout} s"}
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    return {"name": "tests marked gpu", "returncode": r.returncode, "summary": lines[-1] if lines else "",
            "failed": re.findall(r"^FAILED (\S+)", r.stdout, re.M), "seconds": round(time.perf_counter() - start, 1),
            **({"error": (r.stdout + r.stderr)[-1500:]} if r.returncode not in (0, 5) else {})}


def torchtune_side_by_side(work: Path, *, gpu: bool, flavor: list[str], steps: int) -> dict:
    """torchtune's full_finetune_single_device and recipes.full_finetune, one after the other, on the same checkpoint,
    rows and settings (bench/vs_torchtune.py's job): the median tokens/s of each after the first step, their ratio,
    the first step's losses."""
    import argparse as _argparse
    import statistics

    from bench import vs_torchtune as bench

    args = _argparse.Namespace(batch_size=8 if gpu else 2, seq_len=1024 if gpu else 64, steps=max(steps, 3), lr=2e-5,
                               warmup_lr_steps=1, seed=0, threads=None, timeout=300)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, ours_data, tt_data = bench.job_inputs(args, work, "llama3_2_1b" if gpu else "small")
    found = {"name": "torchtune side by side", "batch": f"{args.batch_size} x {args.seq_len} tokens",
             "steps": args.steps}
    speeds = {}
    for tool, job in (("torchtune", "torchtune"), ("ours", "ours-cpu")):
        log = work / f"{tool}.log"
        try:
            steps_done, seconds = bench.run_job(job, args, round_=1, work=work, checkpoint=checkpoint,
                                                data=tt_data if tool == "torchtune" else ours_data, log=log,
                                                device="cuda" if gpu else "cpu", dtype="bf16" if gpu else "fp32",
                                                flavor=flavor)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            found.update(returncode=1, error=f"{tool}: {e}\n" + (log.read_text()[-1500:] if log.exists() else ""))
            return found
        found[f"{tool}_seconds"] = round(seconds, 1)
        speeds[tool] = statistics.median(s["tokens"] / s["seconds"] for s in steps_done[1:])
        found[f"{tool}_tokens_per_s"] = round(speeds[tool], 1)
        found[f"{tool}_first_loss"] = steps_done[0]["loss"]
    found.update(returncode=0, ratio=round(speeds["ours"] / speeds["torchtune"], 2))
    return found


# ---------------------------------------------------------------------------------------------------------------


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
           "wheels_installed_into": os.environ.get(_WHEELS_ON)}
    for name in ("transformers", "torchtune", "torchao", "peft", "trl"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def card(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}"
    return f"CPU: {platform.processor() or platform.machine()}"


def markdown(report: dict) -> str:
    lines = [f"# Device check, {report['date']}", "", f"- card: {report['card']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v), "",
             "| check | result | measured | s |", "| --- | --- | --- | ---: |"]
    for c in report["checks"]:
        measured = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in c["measured"].items())
        lines.append(f"| {c['name']} | {'ok' if c['ok'] else 'FAILED'} | {measured or c['error']} | {c['seconds']} |")
    lines += ["", "| run | plan | peak predicted / measured (GiB) | step predicted / measured (s) | MFU |",
              "| --- | --- | --- | --- | ---: |"]
    for r in report["runs"]:
        if r.get("returncode"):
            lines.append(f"| {r['name']} | FAILED (exit {r['returncode']}) | | | |")
            continue
        peak = f"{r.get('predicted_peak_gib')} / {r.get('measured_peak_gib')} ({r.get('peak_off_pct')}%)"
        step = f"{r.get('predicted_step_s')} / {r.get('measured_step_s')} ({r.get('step_off_pct')}%)"
        lines.append(f"| {r['name']} | {r.get('plan') or ''} | {peak} | {step} | {r.get('mfu_pct')}% |")
    side = report.get("torchtune")
    if side:
        lines += ["", "| torchtune side by side | tokens/s torchtune | tokens/s ours | ours / torchtune | first loss "
                  "torchtune / ours |", "| --- | ---: | ---: | ---: | --- |"]
        if side.get("returncode"):
            lines.append(f"| {side['batch']} | FAILED (exit {side['returncode']}) | | | |")
        else:
            lines.append(f"| {side['batch']}, {side['steps']} steps | {side['torchtune_tokens_per_s']} | "
                         f"{side['ours_tokens_per_s']} | {side['ratio']}x | {side['torchtune_first_loss']:.4f} / "
                         f"{side['ours_first_loss']:.4f} |")
    grpo = report.get("grpo")
    if grpo:
        lines += ["", "| GRPO round | sampling predicted / measured (s) | KV cache predicted (bytes) |",
                  "| --- | --- | ---: |"]
        if grpo.get("returncode"):
            lines.append(f"| {grpo['name']} | FAILED (exit {grpo['returncode']}) | |")
        else:
            lines.append(f"| {grpo['name']} | {grpo['predicted_sampling_s']} / {grpo['measured_sampling_s']} "
                         f"({grpo['sampling_off_pct']}%) | {grpo['predicted_kv_cache_bytes']:,} |")
    tests = report.get("gpu_tests")
    if tests:
        lines += ["", f"Tests marked gpu: {tests['summary']}" + (f" (failed: {', '.join(tests['failed'])})"
                                                                 if tests.get("failed") else "")]
    if report["not_yet"]:
        lines += ["", "Not yet part of the check: " + "; ".join(report["not_yet"]) + "."]
    return "\n".join(lines) + "\n"


_WHEELS_ON = "MOAI_GPU_CHECK_WHEELS"  # set in the check's own process once the wheels are installed


def _with_wheels(wheels: Path) -> int:
    """Install `wheels` (no index, no dependencies: they are the closure scripts/gpu_wheels.sh downloaded) into a
    folder of their own, ahead of the image's packages on PYTHONPATH (its transformers is older than ours), and run
    this check again in a process that sees them; the recipes it starts inherit the path."""
    import tempfile

    found = sorted(Path(wheels).glob("*.whl"))
    if not found:
        print(f"--wheels {wheels}: no .whl files there; run scripts/gpu_wheels.sh here first", file=sys.stderr)
        return 2
    site = Path(tempfile.mkdtemp(prefix="moai-wheels-")) / "site"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), *map(str, found)], check=True)
    print(f"== installed {len(found)} wheels into {site} in {time.perf_counter() - start:.1f} s", flush=True)
    env = {**os.environ, _WHEELS_ON: str(site),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, *sys.argv], env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the whole sequence at tiny sizes on the CPU")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=None, help="steps of each training run (default: 6, CPU 3)")
    parser.add_argument("--methods", default="full,lora", help="the training runs' methods (default: full,lora)")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="install these wheels (scripts/gpu_wheels.sh: what the machine's image lacks) into a "
                             "folder of their own, then run the check with them")
    args = parser.parse_args()
    if args.wheels is not None and not os.environ.get(_WHEELS_ON):
        return _with_wheels(args.wheels)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda") if gpu else torch.device("cpu")
    dtype, tol = (torch.bfloat16, 2e-2) if gpu else (torch.float32, 1e-5)
    args.out.mkdir(parents=True, exist_ok=True)
    # A check run again into the same folder starts from nothing: its runs would resume from the last one's step
    # checkpoints (the same command resumes), and torchtune's recipe refuses a log folder that exists.
    for part in ("checkpoints", "runs", "torchtune"):
        shutil.rmtree(args.out / part, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d"), "card": card(device), "versions": versions(), "checks": [],
              "runs": [], "not_yet": NOT_YET}
    for fn in CHECKS:
        report["checks"].append(run_check(fn, device, dtype, tol))
        print(json.dumps(report["checks"][-1]), flush=True)
    name = torch.cuda.get_device_name(device).lower() if gpu else ""
    kind = "h200" if "h200" in name else "a100" if "a100" in name else "h100"
    memory = torch.cuda.get_device_properties(device).total_memory / 1e9 if gpu else None
    flavor = ["flavor=small", f"flavor.device={kind}", f"flavor.memory_gb={memory:.0f}"] if gpu else ["flavor=cpu"]
    precision = ["dtype=bf16"] if gpu else []
    steps = args.steps or (6 if gpu else 3)
    # Rows of 512 tokens on a device; 128 on the CPU, tiny sizes (the Qwen3.5-shaped run took 12.7 s at 512, 7.3 s
    # at 128, its layers traced fake then).
    seq_len = 512 if gpu else 128
    for shape, (model_type, device_fields, cpu_fields) in SHAPES.items():
        try:
            checkpoint = random_checkpoint(args.out / "checkpoints" / model_type, model_type,
                                           device_fields if gpu else cpu_fields, dtype)
        except Exception as e:
            report["runs"].append({"name": shape, "returncode": -1, "error": str(e)[-600:]})
            continue
        for method in args.methods.split(","):
            run = training_run(args.out / "runs" / f"{model_type}-{method}", checkpoint, method, flavor, precision,
                               steps, seq_len)
            report["runs"].append({"name": f"{shape}, {method}", **run})
            print(json.dumps(report["runs"][-1])[:400], flush=True)
    llama = args.out / "checkpoints" / SHAPES["llama"][0]
    report["grpo"] = (grpo_round(args.out / "runs" / "grpo", llama, flavor, precision, steps) if llama.is_dir() else
                      {"name": "GRPO round", "returncode": -1, "error": "no Llama-shaped checkpoint was made"})
    print(json.dumps(report["grpo"])[:400], flush=True)
    try:
        report["torchtune"] = torchtune_side_by_side(args.out / "torchtune", gpu=gpu, flavor=flavor, steps=steps)
    except Exception:
        report["torchtune"] = {"name": "torchtune side by side", "returncode": -1,
                               "error": traceback.format_exc()[-1500:]}
    print(json.dumps(report["torchtune"])[:400], flush=True)
    report["gpu_tests"] = gpu_tests()
    print(json.dumps(report["gpu_tests"])[:400], flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(markdown(report))
    print(f"Written to {args.out / 'report.md'}")
    failed = [c["name"] for c in report["checks"] if not c["ok"]] + [r["name"] for r in report["runs"]
                                                                      if r.get("returncode")]
    failed += ["torchtune side by side"] if report["torchtune"].get("returncode") else []
    failed += ["GRPO round"] if report["grpo"].get("returncode") else []
    failed += ["tests marked gpu"] if report["gpu_tests"]["returncode"] not in (0, 5) else []  # 5: none collected
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
