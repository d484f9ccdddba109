"""The models people fine-tune now, through transformers' own modules (models/transformers_model.py): each a tiny
random checkpoint the installed transformers writes (tests/architectures.py: Gemma 3 and 4, gpt-oss, Qwen3.5 dense and
MoE, DeepSeek-V3, Llama 4, Phi-4, SmolLM3, GLM-4.5), checked against transformers itself:
- the parameters counted as transformers holds them, each layer's kind named;
- the loss on a batch equal to transformers' `model(..., labels=...)`, whole and chunked, and each document of a packed
  row its loss alone (windows, sinks, chunks, NoPE layers and linear-attention state stop at its end);
- a 1-step lr-0 run writes back every tensor of the input byte for byte;
- LoRA adapters (by role and by PEFT's names) load in peft with our logits, and merge as peft merges them;
- one process and two (FSDP2, asserted from plan.json) train alike.
Run: python -m pytest tests/test_architectures.py -q
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moai_recipes.models.attention import Documents
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.hf_format import HFFolder, load_weights, save_weights
from moai_recipes.models.loss import IGNORE_INDEX, token_loss_sum
from tests.architectures import ARCHITECTURES, make_checkpoint
from tests.helpers import FSDP, last_wins, layout, metrics, peak_error, plan_of, run_recipe, tensors

NAMES = list(ARCHITECTURES)
# Layer kinds each architecture's config makes (what the planner traces one of each).
KINDS = {
    "gemma3": {"sliding_attention, dense", "full_attention, dense"},
    "gemma4": {"sliding_attention, dense", "full_attention, dense", "sliding_attention, dense #2",
               "full_attention, dense #2"},  # the shared key-value layers hold no k and v projections
    "gpt_oss": {"sliding_attention, sparse", "full_attention, sparse"},
    "qwen3_5": {"linear_attention, dense", "full_attention, dense"},
    "qwen3_5_moe": {"linear_attention, sparse", "full_attention, sparse"},
    "deepseek_v3": {"attention, dense", "attention, sparse"},
    "llama4": {"chunked_attention, dense", "full_attention, sparse"},
    "phi4": {"attention, dense"},
    "smollm3": {"full_attention, dense"},
    "glm4_moe": {"attention, dense", "attention, sparse"},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("architectures")
    return {name: make_checkpoint(base / name, name) for name in NAMES}


def _loaded(hf: HFFolder, **build) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=64, **build)
    if "lora" in build:
        from moai_recipes.models.lora import freeze_base

        freeze_base(model)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf, allow_missing=(".lora_a.", ".lora_b."))
    if "lora" in build:
        from moai_recipes.models.lora import init_adapters

        init_adapters(model, seed=0)
    return model.eval()


def _shifted(tokens: torch.Tensor) -> torch.Tensor:
    """Each position's target: the next token (none for the last)."""
    return torch.cat([tokens[..., 1:], torch.full_like(tokens[..., :1], IGNORE_INDEX)], dim=-1)


@pytest.mark.parametrize("name", NAMES)
def test_the_loss_is_transformers_and_each_packed_document_its_own(checkpoints, name):
    from transformers import AutoModelForCausalLM

    hf = HFFolder.open(checkpoints[name])
    reference = AutoModelForCausalLM.from_pretrained(hf.folder, dtype=torch.float32).eval()
    spec = hf.spec
    assert spec.implementation == "transformers" and spec.num_params() == sum(p.numel() for p in reference.parameters())
    assert set(spec.parts.kinds) == KINDS[name] and len(spec.parts.kinds) == reference.config.num_hidden_layers
    model = _loaded(hf)

    torch.manual_seed(1)
    tokens = torch.randint(3, 380, (2, 24))
    labels = tokens.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt not trained on
    targets = _shifted(labels)
    count = int((targets != IGNORE_INDEX).sum())
    with torch.no_grad():
        theirs = float(reference(input_ids=tokens, labels=labels).loss)
        for chunked in (False, True):
            ours = float(token_loss_sum(model, tokens, targets, chunked=chunked)) / count
            assert abs(ours - theirs) <= 1e-5, (chunked, ours, theirs)

        # A packed row: three documents end to end, each attending to itself (its windows, chunks and recurrent
        # state from its own first token), against each alone through transformers.
        lengths = [13, 24, 7]
        documents = [torch.randint(3, 380, (n,)) for n in lengths]
        row = torch.cat(documents)[None]
        logits = model(row, mask=Documents(tuple(lengths)))[0].split(lengths)
        for document, ours in zip(documents, logits):
            alone = float(reference(input_ids=document[None], labels=document[None]).loss)
            assert abs(float(F.cross_entropy(ours[:-1], document[1:])) - alone) <= 1e-5


