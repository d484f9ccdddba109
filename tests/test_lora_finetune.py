"""The LoRA recipe end to end: PEFT adapters that peft loads, a merged model that transformers loads,
the same losses on any flavor. Run: pytest tests/test_lora_finetune.py  (about two minutes)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_hf_checkpoint
from tests.test_full_finetune import metrics, run_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"instruction": f"Say the number {i} in words.", "input": "", "output": f"The number is {i}."} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lora(*args, **kw):
    return run_recipe(*args, module="recipes.lora_finetune", **kw)


@pytest.mark.parametrize("family, flavor, tie", [("llama", "cpu-2", False), ("qwen2", "cpu", True), ("mistral", "cpu", False)])
def test_peft_loads_the_adapter_and_it_matches_the_merged_model(tmp_path, data_file, family, flavor, tie):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = make_hf_checkpoint(tmp_path / "base", family, tie=tie)
    out = tmp_path / "run"
    r = lora(f"model.checkpoint_dir={ckpt}", f"flavor={flavor}", "dataset=instruct", f"dataset.path={data_file}",
             "max_steps=3", "batch_size=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "logger=stdout",
             "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]", "lora.apply_to_mlp=true", "lora.rank=4",
             f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0 and config["base_model_name_or_path"] == str(ckpt)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    names = load_file(out / "adapter" / "adapter_model.safetensors").keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names

    tokens = torch.randint(0, 300, (2, 12))
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, out / "adapter")(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)(tokens).logits
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-4, rtol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter changed the model


def test_only_adapters_train_and_losses_agree_across_flavors(tmp_path, hf_checkpoints, data_file):
    common = [f"model.checkpoint_dir={hf_checkpoints['llama']}", "dataset=instruct", f"dataset.path={data_file}",
              "batch_size=6", "max_steps=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "logger=stdout",
              "save_merged=false"]
    losses = {}
    for name, extra in {"cpu": ["flavor=cpu"], "cpu-2": ["flavor=cpu-2"], "mbs1": ["plan.micro_batch_size=1"]}.items():
        r = lora(*common, *extra, f"output_dir={tmp_path / name}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Trainable: 0.0" in r.stdout
        losses[name] = [row["loss"] for row in metrics(tmp_path / name)]
        assert not (tmp_path / name / "model").exists() and (tmp_path / name / "adapter").exists()
    assert losses["cpu"][-1] < losses["cpu"][0]
    for name, got in losses.items():
        for a, b in zip(losses["cpu"], got):
            assert abs(a - b) <= 1e-4 * abs(a), (name, losses)


@pytest.mark.parametrize("args, words", [
    (["lora.attn_modules=[q_proj,x_proj]"], ["x_proj", "output_proj"]),
    (["lora.rank=0"], ["lora.rank=0"]),
    (["lora.rnk=4"], ["lora.rnk", "lora.rank"]),
])
def test_lora_mistakes_exit_2(tmp_path, args, words):
    r = lora("logger=stdout", f"output_dir={tmp_path / 'run'}", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr
