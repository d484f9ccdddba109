"""Mixture-of-Experts models (Qwen3-MoE, Mixtral) against transformers, on tiny checkpoints transformers writes.

- logits, the token loss and the load-balancing loss equal transformers' (fp32, padded rows included);
- each sample's balancing loss is transformers' load_balancing_loss_func on that sample alone;
- the grouped experts equal the per-expert loop bit for bit, forward and backward, also when the routing is skewed
  (every token to one expert, the others empty);
- Hugging Face in and out: a transformers-saved checkpoint (sharded, bf16, tied) loads and saves back byte for
  byte, and transformers reads a trained model we write with our logits;
- recomputed sparse layers (full, selective) train as kept ones, their routing recorded again in the backward, and
  selective recomputation recomputes the experts' grouped products, on real and fake tensors alike;
- what cannot be built is refused by name.
Run: python -m pytest tests/test_moe.py -q
"""

import json

import pytest
import torch
import transformers

from helpers import make_hf_checkpoint, metrics, model_of, plan_of, run_recipe
from moai_recipes.errors import UserError
from moai_recipes.models.build import build_model
from moai_recipes.models.hf_format import HFFolder, save_weights
from moai_recipes.models.lora import gather_adapters, lora_options, merge_into, save_adapter
from moai_recipes.models.loss import IGNORE_INDEX, token_loss_sum
from moai_recipes.models.moe import GroupedExperts, MoE, Routing, is_nf4, local_experts, routing_recorded
from moai_recipes.models.peft_adapter import PeftAdapter, merge_adapter
from moai_recipes.models.spec import spec_from_hf_config

FAMILIES = {"qwen3_moe": dict(num_layers=3), "mixtral": dict(num_layers=2)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "hf", request.param, **FAMILIES[request.param])


def expert_lora(spec, **kw):
    return lora_options({"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": True, "apply_to_output": False,
                         "apply_to_experts": True, "rank": 4, "alpha": 8.0, "dropout": 0.0, "quantize_base": False,
                         **kw}, spec=spec)


def theirs(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def padded_batch(seed=0):
    """Three rows of 24 tokens, the last two right-padded (attention mask 0) after 17 and 9 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 300, (3, 24), generator=g)
    mask = torch.ones_like(tokens)
    mask[1, 17:], mask[2, 9:] = 0, 0
    return tokens, mask


def test_logits_and_losses_equal_transformers(checkpoint):
    model, spec = model_of(checkpoint)
    hf = theirs(checkpoint)
    tokens, mask = padded_batch()
    labels = tokens.masked_fill(mask == 0, IGNORE_INDEX)
    with torch.no_grad():
        out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
        samples = torch.where(mask == 1, 0, -1)  # the whole batch one sample: transformers' balancing loss
        with routing_recorded(model, Routing(samples, 1, spec)) as routing:
            logits = model(tokens)
        shifted = torch.cat([labels[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
        targets = int((shifted != IGNORE_INDEX).sum())
        ce = token_loss_sum(model, tokens, shifted) / targets
    kept = mask == 1
    assert (logits[kept] - out.logits[kept]).abs().max() < 1e-5
    aux = routing.balancing_losses()[0]
    assert abs(float(aux) - float(out.aux_loss)) < 1e-6, (aux, out.aux_loss)
    assert spec.router_aux_loss_coef == hf.config.router_aux_loss_coef == 0.001
    assert abs(float(ce + spec.router_aux_loss_coef * aux) - float(out.loss)) < 1e-5, (ce, aux, out.loss)
    picks = routing.picks.sum(0)  # [sparse layers, E]: every sparse layer routed every real token to two experts
    assert picks.shape == (len(spec.moe_layers), spec.num_experts) and torch.all(picks.sum(1) == 2 * kept.sum())
    assert spec.moe_layers == ((0, 2) if spec.family == "qwen3_moe" else (0, 1))  # qwen3_moe's layer 1 is dense


def test_each_samples_balancing_loss_is_transformers_on_it_alone(checkpoint):
    """The balancing loss training adds is a sample's (so a step's is the same on any flavor and micro-batching)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # seconds to import

    model, spec = model_of(checkpoint)
    hf = theirs(checkpoint)
    tokens, mask = padded_batch(seed=1)
    samples = torch.where(mask == 1, torch.arange(3)[:, None], -1)
    with torch.no_grad():
        with routing_recorded(model, Routing(samples, 3, spec)) as routing:
            model(tokens)
        per_sample = routing.balancing_losses()
        for row in range(3):
            n = int(mask[row].sum())
            gates = hf(tokens[row:row + 1, :n], output_router_logits=True).router_logits
            alone = load_balancing_loss_func(gates, spec.num_experts, spec.experts_per_token)
            assert abs(float(per_sample[row]) - float(alone)) < 1e-6, (row, per_sample[row], alone)


