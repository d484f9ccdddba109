"""Model specs and torchtune builds, checked against transformers. Run: python -m pytest tests/test_models.py -q"""

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from moai_recipes.errors import UserError
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.rope import inverse_frequencies
from moai_recipes.models.spec import (
    check_context,
    read_spec,
    spec_for,
    spec_from_hf_config,
)
from moai_recipes.models.tiny import tiny_checkpoint_dir

MODEL_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "moai_recipes" / "configs" / "model").glob("*.yaml"))
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5)


def architecture(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["architecture"]


def hf_config(family: str, **kwargs) -> dict:
    """config.json as transformers (5.x) writes it."""
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}
    return cls[family](**{**SMALL, **kwargs}).to_dict()


@pytest.mark.parametrize("family, tie", [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False),
                                         ("qwen2", True), ("qwen3", True)])
def test_spec_from_hf_config(family, tie):
    head_dim = {"head_dim": 16} if family == "qwen3" else {}  # Qwen3's default is 128
    spec = spec_from_hf_config(hf_config(family, rope_theta=123456.0, tie_word_embeddings=tie, **head_dim))
    assert (spec.family, spec.vocab_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (family, 256, 2, 4, 2)
    assert (spec.embed_dim, spec.intermediate_dim, spec.head_dim, spec.max_position_embeddings) == (64, 160, 16, 16384)
    assert (spec.rope_base, spec.norm_eps, spec.rope_scaling) == (123456.0, 1e-5, None)
    assert spec.tie_word_embeddings is tie
    assert spec.attention_bias is (family == "qwen2") and not spec.output_bias
    assert spec.qk_norm is (family == "qwen3")
    assert spec.torch_dtype == "float32"


def test_llama3_rope_scaling_in_both_config_layouts():
    # transformers 5 writes rope_parameters (theta and scaling together); the Hub's files have
    # rope_theta and rope_scaling at the top, older ones with "type" for "rope_type".
    new = spec_from_hf_config(hf_config("llama", tie_word_embeddings=True,
                                        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE}))
    old = {k: v for k, v in hf_config("llama").items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16")
    hub = spec_from_hf_config({**old, "rope_scaling": LLAMA3_ROPE})
    older = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}
    oldest = spec_from_hf_config({**old, "rope_scaling": {**older, "type": "llama3"}})
    assert new.rope_scaling == hub.rope_scaling == oldest.rope_scaling == LLAMA3_ROPE
    assert new.rope_base == hub.rope_base == 500000.0
    assert hub.torch_dtype == "bfloat16"


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_model_config_builds_on_meta_and_matches_transformers(path):
    top = yaml.safe_load(path.read_text())
    assert set(top) - {"pypi", "image_processor"} == {"name", "hf_repo", "checkpoint_dir", "architecture"}
    assert top["name"] == path.stem
    spec = spec_for(architecture=top["architecture"], checkpoint_dir=top["checkpoint_dir"])
    with torch.device("meta"):
        model = build_model(spec, max_seq_len=4096)
        config = transformers.AutoConfig.for_model(**top["architecture"])
        image_text = type(config) in transformers.AutoModelForImageTextToText._model_mapping  # tiny_vl
        reference = (transformers.AutoModelForImageTextToText if image_text and not spec.native else
                     transformers.AutoModelForCausalLM).from_config(config)
    assert all(p.is_meta for p in model.parameters())
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    assert spec.num_params() == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("name, billions", [("llama3_8b", 8.03), ("llama3_70b", 70.6), ("qwen2_5_0_5b", 0.494),
                                            ("mistral", 7.24), ("llama3_2_1b", 1.24), ("qwen2_5_72b", 72.7),
                                            ("qwen3_0_6b", 0.596), ("qwen3_8b", 8.19), ("qwen3_32b", 32.8),
                                            # their published counts (a multimodal model's language model alone)
                                            ("gemma3_27b", 27.0), ("gpt_oss_20b", 20.9), ("gpt_oss_120b", 116.8),
                                            ("qwen3_5_9b", 9.0), ("qwen3_5_27b", 27.0), ("qwen3_5_35b_a3b", 35.0),
                                            ("qwen3_5_122b_a10b", 122.0), ("qwen3_5_397b_a17b", 397.0),
                                            ("deepseek_v3", 671.0), ("llama4_scout", 107.8), ("phi4", 14.7),
                                            ("smollm3_3b", 3.08),
                                            # image-text models whole: Qwen3-VL-8B's 8.77B, gemma-3-27b-it's 27.4B
                                            ("qwen3_vl_8b", 8.77), ("gemma3_27b_vl", 27.4)])
def test_known_sizes(name, billions):
    spec = spec_for(architecture=architecture(MODEL_CONFIGS[0].parent / f"{name}.yaml"), checkpoint_dir=None)
    assert spec.num_params() == pytest.approx(billions * 1e9, rel=0.01)


def test_tiny_config_is_the_embedded_checkpoint():
    planned = spec_for(architecture=architecture(MODEL_CONFIGS[0].parent / "tiny.yaml"), checkpoint_dir=None)
    assert read_spec(tiny_checkpoint_dir()) == planned


