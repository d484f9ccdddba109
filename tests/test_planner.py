"""The planner: traced activations, plans that fit, forced fields, the dry run, and the promise that a
small budget trains the same loss curve without running out of memory. Run: pytest tests/test_planner.py"""

import json
from dataclasses import replace

import pytest

from moai_recipes.errors import UserError
from moai_recipes.models.lora import lora_options
from moai_recipes.planner.activations import RowForm, trace_layer
from moai_recipes.planner.plan import Workload
from moai_recipes.planner.search import GiB, choose_plan
from tests.helpers import metrics, peak_error, run_recipe, setup


def test_recompute_keeps_less_and_activations_grow_with_the_sequence():
    import torch

    _, spec, _ = setup("model=qwen2_5_0_5b")
    kept = {p: trace_layer(spec, seq_len=1024, recompute=p, dtype=torch.bfloat16).retained for p in ("none", "selective", "full")}
    assert kept["none"] > kept["selective"] > kept["full"] > 0
    assert kept["full"] == 1024 * spec.embed_dim * 2  # full recompute keeps the layer's input (bf16) only
    longer = trace_layer(spec, seq_len=2048, recompute="none", dtype=torch.bfloat16).retained
    assert longer == pytest.approx(2 * kept["none"], rel=0.01)  # SDPA keeps O(seq), not O(seq^2)


def test_a_small_layer_traced_on_real_tensors_counts_what_its_fake_trace_counts(monkeypatch):
    """Small dense layers of our own are traced on real tensors (planner/activations.py, REAL_TRACE_FLOPS): every field
    of the trace equals the fake one's, for each recomputation, row form, dtype and kind of adapters, on Llama and on
    Qwen3 (per-head q/k norms, a head_dim that is not hidden / heads)."""
    import itertools

    import torch

    from moai_recipes.models.spec import spec_from_hf_config
    from moai_recipes.planner import activations

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    specs = [spec_from_hf_config(dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=5e5,
                                      **common)),
             spec_from_hf_config(dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1e6,
                                      head_dim=32, **common))]
    everywhere = (("apply_lora_to_experts", False), ("apply_lora_to_mlp", True), ("apply_lora_to_output", True),
                  ("lora_alpha", 16), ("lora_attn_modules", ("q_proj", "k_proj", "v_proj", "output_proj")),
                  ("lora_dropout", 0.0), ("lora_rank", 8))  # as Workload.lora_key gives it
    loras = [None, everywhere]
    forms = [RowForm(), RowForm(per_document=True), RowForm(tiles=8)]
    cases = [(specs[i % 2], recompute, form, (torch.float32, torch.bfloat16)[i % 2], loras[i // 2 % 2],
              24 + 8 * (i % 3)) for i, (recompute, form) in enumerate(itertools.product(("none", "selective", "full"),
                                                                                      forms))]
    for spec, recompute, form, dtype, lora, seq_len in cases:
        assert activations._traced_for_real(spec, seq_len, dtype)
        real = activations._trace(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora, form=form)
        with monkeypatch.context() as m:
            m.setattr(activations, "REAL_TRACE_FLOPS", {})
            assert not activations._traced_for_real(spec, seq_len, dtype)
            fake = activations._trace(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora, form=form)
        assert real == fake, (spec.family, recompute, form, dtype, lora is not None, seq_len)
        assert real.ops > 0 and real.flops > 0 and (real.retained > 0 or recompute == "full")


def test_a_small_head_traced_on_real_tensors_counts_what_its_fake_trace_counts(monkeypatch):
    """A small head (final norm, output projection, loss) is traced on real tensors too (the same budget): its peak,
    FLOPs, traffic and operators equal its fake trace's, plain and chunked, tied and with LoRA on its output."""
    import torch

    from moai_recipes.models.lora import LoraOptions
    from moai_recipes.models.spec import spec_from_hf_config
    from moai_recipes.planner import activations

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    llama = spec_from_hf_config(dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=5e5, **common))
    tied = spec_from_hf_config(dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1e6, head_dim=32,
                                    tie_word_embeddings=True, **common))
    output = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(LoraOptions(
        ("q_proj", "v_proj"), True, True, 4, 8.0, 0.0, False).builder_kwargs().items()))
    budget = activations.REAL_TRACE_FLOPS
    for spec, rows, seq_len, chunked, dtype, lora in [(llama, 2, 64, False, torch.float32, None),
                                                      (llama, 3, 128, True, torch.float32, output),
                                                      (tied, 1, 40, True, torch.bfloat16, None),
                                                      (tied, 2, 128, False, torch.float32, None)]:
        traces = []
        for real in (budget, {}):
            monkeypatch.setattr(activations, "REAL_TRACE_FLOPS", real)
            traces.append(activations._trace_head(spec, micro_batch_size=rows, seq_len=seq_len, chunked=chunked,
                                                  dtype=dtype, lora=lora))
        assert traces[0] == traces[1], (spec.family, rows, seq_len, chunked, dtype)
        assert traces[0].flops > 0 and traces[0].ops > 0 and traces[0].peak > 0
        assert 6 * rows * seq_len * spec.vocab_size * spec.embed_dim <= budget[dtype]  # the real path taken