def _forward_backward(model, spec, tokens):
    model.zero_grad(set_to_none=True)
    samples = torch.zeros_like(tokens)
    with routing_recorded(model, Routing(samples, 1, spec)) as routing:
        logits = model(tokens)
    (logits.float().square().mean() + routing.balancing_losses().sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("adapters", [False, True])
def test_grouped_experts_equal_the_per_expert_loop_bit_for_bit(checkpoint, monkeypatch, adapters):
    spec = spec_from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    model, spec = model_of(checkpoint, expert_lora(spec) if adapters else None)
    tokens, _ = padded_batch(seed=2)
    grouped = _forward_backward(model, spec, tokens)
    monkeypatch.setattr(GroupedExperts, "implementation", "loop")
    loop = _forward_backward(model, spec, tokens)
    assert torch.equal(grouped[0], loop[0])
    assert grouped[1].keys() == loop[1].keys()
    assert any((".experts.lora_b." if adapters else ".experts.w") in k for k in grouped[1])
    different = [k for k in grouped[1] if not torch.equal(grouped[1][k], loop[1][k])]
    assert not different, different


@pytest.mark.parametrize("routing", ["one expert", "uneven"])
def test_skewed_routing_gives_the_right_outputs_and_gradients(routing):
    """Every token to expert 5 (seven experts get nothing), or a few experts of many tokens: the grouped product
    against each token computed by itself."""
    torch.manual_seed(0)
    experts = GroupedExperts(8, 16, 12)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.3)
    x = torch.randn(10, 16, requires_grad=True)
    if routing == "one expert":
        chosen = torch.full((10, 1), 5)
    else:
        chosen = torch.tensor([[0, 7]] * 6 + [[7, 2]] * 3 + [[2, 0]])
    weights = torch.rand(chosen.shape)
    out = local_experts(experts, x, chosen, weights)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in experts.parameters()]
    x_grad = x.grad.clone()
    x.grad = None
    experts.zero_grad(set_to_none=True)
    expected = torch.stack([
        sum(weights[t, j] * (torch.nn.functional.silu(x[t] @ experts.w1[e].T) * (x[t] @ experts.w3[e].T))
            @ experts.w2[e].T for j, e in enumerate(chosen[t].tolist()))
        for t in range(10)])
    expected.square().sum().backward()
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(x_grad, x.grad, atol=1e-4)
    for got, want in zip(grads, (p.grad for p in experts.parameters())):
        assert torch.allclose(got, want, atol=1e-4)
    unused = sorted(set(range(8)) - set(chosen.flatten().tolist()))
    assert all(torch.equal(g[unused], torch.zeros_like(g[unused])) for g in grads)  # nothing for an idle expert


@pytest.mark.parametrize("family,kwargs", [
    ("qwen3_moe", dict(num_layers=3, max_shard_size="60KB")),
    ("mixtral", dict(num_layers=2, dtype="bfloat16", tie=True, max_shard_size="100KB")),
])
def test_transformers_checkpoint_round_trips_byte_for_byte(tmp_path, family, kwargs):
    src = make_hf_checkpoint(tmp_path / "src", family, **kwargs)
    assert len(list(src.glob("*.safetensors"))) > 2  # sharded, with an index
    names = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.7." in n for n in names)  # per-expert tensors, as every Hub checkpoint holds them
    model, _ = model_of(src)
    save_weights(model, HFFolder.open(src), tmp_path / "out", rank=0)
    for path in sorted(src.iterdir()):
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes(), path.name


