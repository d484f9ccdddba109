"""The FLOP count behind MFU (planner/flops.py) against torch's FlopCounterMode on real forward and backward passes
of our models: full fine-tuning, LoRA (the frozen base's 4 FLOPs per weight, the adapters' 6), an untied and a
tied output, grouped-query attention; and the causal attention and recomputation terms by hand.
Run: python -m pytest tests/test_flops.py -q
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moai_recipes.models.build import build_model
from moai_recipes.models.loss import token_loss_sum
from moai_recipes.models.lora import lora_options
from moai_recipes.models.moe import GroupedExperts
from moai_recipes.models.spec import ModelSpec
from moai_recipes.planner.flops import ModelFlops

SPEC = ModelSpec(family="llama", vocab_size=320, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=64,
                 intermediate_dim=160, head_dim=16, max_position_embeddings=128, rope_base=10000.0, norm_eps=1e-5,
                 tie_word_embeddings=False, rope_scaling=None, attention_bias=False, torch_dtype="float32")


def _counted(spec: ModelSpec, n: int, lora=None) -> int:
    """FlopCounterMode's FLOPs of one forward and backward of one sequence of n tokens."""
    torch.manual_seed(0)
    model = build_model(spec, max_seq_len=128, lora=lora.builder_kwargs() if lora else None)
    for p in model.parameters():  # a Mixture-of-Experts router must route: weights, not uninitialised memory
        torch.nn.init.normal_(p, std=0.05)
    if lora:
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    tokens = torch.randint(0, spec.vocab_size, (1, n))
    # The math kernel: attention as matmuls the counter sees (the CPU's flash kernel is not among its formulas).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        token_loss_sum(model, tokens, tokens).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tie", [False, True])
def test_full_fine_tuning_counts_what_torch_counts(tie):
    spec = dataclasses.replace(SPEC, tie_word_embeddings=tie)
    n = 37
    flops = ModelFlops.of(spec)
    # FlopCounterMode counts the whole square of attention scores (it ignores is_causal): ours counts the n(n+1)/2
    # pairs a causal document attends; the squares compare.
    assert _counted(spec, n) == flops.per_token * n + flops.per_pair * n * n
    assert flops.step([n]).model == flops.per_token * n + flops.per_pair * n * (n + 1) // 2
    # By hand, for this model: 6 FLOPs per weight per token, weights of 3 layers and the output projection.
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160
    assert flops.per_token == 6 * (3 * layer + 320 * 64) and flops.per_pair == 12 * 3 * 64


@pytest.mark.parametrize("experts", [False, True])
def test_a_mixture_of_experts_counts_the_experts_each_token_uses(monkeypatch, experts):
    """MFU's work is the router and the top-k experts a token is sent to (counted with each expert computed by
    itself: FlopCounterMode has no formula for the grouped product), trained or adapted (lora.apply_to_experts)."""
    monkeypatch.setattr(GroupedExperts, "implementation", "loop")
    spec = dataclasses.replace(SPEC, family="mixtral", num_experts=4, experts_per_token=2, expert_dim=48,
                               norm_topk_prob=True, moe_layers=(0, 2))  # layer 1 dense
    lora = lora_options({"attn_modules": ["q_proj"], "apply_to_mlp": True, "apply_to_output": False, "rank": 4,
                         "alpha": 8, "dropout": 0.0, "quantize_base": False, "apply_to_experts": experts},
                        spec=spec) if experts else None
    n = 37
    flops = ModelFlops.of(spec, lora)
    assert _counted(spec, n, lora) == flops.per_token * n + flops.per_pair * n * n
    if not experts:  # by hand: 6 per weight a token computes with, the router's and two of the four experts'
        attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
        sparse = 64 * 4 + 2 * 3 * 64 * 48
        assert flops.per_token == 6 * (3 * attention + 2 * sparse + 3 * 64 * 160 + 320 * 64)


@pytest.mark.parametrize("modules,mlp,output", [(["q_proj", "v_proj"], False, False), (["output_proj"], False, False),
                                                ([], True, False), ([], False, True),
                                                (["q_proj", "k_proj", "v_proj", "output_proj"], True, True)])
def test_lora_counts_the_frozen_base_and_the_adapters_as_torch_counts(modules, mlp, output):
    lora = lora_options({"attn_modules": modules, "apply_to_mlp": mlp, "apply_to_output": output, "rank": 4,
                         "alpha": 8.0, "dropout": 0.0, "quantize_base": False}, spec=SPEC)
    n = 29
    flops = ModelFlops.of(SPEC, lora)
    assert _counted(SPEC, n, lora) == flops.per_token * n + flops.per_pair * n * n
    assert flops.per_token < ModelFlops.of(SPEC).per_token  # no weight gradients for the base


def test_recomputation_is_hardware_flops_only():
    flops = ModelFlops.of(SPEC)
    plain = flops.step([10, 20])
    full = flops.step([10, 20], recompute="full")
    assert full.model == plain.model == plain.hardware
    pairs = 10 * 11 // 2 + 20 * 21 // 2
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 160
    assert full.hardware - full.model == 30 * 2 * 3 * layer + 4 * 3 * 64 * pairs
    assert flops.step([10, 20], recompute="selective").hardware == plain.model
    assert plain.utilisation(seconds=2.0, peak_flops=plain.model / 4, devices=2) == pytest.approx((1.0, 1.0))
    mfu, hfu = full.utilisation(seconds=2.0, peak_flops=full.model / 4, devices=2)
    assert mfu == pytest.approx(1.0) and hfu == pytest.approx(full.hardware / full.model)


