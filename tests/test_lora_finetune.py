"""The LoRA and QLoRA recipe end to end: PEFT adapters that peft loads, a merged model that transformers
loads, the same losses on any flavor. Run: pytest tests/test_lora_finetune.py  (about three minutes;
QLoRA alone: -k qlora)"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import FSDP, make_hf_checkpoint
from tests.helpers import layout, metrics, peak_error, run_recipe, tensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"instruction": f"Say the number {i} in words.", "input": "", "output": f"The number is {i}."} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lora(*args, **kw):
    return run_recipe(*args, module="recipes.lora_finetune", **kw)


# Every family, with and without the output projection adapted (a tied output cannot be: see below).
@pytest.mark.parametrize("family, flavor, tie, output", [("llama", "cpu-2 sharded", False, True),
                                                         ("qwen2", "cpu", False, True), ("mistral", "cpu", False, True),
                                                         ("qwen3", "cpu", True, False)])
def test_peft_loads_the_adapter_and_it_matches_the_merged_model(tmp_path, data_file, family, flavor, tie, output):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    hf = make_hf_checkpoint(tmp_path / "base", family, tie=tie)
    out = tmp_path / "run"
    flavor, _, kind = flavor.partition(" ")
    forced = list(FSDP) if kind == "sharded" else []
    r = lora(f"model.checkpoint_dir={hf}", f"flavor={flavor}", *forced, "dataset=instruct", f"dataset.path={data_file}",
             "max_steps=3", "batch_size=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "logger=stdout",
             "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]", "lora.apply_to_mlp=true", "lora.rank=4",
             f"lora.apply_to_output={str(output).lower()}", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert layout(out) == (kind or "single")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0 and config["base_model_name_or_path"] == str(hf)
    assert config["lora_dropout"] == 0.0
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj", *(["lm_head"] if output else [])}
    names = load_file(out / "adapter" / "adapter_model.safetensors").keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert ("base_model.model.lm_head.lora_B.weight" in names) == output

    tokens = torch.randint(0, 300, (2, 12))
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, out / "adapter")(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)(tokens).logits
        # base_model_name_or_path is usable as it is: peft's Auto class finds the base through it alone.
        auto_logits = AutoPeftModelForCausalLM.from_pretrained(out / "adapter", dtype=torch.float32)(tokens).logits
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(auto_logits, peft_logits, atol=0, rtol=0)
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter changed the model

    # Only the adapters trained (at lr 1e-2 with weight decay): every weight no adapter touches is the base's
    # bit for bit in the merged model, and every adapted one moved.
    adapted = {n.removeprefix("base_model.model.").replace(".lora_A", "") for n in names if ".lora_A." in n}
    before, merged = tensors(hf), tensors(out / "model")
    assert before.keys() == merged.keys() and adapted <= before.keys()
    for name in before:
        assert torch.equal(before[name], merged[name]) == (name not in adapted), name


def test_only_adapters_train_and_losses_agree_across_flavors(tmp_path, hf_checkpoints, data_file):
    common = [f"model.checkpoint_dir={hf_checkpoints['llama']}", "dataset=instruct", f"dataset.path={data_file}",
              "batch_size=6", "max_steps=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "logger=stdout",
              "save_merged=false"]
    losses = {}
    runs = {"cpu": ("single", ["flavor=cpu"]), "cpu-2 sharded": ("sharded", ["flavor=cpu-2", *FSDP]),
            "cpu-2 replicated": ("replicated", ["flavor=cpu-2", "plan.replicate=true"]),
            "mbs1": ("single", ["plan.micro_batch_size=1"])}
    for name, (kind, extra) in runs.items():
        r = lora(*common, *extra, f"output_dir={tmp_path / name}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert layout(tmp_path / name) == kind
        assert "Trainable: 0.0" in r.stdout and "[Step 4/4] | Loss: " in r.stdout and "tokens/sec" in r.stdout
        assert abs(peak_error(r.stdout)) <= 0.10, name
        losses[name] = [row["loss"] for row in metrics(tmp_path / name)]
        assert not (tmp_path / name / "model").exists() and (tmp_path / name / "adapter").exists()
        for output in ("loss.png", "plan.json", "config.yaml"):  # what the full fine-tuning recipe writes, too
            assert (tmp_path / name / output).is_file(), output
    assert losses["cpu"][-1] < losses["cpu"][0]
    for name, got in losses.items():
        assert len(got) == 4
        for a, b in zip(losses["cpu"], got):
            assert abs(a - b) <= 1e-4 * abs(a), (name, losses)


def test_lora_dropout_applies_in_training_and_the_adapter_config_says_so(tmp_path, hf_checkpoints, data_file):
    common = [f"model.checkpoint_dir={hf_checkpoints['llama']}", "dataset=instruct", f"dataset.path={data_file}",
              "batch_size=6", "max_steps=3", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "save_merged=false",
              "flavor=cpu", "sample_max_new_tokens=0"]
    losses = {}
    for dropout, logger in ((0.0, "stdout"), (0.5, "wandb")):  # W&B (offline here) records LoRA runs too
        out = tmp_path / f"dropout-{dropout}"
        r = lora(*common, f"lora.dropout={dropout}", f"logger={logger}", f"output_dir={out}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["lora_dropout"] == dropout
        losses[dropout] = [row["loss"] for row in metrics(out)]
    assert list((tmp_path / "dropout-0.5" / "wandb").glob("offline-run-*"))
    # B starts at zero, so the first step cannot tell; from the second on, the adapters trained on dropped inputs.
    assert losses[0.5][0] == pytest.approx(losses[0.0][0], rel=1e-6)
    assert all(abs(a - b) > 1e-4 * abs(a) for a, b in zip(losses[0.0][1:], losses[0.5][1:])), losses


def test_an_adapter_on_a_tied_output_is_refused():
    from moai_recipes.errors import UserError
    from moai_recipes.models.lora import lora_options
    from moai_recipes.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(dict(model_type="qwen2", vocab_size=384, hidden_size=64, intermediate_size=160,
                                    num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=True))
    with pytest.raises(UserError, match=r"apply_to_output=true is not possible .*\(tie_word_embeddings\)"):
        lora_options(dict(attn_modules=["q_proj"], apply_to_mlp=False, apply_to_output=True, rank=4, alpha=8, dropout=0.0,
                          quantize_base=False), spec=spec)


@pytest.mark.parametrize("args, words", [
    (["lora.attn_modules=[q_proj,x_proj]"], ["x_proj", "output_proj"]),
    (["lora.rank=0"], ["lora.rank=0"]),
    (["lora.rnk=4"], ["lora.rnk", "lora.rank"]),
    (["lora.quantize_base=true"], ["lora.quantize_base=true", "attn.k_proj", "num_key_value_heads*head_dim=64", "NF4"]),
])
def test_lora_mistakes_exit_2(tmp_path, args, words):
    r = lora("logger=stdout", f"output_dir={tmp_path / 'run'}", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr


# QLoRA. Every NF4 weight of this checkpoint (and its half on cpu-2) holds whole NF4 blocks of 64 x 256
# values; the default tiny model's do not (k_proj is 64 x 128).
QLORA_DIMS = dict(hidden=256, intermediate=512)


def _qlora_options(spec, *, world_size=1, **kw):
    from moai_recipes.models.lora import lora_options

    args = dict(attn_modules=["q_proj", "v_proj"], apply_to_mlp=False, apply_to_output=False, rank=4, alpha=16,
                dropout=0.0, quantize_base=True)
    return lora_options({**args, **kw}, spec=spec, world_size=world_size)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_qlora_keeps_every_layer_linear_in_nf4(tmp_path, family):
    from torchao.dtypes.nf4tensor import NF4Tensor

    from moai_recipes.models.build import build_model, init_buffers, nf4_weights
    from moai_recipes.models.hf_format import HFFolder, full_tensor, load_weights
    from moai_recipes.models.lora import NF4_BLOCK

    hf = HFFolder.open(make_hf_checkpoint(tmp_path / family, family, **QLORA_DIMS))
    opts = _qlora_options(hf.spec, world_size=2)
    assert all(r * c % (2 * NF4_BLOCK) == 0 for (r, c), _ in nf4_weights(hf.spec, opts).values())
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=64, lora=opts.builder_kwargs(), quantize_base=True)
    nf4 = {n for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}
    assert nf4 == {f"layers.{i}.{m}.weight" for i in range(2) for m in nf4_weights(hf.spec, opts)}
    assert "layers.0.mlp.w1.weight" in nf4 and "layers.0.attn.k_proj.weight" in nf4  # adapted or not

    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf, allow_missing=(".lora_a.", ".lora_b."))
    w = model.layers[0].attn.v_proj.weight
    stored = sum(getattr(w, name).nbytes for name in w.__tensor_flatten__()[0])
    assert isinstance(w, NF4Tensor) and stored * 8 / w.numel() < 4.2  # 4-bit codes and their scales
    original = load_file(hf.folder / "model.safetensors")["model.layers.0.self_attn.v_proj.weight"]
    error = (full_tensor(w) - original).norm() / original.norm()
    assert 0 < error < 0.1, error
    assert isinstance(model.state_dict()["layers.0.attn.v_proj.weight"], NF4Tensor)  # no dequantizing hook


def test_qlora_dims_that_nf4_cannot_hold_are_a_user_error():
    from moai_recipes.errors import UserError
    from moai_recipes.models.spec import spec_from_hf_config

    config = dict(model_type="llama", vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4)
    spec = spec_from_hf_config(config)  # every weight is 128 x 128 or 256 x 128: whole blocks, halves are not
    _qlora_options(spec)
    with pytest.raises(UserError, match=r"attn.q_proj weight .* \[128, 128\] .* over 2 processes"):
        _qlora_options(spec, world_size=2)
    with pytest.raises(UserError, match=r"attn.k_proj .*num_key_value_heads\*head_dim=64, hidden_size=128"):
        _qlora_options(spec_from_hf_config({**config, "num_key_value_heads": 2}))
    _qlora_options(spec, quantize_base=False, world_size=2)  # plain LoRA has no such constraint


def test_qlora_trains_alike_on_cpu_and_cpu_2_and_peft_loads_its_adapter(tmp_path, data_file):
    from peft import PeftModel
    from torchao.dtypes.nf4tensor import to_nf4
    from transformers import AutoModelForCausalLM

    hf = make_hf_checkpoint(tmp_path / "base", "llama", **QLORA_DIMS)
    common = [f"model.checkpoint_dir={hf}", "dataset=instruct", f"dataset.path={data_file}", "max_steps=3",
              "batch_size=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "logger=stdout",
              "lora.quantize_base=true", "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]",
              "lora.apply_to_mlp=true", "lora.rank=4", "sample_max_new_tokens=0"]
    runs = {"cpu": ["save_merged=false"], "cpu-2": ["checkpoint_every=2", *FSDP]}
    losses = {}
    for flavor, extra in runs.items():
        r = lora(*common, f"flavor={flavor}", *extra, f"output_dir={tmp_path / flavor}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert layout(tmp_path / flavor) == {"cpu": "single", "cpu-2": "sharded"}[flavor]  # NF4 shards on cpu-2
        assert "base frozen in NF4 (QLoRA)" in r.stdout
        assert abs(peak_error(r.stdout)) <= 0.10, flavor
        losses[flavor] = [row["loss"] for row in metrics(tmp_path / flavor)]
    assert losses["cpu"][-1] < losses["cpu"][0]
    for a, b in zip(losses["cpu"], losses["cpu-2"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), losses
    assert (tmp_path / "cpu-2" / "checkpoints" / "step-000002").is_dir()

    # The merged model is what was trained, as torchtune merges QLoRA: the NF4 base dequantized, plus the
    # adapters. On the same dequantized base, peft's adapter gives its logits. (Quantizing in the Hugging Face
    # layout is the same as in torchtune's: q/k rows move within a head, and a head, 64 x 256 values, is
    # exactly one block of scales.)
    def base(dequantized_nf4: bool):
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if dequantized_nf4 and ".layers." in name and name.endswith("proj.weight"):
                    p.copy_(to_nf4(p.detach().clone()).get_original_weight())
        return model

    out = tmp_path / "cpu-2"
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)(tokens).logits
        on_nf4 = PeftModel.from_pretrained(base(True), out / "adapter")(tokens).logits
        on_original = PeftModel.from_pretrained(base(False), out / "adapter")(tokens).logits
        original = base(False)(tokens).logits
    torch.testing.assert_close(on_nf4, merged, atol=1e-4, rtol=1e-4)
    # On the original base, the adapter loads like any other; the logits then differ by NF4's error only.
    assert (on_original - merged).norm() < 0.3 * merged.norm() and (on_original - original).abs().max() > 1e-2


def test_the_adapter_names_its_base_as_the_run_found_it(tmp_path):
    """A Hub download is named by its repository (peft fetches it again); a local folder by its path, even
    when the model config names a Hub repository (a custom model must not be swapped for the Hub's)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    from moai_recipes.models.sources import base_model_name

    snapshot = Path(HF_HUB_CACHE) / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc123"
    assert base_model_name(snapshot, "meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert base_model_name(tmp_path, "meta-llama/Llama-3.1-8B") == str(tmp_path)
    assert base_model_name(tmp_path, None) == str(tmp_path)