def test_a_layer_traced_again_reusing_what_it_was_called_with_is_traced_as_from_nothing(checkpoints, monkeypatch,
                                                                                      tmp_path):
    """The planner captures what a layer of transformers' modules is called with once and gives later traces of it
    (another recomputation, dtype, form of row) new tensors of the same shapes (planner/activations._layer_call), and
    builds the model once and lends it to each trace, recomputed and tiled as asked and put back after
    (_lent_model): each such trace equals one made in a process that traced nothing before. Gemma 4: its shared keys
    and values are written into what its layers are given. Qwen3.5-MoE: adapters on its stacked experts."""
    from moai_recipes.models.lora import LoraOptions
    from moai_recipes.planner.activations import RowForm, trace_layer

    experts = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(LoraOptions(
        ("q_proj", "v_proj"), False, False, 4, 8.0, 0.0, False, apply_to_experts=True).builder_kwargs().items()))
    asks = [("gemma4", "none", torch.float32, RowForm(), None), ("gemma4", "full", torch.float32, RowForm(), None),
            ("gemma4", "none", torch.bfloat16, RowForm.of(tiles=4), None),
            ("gemma4", "selective", torch.bfloat16, RowForm.of(per_document=True), None),
            ("gemma4", "selective", torch.float32, RowForm.of(per_document=True), None),
            ("qwen3_5_moe", "full", torch.float32, RowForm(), experts),
            ("qwen3_5_moe", "none", torch.float32, RowForm(), experts),
            ("qwen3_5_moe", "selective", torch.float32, RowForm(), None)]
    traced = lambda name, recompute, dtype, form, lora: trace_layer(  # noqa: E731
        HFFolder.open(checkpoints[name]).spec, seq_len=40, recompute=recompute, dtype=dtype, form=form, lora=lora)
    _each_as_from_nothing(asks, traced, ("_CACHE", "_ASKED", "_CALLS", "_LAYER_MODELS"), monkeypatch, tmp_path)