@pytest.mark.parametrize("recompute,tiles", [("none", 0), ("selective", 0), ("full", 0), ("full", 8)])
def test_the_traced_layer_keeps_what_a_real_layer_keeps(recompute, tiles):
    """The fake-tensor trace against a real layer, run forward and backward under PyTorch's MemTracker (its MLP
    whole, or in tiles)."""
    import dataclasses

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.models.recompute import apply_recompute
    from moai_recipes.models.tiled_mlp import apply_tiled_mlp

    _, spec, _ = setup("model=qwen2_5_0_5b")
    spec = dataclasses.replace(spec, num_layers=1, embed_dim=256, num_heads=4, num_kv_heads=2, head_dim=64,
                               intermediate_dim=704, vocab_size=512)
    seq = 256
    traced = trace_layer(spec, seq_len=seq, recompute=recompute, dtype=torch.float32, form=RowForm(tiles=tiles))
    model = build_model(spec, max_seq_len=seq)
    init_buffers(model, device="cpu")
    apply_tiled_mlp(model.layers, tiles)
    apply_recompute(model.layers, recompute)
    layer, x = model.layers[0], torch.randn(1, seq, spec.embed_dim, requires_grad=True)
    grad_out = torch.randn_like(x)
    tracker = MemTracker()
    tracker.track_external(layer, x, grad_out)
    total = lambda kind: sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot(kind).values())
    with tracker:
        before = total("current")
        y = layer(x)
        after_forward = total("current")
        y.backward(grad_out)
    assert after_forward - before == traced.retained
    real_backward = total("peak") - after_forward
    assert real_backward == pytest.approx(traced.transient + traced.grads_at_peak, rel=0.05)
    if tiles:  # what tiling is for: the MLP's intermediate a tile at a time
        assert traced.transient < 0.9 * trace_layer(spec, seq_len=seq, recompute=recompute, dtype=torch.float32).transient


def test_every_chosen_plan_fits_and_is_the_fastest_that_does():
    cfg, spec, flavor = setup("model=llama3_8b", "flavor=4xlarge")
    choice = choose_plan(Workload(spec=spec, batch_size=256, seq_len=2048), flavor)
    fitting = [c for c in choice.candidates if c.fits]
    assert choice.chosen in fitting and len(choice.candidates) > len(fitting) > 0
    assert choice.chosen.time.total_s == min(c.time.total_s for c in fitting)
    assert choice.chosen.memory.total <= choice.budget_bytes < 64 * GiB
    assert choice.chosen.plan.param_dtype == "bfloat16" and choice.chosen.plan.num_devices == 32
    # Ranks are balanced by their documents' work: at 8B a document's attention costs as many FLOPs as the rest
    # of its work at 26,624 tokens (6 x 218M weights a layer over 12 x 4096 query dimensions).
    assert choice.chosen.plan.attention_length == spec.attention_length == 26624