def test_transformers_reads_the_model_a_run_writes(tmp_path, checkpoint):
    """Two steps of full fine-tuning (the weights move), then transformers loads the model with our logits; every
    step's row carries the balancing loss and the experts' load, per sparse layer."""
    out = tmp_path / "run"
    r = run_recipe(f"model.checkpoint_dir={checkpoint}", "flavor=cpu", "max_steps=2", "batch_size=4",
                   "optimizer.lr=1e-3", f"output_dir={out}", "logger=stdout")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "aux_loss: " in r.stdout and "expert_load: " in r.stdout
    spec = spec_from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    for row in metrics(out):
        assert row["aux_loss"] > 0 and row["expert_load"] >= 1
        assert {f"expert_load/layer_{i}" for i in spec.moe_layers} <= row.keys()
        assert row["expert_load"] == max(row[f"expert_load/layer_{i}"] for i in spec.moe_layers)
    model, _ = model_of(out / "model")
    before, _ = model_of(checkpoint)
    assert not torch.equal(model.layers[0].mlp.experts.w2, before.layers[0].mlp.experts.w2)  # trained
    tokens, _ = padded_batch(seed=3)
    with torch.no_grad():
        assert (model(tokens) - theirs(out / "model")(tokens).logits).abs().max() < 1e-5


def test_expert_adapters_load_in_peft_with_our_logits_and_merge_into_the_base(tmp_path, checkpoint):
    """LoRA on every expert (and on attention and the dense MLP): only adapters train (the router and the experts
    frozen); the PEFT adapter we write loads in peft on transformers' model with our logits, and the merged model
    is the base plus each expert's B @ A."""
    import peft

    spec = spec_from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    opts = expert_lora(spec)
    model, _ = model_of(checkpoint, opts)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert {f"layers.{i}.mlp.experts.lora_{k}.{w}" for i in spec.moe_layers for k in "ab" for w in ("w1", "w2", "w3")} \
        <= trained
    adapters = gather_adapters(model)
    save_adapter(adapters, opts=opts, out_dir=tmp_path / "adapter", base_model=str(checkpoint))
    tokens, _ = padded_batch(seed=4)
    with torch.no_grad():
        expected = model(tokens)
        lora = peft.PeftModel.from_pretrained(theirs(checkpoint), tmp_path / "adapter").eval()
        assert (lora(tokens).logits - expected).abs().max() < 1e-5
        peft_merged = lora.merge_and_unload()(tokens).logits
    save_weights(model, HFFolder.open(checkpoint), tmp_path / "merged", rank=0,
                 transform=merge_into(adapters, opts.scale))
    merged, base = model_of(tmp_path / "merged")[0], model_of(checkpoint)[0]
    a, b = adapters["layers.0.mlp.experts.lora_a.w1"], adapters["layers.0.mlp.experts.lora_b.w1"]
    assert torch.allclose(merged.layers[0].mlp.experts.w1, base.layers[0].mlp.experts.w1 + opts.scale * (b @ a),
                          atol=1e-6)
    with torch.no_grad():  # the merged weights as peft merges them (W + dW, against x W + x B A unmerged: 2e-5 apart)
        assert (theirs(tmp_path / "merged")(tokens).logits - peft_merged).abs().max() < 1e-6
    # recipes.generate's adapter_dir= reads the PEFT adapter back and merges it alike.
    read = PeftAdapter.open(tmp_path / "adapter")
    read.check_base(HFFolder.open(checkpoint))
    merge_adapter(base, read, spec)
    for name, p in merged.named_parameters():
        assert torch.allclose(p, base.get_parameter(name), atol=1e-6), name


