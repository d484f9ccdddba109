"""The full fine-tuning recipe end to end, in real processes (2-process gloo runs included).

Run: pytest tests/test_full_finetune.py   (about two minutes on two cores)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import make_hf_checkpoint
from tests.helpers import (
    FSDP,
    ROOT,
    instruct_rows,
    layout,
    metrics,
    peak_error,
    run_recipe,
    tensors,
    wandb_records,
    write_jsonl,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def instruct_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", instruct_rows())


def test_the_demo_learns_and_writes_everything(tmp_path):
    out = tmp_path / "run"
    home = tmp_path / "home"
    r = run_recipe("logger=stdout", "epochs=6", "batch_size=8", "optimizer.lr=3e-3", "optimizer.warmup_steps=3",
                   f"output_dir={out}", env={"MOAI_HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = metrics(out)
    assert len(rows) == 60 and [row["step"] for row in rows] == list(range(1, 61))
    for key in ("step", "loss", "lr", "tokens", "tokens_per_sec", "step_time_s", "grad_norm", "peak_memory_bytes"):
        assert all(key in row for row in rows), key
    first, last = rows[0]["loss"], sum(row["loss"] for row in rows[-5:]) / 5
    assert last < first / 2, (first, last)  # it learns (6.25 -> ~2.2 in 60 steps)
    assert "[Step 1/60] | Loss: " in r.stdout and "| Duration: " in r.stdout and "tokens/sec" in r.stdout
    assert "Configuration for parallelism is selected" in r.stdout and "before:" in r.stdout and "after:" in r.stdout
    assert abs(peak_error(r.stdout)) <= 0.10 and "Step time: predicted" in r.stdout
    # The run recorded what it predicted and measured for `moai calibrate` (tests/test_calibration.py).
    (line,) = (home / "calibration" / "runs.jsonl").read_text().splitlines()
    record, plan = json.loads(line), json.loads((out / "plan.json").read_text())["chosen"]
    assert record["device"] == "cpu" and record["plan"]["micro_batch_size"] == plan["micro_batch_size"]
    assert record["time_terms"] == plan["time"]["terms"] and record["workload"]["model"] == "tiny"
    assert record["measured_step_s"] == sorted(row["step_time_s"] for row in rows[2:])[29]  # the median of 58
    assert record["measured_peak_bytes"] > record["memory_exact"] > 0 and record["memory_traced"] > 0
    for name in ("config.yaml", "plan.json", "loss.png", "model/config.json", "model/model.safetensors", "model/tokenizer.json"):
        assert (out / name).exists(), name
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_same_losses_on_any_flavor_and_micro_batch(tmp_path, hf_checkpoints, instruct_file):
    common = [f"model.checkpoint_dir={hf_checkpoints['llama']}", "dataset=instruct", f"dataset.path={instruct_file}",
              "batch_size=6", "max_steps=4", "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "logger=stdout"]
    losses = {}
    # cpu-4 (four processes on two cores, slow here) in test_packing.py
    runs = {"cpu": ("single", ["flavor=cpu"]), "cpu-2 sharded": ("sharded", ["flavor=cpu-2", *FSDP]),
            "cpu-2 replicated": ("replicated", ["flavor=cpu-2", "plan.replicate=true"]),
            "cpu-mbs1": ("single", ["flavor=cpu", "plan.micro_batch_size=1"])}
    for name, (kind, extra) in runs.items():
        r = run_recipe(*common, *extra, f"output_dir={tmp_path / name}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert layout(tmp_path / name) == kind
        assert abs(peak_error(r.stdout)) <= 0.10, name  # the planner's peak, like for like (tensor bytes)
        losses[name] = [row["loss"] for row in metrics(tmp_path / name)]
    ref = losses["cpu"]
    assert len(ref) == 4 and ref[-1] < ref[0]
    for name, got in losses.items():
        for a, b in zip(ref, got):
            assert abs(a - b) <= 1e-4 * abs(a), (name, ref, got)


def test_bf16_compute_follows_fp32_and_its_peak_is_planned(tmp_path):
    """dtype=bf16 (bf16 compute, fp32 master weights): full on two processes (FSDP2's mixed precision) and LoRA on
    one (a plain module on bf16 copies of its adapters, its frozen base stored in bf16: train/mixed_precision.py); the
    losses follow fp32's within bf16's precision and the planner's peak holds like for like. The LoRA run's merged
    model is the fp32 checkpoint's weights plus the adapters, as peft merges them: not the bf16 base it computed with."""
    common = ["logger=stdout", "max_steps=4", "batch_size=8", "optimizer.lr=3e-3", "sample_max_new_tokens=0"]
    runs = {"fp32": ("recipes.full_finetune", ["flavor=cpu"]),
            "bf16": ("recipes.full_finetune", ["flavor=cpu-2", "dtype=bf16"]),
            "lora-bf16": ("recipes.lora_finetune", ["flavor=cpu", "dtype=bf16"]),
            # FSDP2 gathering a bf16 base beside the adapters' fp32 masters (cast to bf16 as it gathers them).
            "lora-bf16-fsdp": ("recipes.lora_finetune", ["flavor=cpu-2", "dtype=bf16", "plan.replicate=false",
                                                         "save_merged=false"])}
    losses = {}
    for name, (module, extra) in runs.items():
        r = run_recipe(*common, *extra, f"output_dir={tmp_path / name}", module=module)
        assert r.returncode == 0, r.stdout + r.stderr
        assert abs(peak_error(r.stdout)) <= 0.10, name
        assert ("bfloat16 compute, float32 master weights" in r.stdout) == (name != "fp32")
        assert layout(tmp_path / name) == ("single" if name in ("fp32", "lora-bf16") else "sharded")
        losses[name] = [row["loss"] for row in metrics(tmp_path / name)]
    for a, b in zip(losses["fp32"], losses["bf16"], strict=True):
        assert abs(a - b) <= 2e-2 * a, losses
    assert losses["lora-bf16"][-1] < losses["lora-bf16"][0]
    for a, b in zip(losses["lora-bf16"], losses["lora-bf16-fsdp"], strict=True):  # the order of fp32 sums apart
        assert abs(a - b) <= 1e-4 * a, losses

    import peft
    import transformers
    from omegaconf import OmegaConf

    out = tmp_path / "lora-bf16"
    base = Path(OmegaConf.load(out / "config.yaml").model.checkpoint_dir)
    assert all(t.dtype == torch.float32 for t in tensors(base).values())
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    expected = peft.PeftModel.from_pretrained(plain, out / "adapter").merge_and_unload().state_dict()
    got = tensors(out / "model")
    for name, tensor in got.items():
        # A bf16 base would be 1e-4 to 1e-3 off (its 8 bits of mantissa); the checkpoint's own weights are exact.
        assert tensor.dtype == torch.float32 and (tensor - expected[name]).abs().max() <= 1e-6, name


@pytest.mark.parametrize("family, flavor, options", [
    ("llama", "cpu", {}),
    ("mistral", "cpu", {"dtype": "bfloat16"}),
    ("qwen2", "cpu-2 sharded", {"tie": True, "max_shard_size": "60KB"}),
    ("qwen3", "cpu-2 replicated", {"tie": True}),
])
def test_lr_zero_returns_the_input_weights_bit_for_bit(tmp_path, family, flavor, options, instruct_file):
    hf = make_hf_checkpoint(tmp_path / "in", family, **options)
    out = tmp_path / "run"
    flavor, _, kind = flavor.partition(" ")
    forced = {"sharded": list(FSDP), "replicated": ["plan.replicate=true"]}.get(kind, [])
    r = run_recipe(f"model.checkpoint_dir={hf}", f"flavor={flavor}", *forced, "dataset=instruct",
                   f"dataset.path={instruct_file}", "optimizer.lr=0", "max_steps=1", "batch_size=4", "logger=stdout",
                   f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert layout(out) == (kind or "single")
    model_dir = out / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(p.name for p in hf.iterdir())
    before, after = tensors(hf), tensors(model_dir)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model_dir)


def test_a_first_run_on_several_processes_with_an_empty_cache_finishes(tmp_path):
    """A new machine's first cpu-2 run: the launcher makes the tiny default model before it forks the workers. It once
    started an OpenMP team doing so, and the forked workers hung at their first parallel region (libgomp is not
    fork-safe)."""
    import os
    import shutil

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(os.path.join(os.environ["MOAI_CACHE"], "cpu-speed.json"), cache)  # the suite's pinned speed only
    # A fresh `python -m recipes.full_finetune` (not forked from tests/zygote.py, which imported every recipe first):
    # the recipe imports what it uses itself.
    r = run_recipe("flavor=cpu-2", "logger=stdout", "max_steps=1", "batch_size=4", "sample_max_new_tokens=0",
                   f"output_dir={tmp_path / 'run'}", env={"MOAI_CACHE": str(cache)}, timeout=300, isolated=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (cache / "tiny-llama-v1-seed0").is_dir() and (tmp_path / "run" / "model").is_dir()


def test_an_earlier_run_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    assert run_recipe("logger=stdout", "max_steps=2", f"output_dir={out}").returncode == 0
    kept = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = run_recipe("logger=stdout", "max_steps=2", f"output_dir={out}")
    assert again.returncode == 2 and "holds a finished run" in again.stderr and "Traceback" not in again.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == kept


@pytest.mark.parametrize("args, words", [
    (["model.checkpoint_dir=/nonexistent/hf"], ["model.checkpoint_dir", "/nonexistent/hf"]),
    (["dataset=instruct"], ["dataset.path"]),
    (["dataset=instruct", "dataset.path=/nonexistent.jsonl"], ["/nonexistent.jsonl"]),
    (["flavor=4xlarge"], ["recipes.plan", "mi250"]),
    (["flavor=cpu-2", "model.checkpoint_dir=/nonexistent/hf"], ["/nonexistent/hf"]),
    (["model=llama3_8b"], ["model.checkpoint_dir", "meta-llama"]),
    (["plan.micro_batch_size=99"], ["plan.micro_batch_size=99"]),
])
def test_user_mistakes_exit_2_with_one_clear_message(tmp_path, args, words):
    r = run_recipe("logger=stdout", f"output_dir={tmp_path / 'run'}", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_of_another_family_is_refused_alike_by_training_validate_and_plan(tmp_path, hf_checkpoints):
    """One reader of a run (inputs.py): what one of them refuses, all refuse, with the same message."""
    args = ["model=mistral", f"model.checkpoint_dir={hf_checkpoints['qwen2']}"]
    said = {"full_finetune": run_recipe("logger=stdout", f"output_dir={tmp_path / 'run'}", *args),
            "cpu-2": run_recipe("logger=stdout", f"output_dir={tmp_path / 'run'}", "flavor=cpu-2", *args),
            "validate": subprocess.run([sys.executable, "-m", "moai_recipes.tools.cli", "validate", "full_finetune", *args],
                                       cwd=ROOT, capture_output=True, text=True, timeout=300),
            "plan": run_recipe(*args, module="recipes.plan")}
    for who, r in said.items():
        assert r.returncode == 2 and "Traceback" not in r.stderr, (who, r.stdout + r.stderr)
    errors = {who: next(line for line in r.stderr.splitlines() if line.startswith("error:")) for who, r in said.items()}
    assert len(set(errors.values())) == 1 and "holds a qwen2 model" in errors["plan"], errors
    assert not (tmp_path / "run").exists()


def test_a_malformed_row_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "input": "", "output": "b"}\n{"instruction": "a", "output": \n')
    r = run_recipe("logger=stdout", "dataset=instruct", f"dataset.path={bad}", f"output_dir={tmp_path / 'run'}",
                   "flavor=cpu-2")
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_wandb_records_offline_when_not_logged_in(tmp_path):
    out = tmp_path / "run"
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": str(tmp_path / "no-netrc"), "HOME": str(tmp_path)}
    r = run_recipe("logger=wandb", "max_steps=3", f"output_dir={out}", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    logged = wandb_records(runs[0])
    # Every step's metrics, as metrics.jsonl has them (W&B's step is ours; JSON keeps 2.0 as 2: compared as numbers).
    rows = metrics(out)
    assert [h["_step"] for h in logged["history"]] == [row["step"] for row in rows] == [1, 2, 3]
    for h, row in zip(logged["history"], rows):
        for key in ("loss", "lr", "tokens", "tokens_per_sec", "step_time_s", "grad_norm", "peak_memory_bytes"):
            assert h[key] == pytest.approx(row[key], rel=1e-12), (key, h, row)
    # The run's config and plan, and the end-of-run accuracy in the summary.
    assert logged["config"]["plan"]["batch_per_device"] == json.loads((out / "plan.json").read_text())["chosen"][
        "batch_per_device"]
    from omegaconf import OmegaConf

    assert logged["config"]["optimizer"]["lr"] == OmegaConf.load(out / "config.yaml").optimizer.lr
    assert logged["summary"]["predicted_peak_bytes"] > 0 and "measured_step_s" in logged["summary"]
    assert "wandb sync" in r.stdout