def test_a_small_layer_traced_on_real_tensors_holds_and_computes_what_its_fake_trace_does(checkpoints, monkeypatch):
    """A small dense model of transformers' modules is traced on real tensors (planner/activations.py,
    REAL_TRACE_FLOPS), each kind of layer: the bytes it keeps, its transient peak, the gradients at the peak and its
    FLOPs equal its fake trace's; its operators and traffic within 2% (for fake tensors transformers builds a sliding
    window's mask by another path, masking_utils.is_tracing: what the real trace counts is what training runs). So
    does a small model with experts, whose layers' shapes the token count fixes whatever the routing (transformers'
    experts interface, Llama 4's experts): its adapted stacked experts too."""
    from moai_recipes.models.lora import LoraOptions
    from moai_recipes.planner import activations
    from moai_recipes.planner.activations import RowForm

    key = lambda options: tuple((k, tuple(v) if isinstance(v, list) else v)  # noqa: E731 (as Workload.lora_key)
                                for k, v in sorted(options.builder_kwargs().items()))
    lora = key(LoraOptions(("q_proj", "v_proj"), True, False, 4, 8.0, 0.0, False))
    on_experts = key(LoraOptions(("q_proj", "v_proj"), False, False, 4, 8.0, 0.0, False, apply_to_experts=True))
    budget = activations.REAL_TRACE_FLOPS
    cases = [("gemma3", "none", RowForm(), torch.float32, None, 40),  # sliding and global layers, a window crossed
             ("gemma4", "selective", RowForm.of(per_document=True), torch.bfloat16, lora, 24),  # shared keys, values
             ("qwen3_5", "full", RowForm.of(tiles=4), torch.float32, lora, 32),  # linear attention's chunks
             ("phi4", "selective", RowForm(), torch.bfloat16, None, 24),
             ("qwen3_5_moe", "selective", RowForm.of(per_document=True), torch.bfloat16, on_experts, 32),
             ("gpt_oss", "none", RowForm(), torch.float32, lora, 40),  # sinks, a window, experts with biases
             ("deepseek_v3", "full", RowForm(), torch.float32, None, 24),  # a dense layer first, shared experts
             ("llama4", "selective", RowForm(), torch.bfloat16, None, 24)]  # every expert's rows in one bmm
    for name, recompute, form, dtype, adapters, seq_len in cases:
        spec = HFFolder.open(checkpoints[name]).spec
        traces = {}
        for real in (True, False):
            monkeypatch.setattr(activations, "_CALLS", {})  # each mode captures the layers' call itself
            monkeypatch.setattr(activations, "REAL_TRACE_FLOPS", budget if real else {})
            assert activations._traced_for_real(spec, seq_len, dtype) == real
            traces[real] = activations._trace(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=adapters,
                                              form=form)
        real, fake = traces[True], traces[False]
        for field in ("retained", "transient", "grads_at_peak", "flops", "attention_flops", "attention_square",
                      "retained_fixed", "transient_fixed"):
            assert getattr(real, field) == getattr(fake, field), (name, field, real, fake)
        for field in ("ops", "traffic"):
            assert abs(getattr(real, field) - getattr(fake, field)) <= 0.02 * getattr(fake, field), (name, real, fake)
        assert real.flops > 0 and real.ops > 0 and (real.retained > 0 or recompute == "full")


def test_a_head_traced_on_the_model_kept_from_earlier_traces_is_traced_as_from_nothing(checkpoints, hf_checkpoints,
                                                                                     monkeypatch, tmp_path):
    """The planner builds the model whose head it traces once per model, dtype and adapters, and puts back what each
    trace gave storage (planner/activations._trace_head): each head trace equals one made in a process that traced
    nothing before. Gemma 3: its output tied to its embedding, its logits soft-capped; Llama (torchtune's modules)
    with LoRA on its output: LoRALinear.to_empty gives storage to its adapters alone."""
    from moai_recipes.models.lora import LoraOptions
    from moai_recipes.planner.activations import trace_head

    gemma, llama = HFFolder.open(checkpoints["gemma3"]).spec, HFFolder.open(hf_checkpoints["llama"]).spec
    output = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(LoraOptions(
        ("q_proj", "v_proj"), True, True, 4, 8.0, 0.0, False).builder_kwargs().items()))
    asks = [(gemma, 1, 40, False, torch.float32, None), (gemma, 3, 40, False, torch.float32, None),
            (gemma, 2, 64, True, torch.float32, None), (gemma, 1, 40, False, torch.bfloat16, None),
            (gemma, 2, 40, True, torch.bfloat16, None), (llama, 1, 40, False, torch.float32, output),
            (llama, 2, 40, False, torch.float32, output), (llama, 2, 64, True, torch.float32, output)]
    traced = lambda spec, rows, seq_len, chunked, dtype, lora: trace_head(  # noqa: E731
        spec, micro_batch_size=rows, seq_len=seq_len, chunked=chunked, dtype=dtype, lora=lora)
    _each_as_from_nothing(asks, traced, ("_CACHE", "_ASKED", "_HEAD_MODELS"), monkeypatch, tmp_path)


def _each_as_from_nothing(asks: list[tuple], traced, caches: tuple[str, ...], monkeypatch, tmp_path) -> None:
    """Each of `asks` traced after all of them equals it traced from nothing: planner/activations' in-memory `caches`
    emptied and a new disk cache."""
    from moai_recipes.planner import activations

    monkeypatch.setenv("MOAI_CACHE", str(tmp_path / "reused"))
    reused = [traced(*ask) for ask in asks]
    for i, ask in enumerate(asks):
        for name in caches:
            monkeypatch.setattr(activations, name, {})
        monkeypatch.setenv("MOAI_CACHE", str(tmp_path / f"fresh{i}"))
        assert traced(*ask) == reused[i], [a for a in ask if not hasattr(a, "key")]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5", "deepseek_v3", "phi4", "gpt_oss"])