def test_tiny_vl_config_counts_the_embedded_image_text_checkpoint():
    from moai_recipes.models.tiny_vision import tiny_vl_checkpoint_dir

    planned = spec_for(architecture=architecture(MODEL_CONFIGS[0].parent / "tiny_vl.yaml"), checkpoint_dir=None)
    made = read_spec(tiny_vl_checkpoint_dir())
    assert planned.reads_images and made.reads_images
    assert (planned.num_params(), planned.parts) == (made.num_params(), made.parts)


def test_scaled_rope_frequencies_equal_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    # The real RoPE of Llama 3.2 1B, on a model with one thin layer.
    arch = {**architecture(MODEL_CONFIGS[0].parent / "llama3_2_1b.yaml"), "num_hidden_layers": 1, "vocab_size": 8,
            "intermediate_size": 8}
    spec = spec_for(architecture=arch, checkpoint_dir=None)
    reference = LlamaRotaryEmbedding(config=transformers.AutoConfig.for_model(**arch)).inv_freq
    assert torch.equal(inverse_frequencies(spec.head_dim, spec.rope_base, spec.rope_scaling), reference)
    linear = {**arch, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    spec = spec_for(architecture=linear, checkpoint_dir=None)
    reference = LlamaRotaryEmbedding(config=transformers.AutoConfig.for_model(**linear)).inv_freq
    assert torch.equal(inverse_frequencies(spec.head_dim, spec.rope_base, spec.rope_scaling), reference)


def test_init_buffers_after_to_empty_restores_rope_caches():
    spec = spec_from_hf_config(hf_config("mistral"))
    eager = build_model(spec, max_seq_len=32)
    with torch.device("meta"):
        model = build_model(spec, max_seq_len=32)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    rope, reference = model.layers[0].attn.pos_embeddings, eager.layers[0].attn.pos_embeddings
    assert torch.equal(rope.cos, reference.cos) and torch.equal(rope.sin, reference.sin)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gpt2"}, "our own layers build llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, not model_type "
                             "'gpt2'; leave model.implementation=auto"),
    (hf_config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type 'yarn'"),
    (hf_config("qwen2", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}), "'dynamic'"),
    ({**hf_config("llama"), "rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}},
     "lacks low_freq"),
    (hf_config("llama", hidden_act="gelu"), "hidden_act='gelu'"),
    (hf_config("llama", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (hf_config("llama", num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    ({"model_type": "llama", "hidden_size": 64}, "missing"),
])
def test_what_our_own_layers_cannot_build_is_refused_by_name_when_forced(config, message):
    with pytest.raises(UserError, match=message):
        spec_from_hf_config(config, implementation="native")


@pytest.mark.parametrize("config", [
    hf_config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
    hf_config("qwen2", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
    hf_config("llama", hidden_act="gelu"), hf_config("llama", partial_rotary_factor=0.5),
], ids=["yarn", "dynamic", "gelu", "partial-rope"])
def test_what_our_own_layers_cannot_build_builds_with_transformers_modules(config):
    spec = spec_from_hf_config(config)
    assert spec.implementation == "transformers" and spec.num_params() == sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config)).parameters())


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gpt-17"}, r"model_type 'gpt-17' is not known to the installed transformers 5\.\d+"),
    ({"model_type": "my_model", "auto_map": {"AutoConfig": "x.MyConfig"}}, "model.trust_remote_code=true"),
    ({"model_type": "llama", "hidden_size": "wide"}, "not one transformers .* accepts"),
    ({**hf_config("llama"), "model_type": "t5"}, "no causal language model in transformers"),
])
def test_what_transformers_cannot_build_is_refused_by_name(config, message):
    with pytest.raises(UserError, match=message):
        spec_from_hf_config(config)


def test_a_sliding_window_is_refused_only_past_it_and_computed_by_transformers_modules_there():
    assert spec_from_hf_config(hf_config("mistral", sliding_window=64), longest=64).native
    assert spec_from_hf_config(hf_config("mistral", sliding_window=64), longest=65).implementation == "transformers"
    mistral = spec_from_hf_config(hf_config("mistral", sliding_window=64), implementation="native", longest=65)
    check_context(mistral, 64, what="max_seq_len=64", fix="")
    with pytest.raises(UserError, match=r"max_seq_len=65 \(65 tokens\) is longer than .* sliding window \(64 tokens"):
        check_context(mistral, 65, what="max_seq_len=65", fix="")
    # Qwen slides only with use_sliding_window, and only from layer max_window_layers on.
    assert spec_from_hf_config(hf_config("qwen2", sliding_window=64)).sliding_window is None
    assert spec_from_hf_config(hf_config("qwen2", use_sliding_window=True, sliding_window=64,
                                         max_window_layers=2)).sliding_window is None
    assert spec_from_hf_config(hf_config("qwen3", use_sliding_window=True, sliding_window=64,
                                         max_window_layers=1)).sliding_window == 64


def test_read_spec_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_spec(tmp_path / "nowhere")
    with pytest.raises(UserError, match="no config.json"):
        read_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_spec(tmp_path)


def test_spec_for_prefers_config_json_of_the_same_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config("llama", num_hidden_layers=3)))
    arch = architecture(MODEL_CONFIGS[0].parent / "llama3_8b.yaml")
    assert spec_for(architecture=arch, checkpoint_dir=tmp_path).num_layers == 3
    with pytest.raises(UserError, match="holds a llama model"):
        spec_for(architecture=architecture(MODEL_CONFIGS[0].parent / "mistral.yaml"), checkpoint_dir=tmp_path)