def test_replicas_where_memory_allows_and_fsdp2_where_it_does_not():
    # Two CPU processes of a small model: a whole copy each and one all-reduce a step beats FSDP2's per-layer
    # collectives. Each replica holds all the state, FSDP2 half of it.
    _, spec, cpu2 = setup("model=tiny", "flavor=cpu-2")
    work = Workload(spec=spec, batch_size=8, seq_len=128)
    choice = choose_plan(work, cpu2)
    roomy = choice.chosen
    assert roomy.plan.replicate and not roomy.plan.sharded and "replicated" in roomy.plan.describe()
    fsdp = choose_plan(work, cpu2, forced={"replicate": False, "micro_batch_size": roomy.plan.micro_batch_size,
                                           "packing": roomy.plan.packing, "recompute": roomy.plan.recompute,
                                           "chunked_loss": roomy.plan.chunked_loss}).chosen
    rope = 2 * roomy.plan.row_length * spec.head_dim * 4  # RoPE's tables: whole on every process either way
    assert roomy.plan.row_length == fsdp.plan.row_length
    assert roomy.memory.params - rope == 2 * (fsdp.memory.params - rope)
    assert roomy.memory.optimizer == 2 * fsdp.memory.optimizer
    assert roomy.time.total_s < fsdp.time.total_s
    smallest = lambda replicate: min(c.memory.total for c in choice.candidates if c.plan.replicate == replicate)
    assert smallest(False) < smallest(True)
    tight = (smallest(False) + smallest(True)) / 2 / 0.9 / 2**30  # no replica fits, some FSDP2 plan does
    _, _, small = setup("model=tiny", "flavor=cpu-2", f"flavor.device_memory_gb={tight}")
    assert not choose_plan(work, small).chosen.plan.replicate


def test_fsdp2_wraps_the_model_only_where_it_does_something():
    # One fp32 process: nothing to shard or cast, so a plain module; nothing gathered beyond the output's gradient.
    _, spec, cpu = setup("flavor=cpu")
    one = choose_plan(Workload(spec=spec, batch_size=8, seq_len=128), cpu)
    assert not one.chosen.plan.sharded and "distribute_param false" in one.chosen.plan.describe()
    _, _, cpu2 = setup("flavor=cpu-2")
    two = choose_plan(Workload(spec=spec, batch_size=16, seq_len=128), cpu2,
                      forced={"micro_batch_size": one.chosen.plan.micro_batch_size, "recompute": one.chosen.plan.recompute,
                              "chunked_loss": one.chosen.plan.chunked_loss, "reshard_after_forward": True,
                              "replicate": False})
    assert two.chosen.plan.sharded and two.chosen.memory.gathered > one.chosen.memory.gathered
    # One GPU computes in bf16 from fp32 master weights: a plain module on bf16 copies of them (train/mixed_precision),
    # which the planner holds whole for the step; where they do not fit, FSDP2 casting layer by layer (resharded
    # after the forward), and offloading where even that does not fit.
    _, spec1, gpu = setup("model=qwen2_5_0_5b", "flavor=small", "flavor.device=h100", "flavor.memory_gb=80")
    assert gpu.num_devices == 1
    plain = choose_plan(Workload(spec=spec1, batch_size=4, seq_len=512), gpu).chosen
    assert not plain.plan.sharded and plain.plan.casts_copies and "bfloat16 copies" in plain.plan.describe()
    assert plain.memory.gathered >= spec1.num_params() * 2
    _, spec8, _ = setup("model=llama3_8b")
    offloaded = choose_plan(Workload(spec=spec8, batch_size=4, seq_len=512), gpu).chosen.plan
    assert offloaded.cpu_offload and offloaded.sharded and not offloaded.casts_copies
    cfg, _, _ = setup("model=llama3_8b", recipe="lora_finetune")
    lora = lora_options(cfg.lora, spec=spec8, world_size=1)
    work = Workload(spec=spec8, batch_size=8, seq_len=1024, lora=lora)
    choice = choose_plan(work, gpu)
    # LoRA of Llama-3-8B: its frozen base stored in bf16 (no fp32 master of it, no copy), only the adapters cast to
    # bf16 copies: a plain module fits where fp32 masters and a whole bf16 copy of the base did not (FSDP2 casting
    # layer by layer was chosen then).
    plain8 = choice.chosen
    assert not plain8.plan.sharded and plain8.plan.casts_copies and not plain8.plan.cpu_offload
    assert plain8.memory.gathered == int(work.sizes.trainable * 2)  # the adapters' copies, no copy of the base