def test_llama3_8b_by_hand():
    """Llama 3 8B: 6 FLOPs per matmul weight per token (7.50B of them: the layers and the untied output, not the
    embedding), and 12 x 32 layers x 4096 per attended pair; a 4096-token document's attention is 7.2% more."""
    spec = dataclasses.replace(SPEC, vocab_size=128256, num_layers=32, num_heads=32, num_kv_heads=8, embed_dim=4096,
                               intermediate_dim=14336, head_dim=128)
    weights = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
    assert weights == 7_504_658_432
    flops = ModelFlops.of(spec)
    assert flops.per_token == 6 * weights and flops.per_pair == 12 * 32 * 4096
    step = flops.step([4096])
    attention = 12 * 32 * 4096 * (4096 * 4097 // 2)
    assert step.model == 6 * weights * 4096 + attention
    assert 1.071 < step.model / (6 * weights * 4096) < 1.072


def test_every_step_carries_its_flops_and_mfu_and_a_profiled_step_its_trace(tmp_path):
    from moai_recipes.models.spec import read_spec
    from moai_recipes.models.tiny import tiny_checkpoint_dir
    from moai_recipes.planner.cpu_speed import cpu_speed, process_threads
    from tests.helpers import metrics, run_recipe

    out = tmp_path / "run"
    r = run_recipe("max_steps=3", "batch_size=4", "max_seq_len=64", "logger=stdout", f"output_dir={out}",
                   "profile_steps=[3]")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("| MFU: ") == 3
    flops = ModelFlops.of(read_spec(tiny_checkpoint_dir()))
    peak = cpu_speed(process_threads(1)).fp32_flops
    for row in metrics(out):
        # Between the matmuls alone and the matmuls with every document as long as the longest allowed.
        assert flops.per_token < row["flops_per_token"] < flops.per_token + flops.per_pair * 65 / 2
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens"] / (row["step_time_s"] * peak))
        assert row["hfu"] == row["mfu"]  # no recomputation on this plan
    # profile_steps=[3]: torch.profiler's trace and op table of that step alone, the step marked as slower.
    assert [row.get("profiled", False) for row in metrics(out)] == [False, False, True]
    assert "[Step 3/3]" in r.stdout and "| profiled: a slower step" in r.stdout.split("[Step 3/3]")[1].splitlines()[0]
    assert "Profile of step 3" in r.stdout and "aten::mm" in r.stdout.split("Profile of step 3")[1]
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["step3-rank0.json", "step3-rank0.txt"]
    events = json.loads((out / "profile" / "step3-rank0.json").read_text())["traceEvents"]
    # The step's backward and optimizer are in it, and nothing of the steps before it (a fresh profiler).
    names = {e.get("name") for e in events}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, sorted(names)[:50]
    assert sum(e.get("name") == "Optimizer.step#AdamW.step" for e in events) == 1


def test_a_cpu_measured_while_busy_is_said_so_and_measured_again_later(tmp_path, monkeypatch, capsys):
    """The CPU's peak is measured once and cached; one measured while other processes kept its cores busy would show
    MFUs over 100% for good. Measured under load (a process spinning beside it), it is marked not quiet and the
    user told; such an entry is measured again once it is old, each rate the better of the two; a quiet one never."""
    from moai_recipes.planner.cpu_speed import MEASURE_BUSY_AGAIN_S, cpu_speed, speed_key

    monkeypatch.setenv("MOAI_CACHE", str(tmp_path))
    cores, path = os.cpu_count(), tmp_path / "cpu-speed.json"
    # One spinning process is enough: measured on every core, a measurement is quiet only where the others used
    # less than 0.15 of a core meanwhile (planner/cpu_speed.py); one per core burned a core-second each for nothing.
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        busy = cpu_speed(cores)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert not busy.quiet
    assert "while other processes kept its cores busy" in capsys.readouterr().err
    assert cpu_speed(cores) == busy  # measured a moment ago: kept

    def cached_as(**entry) -> None:
        known = json.loads(path.read_text())
        known[speed_key(cores)] |= entry
        path.write_text(json.dumps(known))

    # Old: measured again, each rate the better of the two readings, not the newest. The cached fp32 rate is faster
    # than any CPU (kept), the others slower than any (replaced by the new reading).
    cached_as(fp32_flops=1e18, bytes_per_s=1.0, bf16_flops=1.0, measured_at=time.time() - MEASURE_BUSY_AGAIN_S - 1)
    again = cpu_speed(cores)
    assert again.fp32_flops == 1e18
    # Measured again: not the cached 1.0 (a CPU that emulates bf16, AVX2 only, measures about 0.9e9: no more is assumed).
    assert 1e7 < again.bf16_flops < 1e18 and again.bytes_per_s > 1e8
    assert again.measured_at > time.time() - 60
    # Quiet, however old: never measured again.
    cached_as(fp32_flops=1.0, quiet=True, measured_at=0.0)
    assert cpu_speed(cores).fp32_flops == 1.0