def test_lora_adapters_load_in_peft_with_our_logits_and_merge_as_peft_merges(checkpoints, name, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from moai_recipes.models.lora import gather_adapters, lora_options, merge_into, save_adapter

    hf = HFFolder.open(checkpoints[name])
    tokens = torch.randint(3, 380, (1, 20))
    for i, targets in enumerate(({"attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "apply_to_mlp": True},
                    {"attn_modules": [], "apply_to_mlp": False, "target_modules": ["all-linear"]})):
        opts = lora_options({"apply_to_output": False, "rank": 4, "alpha": 8, "dropout": 0.0, "quantize_base": False,
                             **targets}, spec=hf.spec)
        model = _loaded(hf, lora=opts.builder_kwargs())
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_b." in n:  # B starts at zero: make the adapters change something
                    p.normal_(0, 0.1)
        adapters = gather_adapters(model)
        folder = tmp_path / str(i)
        save_adapter(adapters, opts=opts, out_dir=folder / "adapter", base_model=str(hf.folder))
        save_weights(model, hf, folder / "merged", rank=0, transform=merge_into(adapters, opts.scale))
        base = AutoModelForCausalLM.from_pretrained(hf.folder, dtype=torch.float32)
        with torch.no_grad():
            before = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, folder / "adapter").eval()  # into `base` itself
        with torch.no_grad():
            ours, theirs = model(tokens), adapted(tokens).logits
            assert (ours - theirs).abs().max() <= 1e-5
            assert (ours - before).abs().max() > 1e-3  # the adapters change the model
        adapted.merge_and_unload().save_pretrained(folder / "peft-merged")  # laid out as a checkpoint, experts and all
        merged = tensors(folder / "peft-merged")
        for key, tensor in tensors(folder / "merged").items():
            assert (tensor - merged[key]).abs().max() <= 1e-6, key


def test_qlora_holds_the_linear_weights_of_the_layers_in_nf4_where_whole_blocks_fit(tmp_path):
    from moai_recipes.models.build import is_nf4
    from moai_recipes.models.lora import NF4_BLOCK, lora_options

    # Wide enough that most projections hold whole NF4 blocks of 64 x 256 values; the linear attention's small gates
    # ([heads, hidden]) cannot, and stay in the compute dtype.
    hf = HFFolder.open(make_checkpoint(tmp_path / "qwen3_5", "qwen3_5", hidden_size=256, intermediate_size=512,
                                       head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64))
    opts = lora_options({"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": False, "apply_to_output": False,
                         "rank": 4, "alpha": 8, "dropout": 0.0, "quantize_base": True}, spec=hf.spec, world_size=2)
    qlora = _loaded(hf, lora=opts.builder_kwargs(), quantize_base=True)
    plain = _loaded(hf)
    linears = {n: m.weight.shape for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    held = dict(qlora.named_parameters())
    whole = {n for n, (rows, cols) in linears.items() if rows % 2 == 0 and (rows // 2 * cols) % NF4_BLOCK == 0}
    assert set(opts.unquantized) == set(linears) - whole and whole and opts.unquantized
    for name in linears:
        assert is_nf4(held[f"{name}.weight"]) == (name in whole), name
    tokens = torch.randint(3, 380, (1, 16))
    with torch.no_grad():  # NF4 is 4 bits a weight: close to the model, not equal
        assert (qlora(tokens) - plain(tokens)).abs().max() < 0.5


# One process against two and four sharding it (FSDP2): the same losses and gradient norms step by step. On two, a
# Mixture-of-Experts model's experts split over the devices besides (expert parallelism: each device's tokens sent to
# its experts' device, biased and shared experts included) where they take tokens by transformers' experts interface.
# On four, at lr 0: the model gathered from its shards is written back every tensor byte for byte.
@pytest.mark.parametrize("name", NAMES)
def test_one_two_and_four_processes_train_alike_and_lr_zero_writes_back_every_tensor(checkpoints, name, tmp_path):
    common = [f"model.checkpoint_dir={checkpoints[name]}", "max_steps=2", "batch_size=8", "max_seq_len=64",
              "logger=stdout", "sample_max_new_tokens=0"]
    experts = 2 if HFFolder.open(checkpoints[name]).spec.parts.experts_dispatchable else 1
    curves = {}
    for flavor, forced in (("cpu", ("optimizer.lr=1e-3",)),
                           ("cpu-2", (*FSDP, "optimizer.lr=1e-3", f"plan.expert_parallel={experts}")),
                           # At lr 0 one step says it all: its loss and norm, then every tensor written back.
                           ("cpu-4", (*FSDP, "optimizer.lr=0", "plan.expert_parallel=1", "measure_memory=false",
                                      "max_steps=1"))):
        out = tmp_path / flavor
        r = run_recipe(*last_wins(*common, f"flavor={flavor}", *forced), f"output_dir={out}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f": {ARCHITECTURES[name][0]}," in r.stdout  # described as what it is
        assert layout(out) == ("single" if flavor == "cpu" else "sharded")
        if flavor != "cpu-4":  # the planner's peak of a device against the one measured (step 2: AdamW's state made)
            assert abs(peak_error(r.stdout)) <= 0.10
        if flavor == "cpu-2":
            assert plan_of(out)["expert_parallel"] == experts
        curves[flavor] = metrics(out)
    assert len(curves["cpu"]) == 2
    assert len(curves["cpu-2"]) == 2 and len(curves["cpu-4"]) == 1
    for flavor in ("cpu-2", "cpu-4"):
        for one, other in zip(curves["cpu"], curves[flavor]):
            for key in ("loss", "grad_norm", "aux_loss"):
                if key in one:
                    assert abs(one[key] - other[key]) <= 1e-4 * max(1.0, abs(one[key])), (flavor, key, curves)
    before, after = tensors(checkpoints[name]), tensors(tmp_path / "cpu-4" / "model")
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key


# Dense models: on a Mixture-of-Experts model recipes.dpo adds each sequence's balancing loss (the same on any flavor,
# tests/test_dpo.py), TRL its micro-batch's.
@pytest.mark.parametrize("name, method", [("gemma3", "full"), ("smollm3", "lora")])
def test_dpo_equals_trl(checkpoints, name, method, tmp_path):
    pytest.importorskip("trl")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests import test_dpo
    from tests.helpers import start_adapter

    model = checkpoints[name]
    rows = test_dpo._rows(conversational=method == "full")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if method == "full":
        ours = test_dpo._ours(tmp_path, "ours", model, data, "reference=copy")
        theirs = test_dpo._trl(tmp_path, base, rows, model)
    else:
        lr = test_dpo.LORA_LR
        ours = test_dpo._ours(tmp_path, "ours", model, data, "method=lora", "lora.rank=4", "lora.alpha=8",
                              "lora.attn_modules=[q_proj,v_proj]", "reference=copy", lr=lr)
        start_adapter(model, tmp_path / "start", test_dpo.SEED)
        theirs = test_dpo._trl(tmp_path, PeftModel.from_pretrained(base, tmp_path / "start", is_trainable=True), rows,
                               model, lr=lr)
    test_dpo._same(ours, theirs)


@pytest.mark.parametrize("name", ["gemma3", "deepseek_v3"])
def test_grpo_equals_trl(checkpoints, name, tmp_path):
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    from tests import test_grpo

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                            for p, t in zip(test_grpo.PROMPTS, test_grpo.TARGETS)))
    case = test_grpo.CASES["dapo, beta 0.04, two rewards"]
    ours = test_grpo._ours(tmp_path, "ours", checkpoints[name], data, case)
    theirs = test_grpo._trl(tmp_path, AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32),
                            checkpoints[name], case)
    test_grpo._same(ours, theirs)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5"])
def test_greedy_generation_with_the_cache_equals_transformers(checkpoints, name, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moai_recipes.recipes.generate import main

    prompt = "What is the capital of France?"
    assert main([f"model.checkpoint_dir={checkpoints[name]}", f"prompt={prompt}", "max_new_tokens=8",
                 "temperature=0"]) in (0, None)
    ours = capsys.readouterr().out.strip().splitlines()[-1]
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[name])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    out = reference.generate(ids, max_new_tokens=8, do_sample=False)
    assert ours == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.parametrize("name", ["qwen3_5_moe", "gpt_oss"])
def test_each_samples_balancing_loss_is_transformers_on_it_alone(checkpoints, name):
    from transformers import AutoModelForCausalLM

    from moai_recipes.models.moe import Routing, balancing_losses, routing_recorded

    hf = HFFolder.open(checkpoints[name])
    spec = hf.spec
    assert spec.is_moe and spec.router_aux_loss_coef > 0
    model = _loaded(hf)
    reference = AutoModelForCausalLM.from_pretrained(hf.folder, dtype=torch.float32).eval()
    lengths = [11, 17]
    rows = [torch.randint(3, 380, (n,)) for n in lengths]
    samples = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    routing = Routing(samples, len(lengths), spec)
    with torch.no_grad(), routing_recorded(model, routing):
        model(torch.cat(rows)[None], mask=Documents(tuple(lengths)))
    ours = balancing_losses(routing.stats(), spec.num_experts, len(spec.moe_layers))
    for row, loss in zip(rows, ours):
        with torch.no_grad():
            theirs = reference(input_ids=row[None], output_router_logits=True).aux_loss
        assert abs(float(loss) - float(theirs)) <= 1e-5


def test_a_model_transformers_adds_no_balancing_loss_to_gets_none(checkpoints):
    for name in ("llama4", "deepseek_v3", "glm4_moe"):  # Llama 4's forward computes none; the others' configs have none
        spec = HFFolder.open(checkpoints[name]).spec
        assert spec.is_moe and spec.router_aux_loss_coef == 0.0, name


REMOTE_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class MyConfig(LlamaConfig):
    model_type = "my_llama"


class MyForCausalLM(LlamaForCausalLM):
    config_class = MyConfig
'''


def test_code_from_the_checkpoint_runs_only_when_trusted(tmp_path):
    """A model the installed transformers does not know, whose config.json names code beside it (auto_map): refused
    naming model.trust_remote_code, trained with it (and said so), written back byte for byte."""
    from tests.helpers import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path / "remote", "llama")
    (folder / "my_model.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_llama", architectures=["MyForCausalLM"],
                  auto_map={"AutoConfig": "my_model.MyConfig", "AutoModelForCausalLM": "my_model.MyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    common = [f"model.checkpoint_dir={folder}", "optimizer.lr=0", "max_steps=1", "batch_size=4", "logger=stdout",
              "sample_max_new_tokens=0", "measure_memory=false"]
    refused = run_recipe(*common, f"output_dir={tmp_path / 'refused'}")
    assert refused.returncode == 2 and "model.trust_remote_code=true" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    out = tmp_path / "trusted"
    r = run_recipe(*common, "model.trust_remote_code=true", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("auto_map) builds this model: it runs because model.trust_remote_code=true") == 1
    before, after = tensors(folder), tensors(out / "model")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _mxfp4_checkpoint(folder: Path) -> Path:
    """A tiny gpt-oss whose experts are held as its released checkpoints hold them: MXFP4 (4-bit values packed two a
    byte, `_blocks`, a power-of-two scale per 32 values, `_scales`), everything else in bf16."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(folder, "gpt_oss", dtype="bfloat16")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, into, out = tensors.pop(name).shape  # [E, in, out]: the blocks are [E, out, in / 32, 16]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, out, into // 32, 16), dtype=torch.uint8,
                                                  generator=generator)
        tensors[f"{name}_scales"] = torch.randint(120, 128, (experts, out, into // 32), dtype=torch.uint8,
                                                  generator=generator)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_mxfp4_experts_are_dequantized_on_load_said_so_and_written_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = _mxfp4_checkpoint(tmp_path / "gpt_oss")
    reference = AutoModelForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                     dtype=torch.bfloat16).eval()
    hf = HFFolder.open(folder)
    assert hf.spec.mxfp4
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=64)
    model.to(torch.bfloat16).to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf)
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, theirs[name]), name

    out = tmp_path / "run"
    r = run_recipe(f"model.checkpoint_dir={folder}", "optimizer.lr=0", "max_steps=1", "batch_size=4", "max_seq_len=64",
                   "logger=stdout", "sample_max_new_tokens=0", "measure_memory=false", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MXFP4" in r.stdout and "dequantized" in r.stdout
    written = tensors(out / "model")
    assert "model.layers.0.mlp.experts.gate_up_proj" in written and not any(n.endswith("_blocks") for n in written)
    assert written["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert "quantization_config" not in json.loads((out / "model" / "config.json").read_text())
    tokens = torch.randint(3, 380, (1, 16))
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.bfloat16).eval()
        assert torch.equal(again(tokens).logits, reference(tokens).logits)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "deepseek_v3"])
def test_a_row_split_over_two_context_devices_trains_as_one_process(checkpoints, name, tmp_path):
    """Packed rows cut over two context devices (the gather way: each device's queries against the row's keys and
    values, under the model's own masks: Gemma 3's local and global layers, gpt-oss's windows and sinks, DeepSeek-V3's
    latent attention, whose keys are larger than its values) train as one process; the sparse layers of gpt-oss and
    DeepSeek-V3 route each device's share, their samples' balancing losses whole (aux_loss)."""
    common = [f"model.checkpoint_dir={checkpoints[name]}", "max_steps=3", "batch_size=8", "max_seq_len=64",
              "optimizer.lr=1e-3", "logger=stdout", "sample_max_new_tokens=0", "measure_memory=false",
              "plan.packing=true"]
    curves = {}
    for flavor, forced in (("cpu", ()), ("cpu-2", ("plan.context_parallel=2", "plan.context_parallel_way=gather"))):
        out = tmp_path / flavor
        r = run_recipe(*common, f"flavor={flavor}", *forced, f"output_dir={out}")
        assert r.returncode == 0, r.stdout + r.stderr
        curves[flavor] = metrics(out)
    assert layout(tmp_path / "cpu-2") == "data 1 x context 2 (gather)"
    for one, two in zip(curves["cpu"], curves["cpu-2"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-4 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-4 * max(
            1.0, one["grad_norm"]), curves
        if "aux_loss" in one:
            assert abs(one["aux_loss"] - two["aux_loss"]) <= 1e-5 * one["aux_loss"], curves


@pytest.mark.parametrize("name", ["qwen3_5_moe", "gpt_oss"])
def test_adapters_on_the_stacked_experts_load_in_peft_and_merge_as_peft_merges(checkpoints, name, tmp_path):
    """lora.apply_to_experts on transformers' stacked experts (Qwen3.5-MoE's fused gate and up, gpt-oss's transposed
    and interleaved ones): PEFT's ParamWrapper loads the adapter with our logits, and merges it as we do."""
    import peft
    from transformers import AutoModelForCausalLM

    from moai_recipes.models.lora import gather_adapters, lora_options, merge_into, save_adapter

    hf = HFFolder.open(checkpoints[name])
    opts = lora_options({"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": False, "apply_to_output": False,
                         "apply_to_experts": True, "rank": 4, "alpha": 8, "dropout": 0.0, "quantize_base": False},
                        spec=hf.spec)
    model = _loaded(hf, lora=opts.builder_kwargs())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b." in n:
                p.normal_(0, 0.1)
    adapters = gather_adapters(model)
    assert any(".experts.lora_a." in n for n in adapters)
    save_adapter(adapters, opts=opts, out_dir=tmp_path / "adapter", base_model=str(hf.folder))
    save_weights(model, hf, tmp_path / "merged", rank=0, transform=merge_into(adapters, opts.scale))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] and all(t.startswith("mlp.experts.") for t in config["target_parameters"])
    base = AutoModelForCausalLM.from_pretrained(hf.folder, dtype=torch.float32)
    tokens = torch.randint(3, 380, (1, 20))
    with torch.no_grad():
        before = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        ours, theirs = model(tokens), adapted(tokens).logits
        assert (ours - theirs).abs().max() <= 1e-5 and (ours - before).abs().max() > 1e-3
    adapted.merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    merged = tensors(tmp_path / "peft-merged")
    for key, tensor in tensors(tmp_path / "merged").items():
        assert (tensor - merged[key]).abs().max() <= 1e-5, key


EXPERTS_SPLIT = ("flavor=cpu-2", *FSDP, "plan.expert_parallel=2")


@pytest.mark.parametrize("name, recompute, module, dtype, split", [
    ("gpt_oss", "full", "recipes.full_finetune", "fp32", ()),
    ("qwen3_5_moe", "selective", "recipes.lora_finetune", "fp32", ()),
    ("gpt_oss", "selective", "recipes.full_finetune", "bf16", ()),
    ("qwen3_5_moe", "selective", "recipes.full_finetune", "fp32", EXPERTS_SPLIT)])
def test_recomputed_layers_record_their_routers_as_kept_ones(checkpoints, name, recompute, module, dtype, split,
                                                            tmp_path):
    """Recomputed layers of transformers' modules whose routers' hooks record the routing (the balancing loss, the
    experts' load): the rerun in the backward records into a replica as our own sparse layers do (tests/test_moe.py),
    with LoRA on Qwen3.5-MoE's stacked experts too; the losses, norms and balancing losses are the kept layers'.
    In bf16 transformers' experts run PyTorch's grouped product, as on a GPU, and gpt-oss adds its experts' biases to
    its output in place: selective recomputation keeps no such output (models/recompute.py), else torch refuses it
    at the first backward (the planner's trace of the layer too). Split over two expert devices, the experts are an
    FSDP2 group of their own inside the recomputed layer, whose hooks' profiler markers selective recomputation
    must not match one by one (models/recompute.py)."""
    common = [f"model.checkpoint_dir={checkpoints[name]}", "flavor=cpu", "max_steps=2", "batch_size=8", "max_seq_len=64",
              "optimizer.lr=1e-3", "logger=stdout", "sample_max_new_tokens=0", "measure_memory=false", f"dtype={dtype}",
              *(["lora.apply_to_experts=true"] if module == "recipes.lora_finetune" else [])]
    curves = {}
    for policy in ("none", recompute):
        out = tmp_path / policy
        r = run_recipe(*last_wins(*common, *split), f"plan.recompute={policy}", f"output_dir={out}", module=module)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert plan_of(out)["recompute"] == policy and plan_of(out)["expert_parallel"] == (2 if split else 1)
        curves[policy] = metrics(out)
    assert len(curves["none"]) == 2 and all(row["aux_loss"] > 0 for row in curves["none"])
    for kept, rerun in zip(curves["none"], curves[recompute], strict=True):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert abs(kept[key] - rerun[key]) <= 1e-6 * abs(kept[key]), (key, curves)


def test_lora_on_the_stacked_experts_trains_alike_split_over_expert_devices_its_peak_as_planned(checkpoints, tmp_path):
    """recipes.lora_finetune with adapters on Qwen3.5-MoE's attention and stacked experts: one process against two
    sending each token to its experts' device, each run's peak as planned (its Gated DeltaNet layers before the
    first adapter run forward alone and keep nothing)."""
    common = [f"model.checkpoint_dir={checkpoints['qwen3_5_moe']}", "max_steps=3", "batch_size=8", "max_seq_len=64",
              "optimizer.lr=1e-3", "logger=stdout", "sample_max_new_tokens=0", "lora.apply_to_experts=true"]
    curves = {}
    for flavor, forced in (("cpu", ()), ("cpu-2", (*FSDP, "plan.expert_parallel=2"))):
        out = tmp_path / flavor
        r = run_recipe(*common, f"flavor={flavor}", *forced, f"output_dir={out}", module="recipes.lora_finetune")
        assert r.returncode == 0, r.stdout + r.stderr
        assert abs(peak_error(r.stdout)) <= 0.10
        assert plan_of(out)["expert_parallel"] == (2 if flavor == "cpu-2" else 1)
        adapter = tensors(out / "adapter")
        assert any(".experts." in key for key in adapter)
        curves[flavor] = metrics(out)
    assert len(curves["cpu"]) == 3
    for one, two in zip(curves["cpu"], curves["cpu-2"]):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert abs(one[key] - two[key]) <= 1e-4 * max(1.0, abs(one[key])), (key, curves)
