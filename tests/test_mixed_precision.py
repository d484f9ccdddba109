"""One device's bf16 compute without FSDP2 (train/mixed_precision.py) computes what FSDP2's mixed precision computes:
the same losses and the same fp32 gradients, bit for bit, over micro-batches that accumulate, with a tied embedding,
and with LoRA's frozen base, stored in bf16 in both. In this process: a world of one and real FSDP2."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.lora import freeze_base
from moai_recipes.models.loss import token_loss_sum
from moai_recipes.planner.plan import Workload
from moai_recipes.planner.search import choose_plan
from moai_recipes.train.mixed_precision import compute_copies, stored_as_planned
from moai_recipes.train.parallel import shard_model
from moai_recipes.train.world import join_world
from tests.helpers import setup


BF16_COMPUTE = SimpleNamespace(param_dtype="bfloat16", master_dtype="float32")  # what stored_as_planned reads of a Plan


def _model(spec, lora):
    torch.manual_seed(0)
    model = build_model(spec, max_seq_len=64, lora=lora)
    if lora:
        freeze_base(model)
        for name, p in model.named_parameters():  # torchtune starts lora_b at zero: give it gradients to compare
            if "lora" in name:
                torch.nn.init.normal_(p, std=0.02)
    return stored_as_planned(model, BF16_COMPUTE)  # the frozen base in bf16, as the recipes store it


@pytest.mark.parametrize("tied, lora", [(True, False), (False, True)], ids=["full-tied", "lora"])
def test_bf16_copies_give_fsdp2_mixed_precision_losses_and_gradients_bit_for_bit(tied, lora):
    _, spec, flavor = setup("model=tiny", "flavor=cpu")
    spec = replace(spec, tie_word_embeddings=tied)
    adapters = {"lora_attn_modules": ["q_proj", "v_proj"], "apply_lora_to_mlp": False, "apply_lora_to_output": False,
                "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0} if lora else None
    plain, sharded = _model(spec, adapters), _model(spec, adapters)
    torch.manual_seed(1)
    micro_batches = [torch.randint(0, spec.vocab_size, (2, 24)) for _ in range(2)]
    with join_world(flavor, None) as world:
        shard_model(sharded, mesh=world.mesh["data"], param_dtype=torch.bfloat16)
        init_buffers(plain, device="cpu")
        init_buffers(sharded, device="cpu")
        masters = dict(plain.named_parameters())
        got, want = [], []
        with compute_copies(plain, torch.bfloat16):
            for tokens in micro_batches:
                assert plain.layers[0].attn.q_proj.weight.dtype == torch.bfloat16
                loss = token_loss_sum(plain, tokens, tokens)
                loss.backward()
                got.append(loss.detach())
        for tokens in micro_batches:
            loss = token_loss_sum(sharded, tokens, tokens)
            loss.backward()
            want.append(loss.detach())
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[0].dtype == torch.float32
        # The masters are registered again, fp32, each holding the two micro-batches' fp32 gradients; a frozen weight
        # was never replaced: bf16 as stored.
        assert all(p is masters[n] and p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16)
                   for n, p in plain.named_parameters())
        reference = {n: p.grad for n, p in sharded.named_parameters()}
        for name, p in plain.named_parameters():
            if not p.requires_grad:
                assert p.grad is None and reference[name] is None
                continue
            expected = reference[name].full_tensor() if isinstance(reference[name], DTensor) else reference[name]
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, expected), name
            assert p.grad.abs().sum() > 0, name
        if tied:
            assert plain.output.tied_module.weight is plain.tok_embeddings.weight
        # A trained weight's copy is made every step; a frozen one computes as it is stored (no copy at all).
        names = {p.requires_grad: n for n, p in reversed(list(plain.named_parameters()))}  # the first of each

        def copies():
            with compute_copies(plain, torch.bfloat16):
                return {n: p for n, p in plain.named_parameters()}

        first, again = copies(), copies()
        assert first[names[True]] is not again[names[True]]
        if lora:
            assert first[names[False]] is again[names[False]] is masters[names[False]]
        # A frozen copy (recipes.dpo's reference) is stored in bf16, its RoPE tables left in fp32 as FSDP2 leaves them.
        plan = choose_plan(Workload(spec=spec, batch_size=4, seq_len=64, dtype="bf16"), flavor).chosen.plan
        assert plan.casts_copies and not plan.sharded
        frozen = stored_as_planned(_model(spec, None).requires_grad_(False), plan)
        assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
        assert not any(p.requires_grad for p in frozen.parameters())
        assert {b.dtype for b in frozen.buffers()} == {torch.float32}