def test_forced_fields_are_honoured_or_refused_with_the_predicted_memory():
    _, spec, flavor = setup("model=llama3_8b", "flavor=xlarge")
    forced = choose_plan(Workload(spec=spec, batch_size=64, seq_len=2048), flavor,
                         forced={"micro_batch_size": 1, "recompute": "full"})
    assert forced.chosen.plan.micro_batch_size == 1 and forced.chosen.plan.recompute == "full"
    with pytest.raises(UserError, match=r"nothing fits .* plan.micro_batch_size=8.* needs [0-9.]+ GiB"):
        choose_plan(Workload(spec=spec, batch_size=64, seq_len=8192), flavor,
                    forced={"micro_batch_size": 8, "recompute": "none"})


def test_lora_plans_fit_where_full_fine_tuning_does_not():
    _, spec, flavor = setup("model=llama3_8b", "flavor=small")
    with pytest.raises(UserError):
        choose_plan(Workload(spec=spec, batch_size=16, seq_len=2048), flavor, forced={"cpu_offload": False})
    lora = _lora(spec, attn_modules=["q_proj", "v_proj"], apply_to_mlp=False)
    choice = choose_plan(Workload(spec=spec, batch_size=16, seq_len=2048, lora=lora), flavor,
                         forced={"cpu_offload": False})
    # only the adapters have gradients and AdamW moments: 32 layers x rank 8 x (q 4096+4096, v 4096+1024)
    adapters = 32 * 8 * ((4096 + 4096) + (4096 + 1024))
    assert choice.chosen.memory.optimizer == adapters * 8 and choice.chosen.memory.grads == adapters * 4
    # The frozen base is stored in the bf16 it computes in (train/mixed_precision.py), sharded: no fp32 master of it,
    # the adapters' fp32 masters; and RoPE's one table.
    plan, memory = choice.chosen.plan, choice.chosen.memory
    assert (plan.param_dtype, plan.master_dtype, plan.cpu_offload) == ("bfloat16", "float32", False)
    base = spec.num_params() - adapters
    rope = 2 * plan.row_length * spec.head_dim * 4
    assert abs(memory.params - ((adapters * 4 + base * 2) / plan.shards + rope)) <= 1


@pytest.mark.parametrize("model", ["tiny", "qwen2_5_0_5b", "qwen3_30b_a3b"])
@pytest.mark.parametrize("targets", [dict(attn_modules=["q_proj", "v_proj"], apply_to_mlp=False),
                                     dict(attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_to_mlp=True),
                                     dict(attn_modules=["q_proj"], apply_to_mlp=False, apply_to_experts=True)])
def test_the_planner_counts_exactly_the_adapters_torchtune_builds(model, targets):
    import torch

    from moai_recipes.models.build import build_model
    from moai_recipes.models.lora import is_adapter
    from moai_recipes.planner.memory import lora_params

    _, spec, _ = setup(f"model={model}")
    if targets.get("apply_to_experts") and not spec.is_moe:
        with pytest.raises(UserError, match="has none"):
            _lora(spec, **targets)
        return
    lora = _lora(spec, **targets)
    with torch.device("meta"):
        built = build_model(spec, max_seq_len=64, lora=lora.builder_kwargs())
    assert lora_params(spec, lora) == sum(p.numel() for n, p in built.named_parameters() if is_adapter(n))


def _lora(spec, *, attn_modules, apply_to_mlp, apply_to_experts=False):
    from moai_recipes.models.lora import lora_options

    return lora_options(dict(attn_modules=attn_modules, apply_to_mlp=apply_to_mlp, apply_to_output=False, rank=8,
                             alpha=16, dropout=0.0, quantize_base=False, apply_to_experts=apply_to_experts), spec=spec)


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "mixtral_8x7b"])
def test_a_traced_sparse_layer_computes_the_flops_of_its_top_k_experts(model):
    """The planner's trace of a Mixture-of-Experts layer (on fake tensors, in the GPUs' bf16 and the CPU's fp32)
    counts the router's and the top-k experts' FLOPs that MFU counts (planner/flops.py), no more, no less."""
    import torch

    from moai_recipes.planner.flops import ModelFlops

    _, spec, _ = setup(f"model={model}")
    per_layer = (ModelFlops.of(spec).per_token - 6 * spec.vocab_size * spec.embed_dim) / spec.num_layers
    for dtype in (torch.bfloat16, torch.float32):
        traced = trace_layer(spec, seq_len=512, recompute="none", dtype=dtype)
        assert (traced.flops - traced.attention_flops) / 512 == per_layer, dtype