def test_qlora_keeps_the_experts_in_nf4_trains_alike_on_cpu_and_cpu_2_and_merges_what_it_trained(tmp_path):
    """QLoRA of a Mixture-of-Experts model: the experts frozen in NF4 (each projection's [E x out, in], torchao's NF4
    being 2-D), the same losses on one process and FSDP2 over two, and the merged model the NF4 base dequantized plus
    the adapters: peft's adapter on that base gives its logits."""
    import peft
    from torchao.dtypes.nf4tensor import to_nf4

    from helpers import FSDP, layout

    folder = make_hf_checkpoint(tmp_path / "base", "qwen3_moe", num_layers=2, hidden=128, kv_heads=4)  # whole blocks
    spec = spec_from_hf_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        built = build_model(spec, max_seq_len=64, lora=expert_lora(spec, quantize_base=True).builder_kwargs(),
                            quantize_base=True)
    assert all(is_nf4(getattr(built.layers[0].mlp.experts, w)) for w in ("w1", "w2", "w3"))
    common = [f"model.checkpoint_dir={folder}", "max_steps=3", "batch_size=4", "optimizer.lr=1e-2",
              "optimizer.warmup_steps=0", "logger=stdout", "lora.quantize_base=true", "lora.apply_to_experts=true",
              "lora.rank=4", "sample_max_new_tokens=0"]
    losses = {}
    for flavor, extra in {"cpu": (), "cpu-2": FSDP}.items():
        out = tmp_path / flavor
        r = run_recipe(*common, f"flavor={flavor}", *extra, f"output_dir={out}", module="recipes.lora_finetune")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "base frozen in NF4 (QLoRA)" in r.stdout and "every expert's projections" in r.stdout
        assert layout(out) == {"cpu": "single", "cpu-2": "sharded"}[flavor]
        losses[flavor] = metrics(out)
    for a, b in zip(losses["cpu"], losses["cpu-2"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], (a, b)

    def nf4(w: torch.Tensor) -> torch.Tensor:  # as QLoRA stores it: [E x out, in]
        return to_nf4(w.reshape(-1, w.shape[-1]).clone()).get_original_weight().view(w.shape)

    base = theirs(folder)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("experts.gate_up_proj"):  # gate (our w1) and up (w3) quantized each on its own
                half = p.shape[1] // 2
                p.copy_(torch.cat([nf4(p[:, :half]), nf4(p[:, half:])], dim=1))
            elif name.endswith(("experts.down_proj", "_proj.weight")) and ".layers." in name:
                p.copy_(nf4(p))
    tokens, _ = padded_batch(seed=5)
    with torch.no_grad():
        merged = theirs(tmp_path / "cpu-2" / "model")(tokens).logits
        on_nf4 = peft.PeftModel.from_pretrained(base, tmp_path / "cpu-2" / "adapter")(tokens).logits
    torch.testing.assert_close(on_nf4, merged, atol=1e-4, rtol=1e-4)


def test_dpo_eval_and_generate_run_on_a_mixture_of_experts_model(tmp_path, checkpoint):
    """After training, as for dense models: DPO with LoRA on every expert learns its preference (the margin of the
    same 16 pairs grows),
    recipes.eval gives the held-out loss, recipes.generate answers from the adapter merged."""
    import re

    dpo = run_recipe(f"model.checkpoint_dir={checkpoint}", "method=lora", "lora.apply_to_experts=true", "epochs=3",
                     "batch_size=16", "optimizer.lr=3e-3", "optimizer.warmup_steps=0", "logger=stdout",
                     "measure_memory=false", f"output_dir={tmp_path / 'dpo'}", module="recipes.dpo")
    assert dpo.returncode == 0, dpo.stdout + dpo.stderr
    rows = metrics(tmp_path / "dpo")
    assert abs(rows[0]["rewards/margins"]) < 1e-4 < rows[1]["rewards/margins"] < rows[2]["rewards/margins"], rows
    ev = run_recipe(f"model.checkpoint_dir={checkpoint}", "dataset=demo", "dataset.val_split=0.1", "logger=stdout",
                    f"output_dir={tmp_path / 'eval'}", module="recipes.eval")
    assert ev.returncode == 0 and re.search(r"Validation: loss [\d.]+", ev.stdout), ev.stdout + ev.stderr
    gen = run_recipe(f"adapter_dir={tmp_path / 'dpo' / 'adapter'}", f"model.checkpoint_dir={checkpoint}",
                     "prompt=What is the capital of France?", "max_new_tokens=4", module="recipes.generate")
    assert gen.returncode == 0 and "adapter" in gen.stderr and "merged" in gen.stderr, gen.stdout + gen.stderr


BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def test_selective_recomputation_recomputes_the_experts_products_on_real_and_fake_tensors_alike(checkpoint, monkeypatch):
    """Selective recomputation keeps matmuls but not the experts' grouped products (models/recompute.py: transformers'
    experts change theirs in place, which torch refuses of a kept output). Traced in bf16, where the planner's fake
    trace runs the grouped product's own shape function as a GPU's plan does, a sparse layer keeps and computes the
    same on real tensors (the CPU's grouped product) as on fake ones; recomputed, its experts run again in the
    backward (more FLOPs than unrecomputed) and it keeps less. In fp32 a matmul of the same shapes stands in on fake
    tensors (models/moe._grouped), kept as matmuls are: the planner's fp32 CPU prediction is high by the experts'
    outputs."""
    from moai_recipes.planner import activations
    from moai_recipes.planner.activations import RowForm

    spec = HFFolder.open(checkpoint).spec
    traces = {}
    for real in (True, False):
        monkeypatch.setattr(activations, "_traced_for_real", lambda *args, real=real: real)
        traces[real] = {recompute: activations._trace(spec, seq_len=32, recompute=recompute, dtype=torch.bfloat16,
                                                      lora=None, form=RowForm()) for recompute in ("none", "selective")}
    real, fake = traces[True]["selective"], traces[False]["selective"]
    assert (real.retained, real.flops) == (fake.retained, fake.flops), (real, fake)
    kept = traces[True]["none"]
    assert 0 < real.retained < kept.retained and real.flops > kept.flops, (real, kept)


def test_recomputed_sparse_layers_train_as_kept_ones_with_their_balancing_loss(tmp_path, checkpoint):
    """Full and selective recomputation of sparse layers that record their routing for the balancing loss: the rerun
    in the backward records it too, into a replica (models/moe.routing_replayed), so it runs the operators the
    forward ran, which torch.utils.checkpoint matches one by one (without it every such run stopped at its first
    backward: "a different number of tensors was saved"); the losses, norms and balancing losses are the kept
    layers'."""
    curves = {}
    for recompute in ("none", "full", "selective"):
        out = tmp_path / recompute
        r = run_recipe(f"model.checkpoint_dir={checkpoint}", "dataset=demo", "flavor=cpu", "max_steps=2", "batch_size=8",
                       "max_seq_len=64", f"plan.recompute={recompute}", "logger=stdout", "sample_max_new_tokens=0",
                       "measure_memory=false", f"output_dir={out}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert plan_of(out)["recompute"] == recompute
        curves[recompute] = metrics(out)
    assert len(curves["none"]) == 2 and all(row["aux_loss"] > 0 for row in curves["none"])
    for recompute in ("full", "selective"):
        for kept, rerun in zip(curves["none"], curves[recompute], strict=True):
            for key in ("loss", "grad_norm", "aux_loss"):
                assert abs(kept[key] - rerun[key]) <= 1e-6 * abs(kept[key]), (recompute, key, curves)


@pytest.mark.parametrize("config,named", [
    ({**BASE, "model_type": "mixtral", "router_jitter_noise": 0.01}, "router_jitter_noise"),
    ({**BASE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 64}, "not model_type 'qwen2_moe'"),
    ({**BASE, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts_per_tok": 6},
     "num_experts_per_tok=6"),
])
def test_what_our_own_layers_cannot_build_is_refused_by_name_or_built_by_transformers(config, named):
    with pytest.raises(UserError, match=named):
        spec_from_hf_config(config, implementation="native")
    assert spec_from_hf_config(config).implementation == "transformers"


def test_lora_settings_the_experts_cannot_take_are_refused_by_name(checkpoint):
    spec = spec_from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    for settings, named in [({"dropout": 0.1}, "lora.dropout=0.1"), ({"quantize_base": True}, "cannot be stored in NF4")]:
        with pytest.raises(UserError, match=named):
            expert_lora(spec, **settings)
    dense = spec_from_hf_config({**BASE, "model_type": "mistral"})
    with pytest.raises(UserError, match="has none"):
        expert_lora(dense)


def test_sparse_layers_as_qwen3_moe_places_them():
    spec = spec_from_hf_config({**BASE, "model_type": "qwen3_moe", "num_hidden_layers": 6, "moe_intermediate_size": 32,
                                "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert spec.moe_layers == (1, 5)  # (i + 1) % 2 == 0, less layer 3
    with torch.device("meta"):
        model = build_model(spec, max_seq_len=16)
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [False, True, False, False, False, True]
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    active = spec.num_params(active=True)
    assert spec.num_params() - active == 2 * (4 - 2) * 3 * 64 * 32  # two sparse layers, two experts idle a token