def test_the_planner_splits_experts_where_that_is_faster_and_refuses_a_degree_that_cannot():
    """Qwen3-30B-A3B on one node of 8 H100s: the experts split over the devices beat FSDP2 gathering all 128 of each
    layer for every micro-batch; a layer gathers 1 / EP of its experts. A degree that cannot split them is refused
    by name, as is any on a dense model."""
    _, spec, flavor = setup("model=qwen3_30b_a3b", "flavor=small", "flavor.device=h100", "flavor.memory_gb=640")
    work = Workload(spec=spec, batch_size=64, seq_len=4096)
    choice = choose_plan(work, flavor)
    fsdp = choose_plan(work, flavor, forced={"expert_parallel": 1})
    chosen = choice.chosen.plan
    assert chosen.expert_parallel > 1 and chosen.data_parallel == 8 and "EP" in chosen.layout()
    assert fsdp.chosen.time.total_s > 1.2 * choice.chosen.time.total_s
    same = replace(fsdp.chosen.plan, expert_parallel=chosen.expert_parallel)
    from moai_recipes.planner.memory import predict_memory
    split, whole = predict_memory(same, work, "gpu"), predict_memory(fsdp.chosen.plan, work, "gpu")
    assert split.gathered < whole.gathered and split.params == whole.params  # the same shards, fewer gathered
    with pytest.raises(UserError, match="128 experts .* do not divide by 3|do not divide by 3"):
        choose_plan(work, flavor, forced={"expert_parallel": 3})
    _, dense, _ = setup("model=llama3_8b")
    with pytest.raises(UserError, match="has no experts"):
        choose_plan(Workload(spec=dense, batch_size=64, seq_len=4096), flavor, forced={"expert_parallel": 2})


@pytest.mark.slow
def test_the_dry_run_plans_70b_on_any_flavor_and_says_when_nothing_fits(tmp_path):
    run = lambda *a: run_recipe(*a, module="recipes.plan")
    ok = run("flavor=48xlarge", "model=llama3_70b", "batch_size=512", "max_seq_len=4096", f"output_dir={tmp_path}")
    assert ok.returncode == 0, ok.stderr
    assert "The number of candidates is" in ok.stdout and "<- chosen" in ok.stdout and "384 device(s)" in ok.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["chosen"]["fits"] and len(plan["candidates"]) == 200 < plan["candidates_considered"]
    chosen, *listed = plan["candidates"]  # the chosen one, then those that fit, fastest first
    assert chosen == plan["chosen"] and all(c["fits"] for c in listed)
    assert [c["predicted_step_s"] for c in listed] == sorted(c["predicted_step_s"] for c in listed)
    assert "more, slower or further from fitting" in ok.stdout
    bad = run("flavor=small", "model=llama3_70b", "batch_size=64", "max_seq_len=8192", "plan.cpu_offload=false")
    assert bad.returncode == 2 and "nothing fits Small.64GB" in bad.stderr and "Traceback" not in bad.stderr
    assert "smallest flavor that fits is" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_a_small_budget_trains_the_same_curve_with_accumulation(tmp_path):
    common = ["logger=stdout", "max_steps=4", "batch_size=16", "optimizer.lr=3e-3", "sample_max_new_tokens=0"]
    big = run_recipe(*common, f"output_dir={tmp_path / 'big'}")
    small = run_recipe(*common, "flavor.device_memory_gb=0.06", f"output_dir={tmp_path / 'small'}")
    assert big.returncode == 0 and small.returncode == 0, small.stdout + small.stderr
    chosen = json.loads((tmp_path / "small" / "plan.json").read_text())["chosen"]
    assert chosen["accumulation_steps"] > 1 or chosen["recompute"] != "none"
    assert chosen["predicted_peak_bytes"] <= 0.06 * GiB
    assert abs(peak_error(small.stdout)) <= 0.10
    for a, b in zip(metrics(tmp_path / "big"), metrics(tmp_path / "small"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"]
    # On the CPU the second step's tensors are followed (train/peak_memory.py): none before, its peak from then on.
    assert [row["peak_memory_bytes"] > 0 for row in metrics(tmp_path / "small")] == [False, True, True, True]


@pytest.mark.parametrize("chunked", [False, True])
def test_the_head_of_a_large_micro_batch_is_extrapolated_exactly(chunked):
    """Large micro-batches are extrapolated from two traced ones (a chunked trace of 64 x 8K tokens would
    run 512 chunks): the result must be what tracing them would give."""
    import torch

    from moai_recipes.planner.activations import _trace_head, trace_head

    _, spec, _ = setup("model=qwen2_5_0_5b")
    for m in (5, 12, 19):  # at 256 tokens a sequence: 19 sequences run 4.75 chunks
        got = trace_head(spec, micro_batch_size=m, seq_len=256, chunked=chunked, dtype=torch.bfloat16)
        want = _trace_head(spec, micro_batch_size=m, seq_len=256, chunked=chunked, dtype=torch.bfloat16, lora=None)
        # A partial last chunk moves more memory per token: it adds its share to the weight's whole gradient.
        rel = 0.02 if chunked else 0
        assert got.flops == want.flops
        assert got.peak == pytest.approx(want.peak, rel=rel) and got.traffic == pytest.approx(want.traffic, rel=rel)


def test_a_long_row_is_extrapolated_and_an_absurd_one_refused_not_traced_for_minutes():
    """A chunked head over one row of more than LONG_ROW tokens is extrapolated from rows of LONG_ROW tokens and of
    one chunk more (the same as tracing it, within a partial chunk); max_seq_len=10000000 (a typo's extra zeros) once traced 9,766
    chunks for minutes: now the planner answers, here that nothing fits, naming max_seq_len."""
    import torch

    from moai_recipes.planner.activations import LONG_ROW, _trace_head, trace_head

    _, spec, _ = setup()
    for tokens in (2 * LONG_ROW, 2 * LONG_ROW + 300):
        got = trace_head(spec, micro_batch_size=1, seq_len=tokens, chunked=True, dtype=torch.float32)
        want = _trace_head(spec, micro_batch_size=1, seq_len=tokens, chunked=True, dtype=torch.float32, lora=None)
        assert got.flops == pytest.approx(want.flops, rel=0.01) and got.peak == pytest.approx(want.peak, rel=0.01)
    r = run_recipe("max_seq_len=10000000", module="recipes.plan")
    assert r.returncode == 2 and "Try a shorter max_seq_len (now 10000000)" in r.stderr, r.stderr[-1000:]


def test_layers_are_compiled_where_the_run_pays_for_the_compile_time():
    _, spec, gpu = setup("model=llama3_8b", "flavor=xlarge")
    long_run = choose_plan(Workload(spec=spec, batch_size=64, seq_len=2048, steps=1000), gpu).chosen
    assert long_run.plan.compile and "compiled layers" in long_run.plan.describe()
    eager = choose_plan(Workload(spec=spec, batch_size=64, seq_len=2048, steps=1000), gpu,
                        forced={**{k: getattr(long_run.plan, k) for k in ("micro_batch_size", "packing", "recompute",
                                                                          "reshard_after_forward", "cpu_offload",
                                                                          "chunked_loss")}, "compile": False}).chosen
    saved = eager.time.total_s - long_run.time.total_s
    assert 0 < saved and saved * 1000 > long_run.time.once_s > 0
    # A run too short to win back the compile time stays eager; so does every fp32 CPU run (compiling gains nothing
    # there, timing.COMPILED), unless forced. In bf16 the CPU gains from fusion too: a long run compiles.
    short = choose_plan(Workload(spec=spec, batch_size=64, seq_len=2048, steps=2), gpu).chosen
    assert not short.plan.compile and short.time.once_s == 0
    _, tiny, cpu = setup("flavor=cpu")
    assert not choose_plan(Workload(spec=tiny, batch_size=8, seq_len=128, steps=10**6), cpu).chosen.plan.compile
    assert choose_plan(Workload(spec=tiny, batch_size=8, seq_len=128), cpu, forced={"compile": True}).chosen.plan.compile
    _, smol, _ = setup("model=smollm2_135m")
    bf16 = [choose_plan(Workload(spec=smol, batch_size=8, seq_len=512, dtype="bf16", steps=n), cpu).chosen
            for n in (10**4, 2)]
    assert bf16[0].plan.compile and bf16[0].time.once_s > 0 and not bf16[1].plan.compile


def test_qlora_is_never_compiled():
    cfg, spec, gpu = setup("model=llama3_8b", "flavor=xlarge", "lora.quantize_base=true", recipe="lora_finetune")
    qlora = lora_options(cfg.lora, spec=spec, world_size=gpu.num_devices)
    work = Workload(spec=spec, batch_size=64, seq_len=2048, lora=qlora, steps=1000)
    assert not choose_plan(work, gpu).chosen.plan.compile
    with pytest.raises(UserError, match="plan.compile=true: QLoRA's NF4 base weights cannot be compiled"):
        choose_plan(work, gpu, forced={"compile": True})


def test_host_memory_is_planned_and_a_70b_full_run_on_one_device_is_refused_naming_it():
    # Offloaded, 70B parameters keep fp32 weights, gradients and AdamW's moments on the host: about 1.1 TB,
    # twice what a node of MI250s has. Nothing fits; the message says so and names what would.
    _, spec, small = setup("model=llama3_70b", "flavor=small")
    work = Workload(spec=spec, batch_size=64, seq_len=4096)
    with pytest.raises(UserError, match=r"need at least 1,0\d\d GiB of host memory per node .*offloaded weights.* a node "
                                        r"of mi250 has 512 GiB.*flavor=3xlarge.*LoRA fits"):
        choose_plan(work, small)
    # Where it fits, every GPU candidate carries its host bytes, and the chosen plan's are within the node's.
    _, _, big = setup("model=llama3_70b", "flavor=48xlarge")
    choice = choose_plan(work, big)
    c = choice.chosen
    assert c.host is not None and c.host.total <= big.host_memory_gb * GiB * 0.9
    assert c.as_dict()["predicted_host_bytes_per_node"] == c.host.total
    offloaded = [x for x in choice.candidates if x.plan.cpu_offload]
    assert offloaded and all(x.host.offloaded > 0 for x in offloaded)
    # The CPU's device memory is the host's: no separate host plan there.
    _, tiny, cpu = setup("flavor=cpu")
    assert choose_plan(Workload(spec=tiny, batch_size=8, seq_len=128), cpu).chosen.host is None


def test_a_run_predicted_to_take_more_than_a_day_says_so_first():
    _, spec, flavor = setup("model=llama3_70b", "flavor=3xlarge")
    long = choose_plan(Workload(spec=spec, batch_size=512, seq_len=4096, steps=10_000), flavor).report()
    assert long[0].startswith("Warning: the plan predicts") and "days for the run's 10,000 steps" in long[0]
    short = choose_plan(Workload(spec=spec, batch_size=512, seq_len=4096, steps=2), flavor).report()
    assert not short[0].startswith("Warning")


def test_gpipe_is_priced_where_forced_and_is_never_faster_nor_smaller_than_its_1f1b_twin():
    """layouts.UNFORCED_SCHEDULES: GPipe holds every micro-batch in flight where 1F1B holds at most P - d, at the same
    bubble. Unforced, no GPipe plan is priced; forced, each is priced, and against its 1F1B twin of the unforced
    search it takes the same time and no less memory: leaving it out changes no choice."""
    _, spec, flavor = setup("model=llama3_8b", "flavor=small", "flavor.device=h100", "flavor.memory_gb=640")
    work = Workload(spec=spec, batch_size=64, seq_len=4096)
    unforced = choose_plan(work, flavor)
    schedules = {c.plan.pipeline_schedule for c in unforced.candidates}
    assert "gpipe" not in schedules and {"1f1b", "interleaved_1f1b"} <= schedules, schedules
    twins = {replace(c.plan, pipeline_schedule="gpipe"): c for c in unforced.candidates
             if c.plan.pipeline_schedule == "1f1b"}
    gpipe = choose_plan(work, flavor, forced={"pipeline_schedule": "gpipe"}).candidates
    assert gpipe and all(c.plan.pipeline_schedule == "gpipe" for c in gpipe)
    paired = [(c, twins[c.plan]) for c in gpipe if c.plan in twins]  # (a tiled MLP is priced where its whole one
    assert len(paired) > 0.9 * len(gpipe)                             # does not fit: under GPipe alone, at times)
    for c, twin in paired:
        assert c.time.total_s == twin.time.total_s and c.memory.total >= twin.memory.total, (c.plan, twin.plan)
    assert any(c.memory.total > twin.memory.total for c, twin in paired)
    fastest = min(c.time.total_s for c in gpipe if c.fits)
    assert fastest >= min(c.time.total_s for c in unforced.candidates if c.fits and c.plan.pipeline_stages > 1)
