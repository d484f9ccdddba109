"""The architecture of a decoder as its Hugging Face config.json describes it, and what we can build of it.

Test: `python -m pytest tests/test_models.py -q`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moai_recipes.errors import UserError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# torchtune's Llama3ScaledRoPE fixes everything in rope_scaling but the factor.
_LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a decoder, as its config.json describes it."""

    family: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    head_dim: int
    max_position_embeddings: int
    rope_base: float
    norm_eps: float
    tie_word_embeddings: bool
    rope_scaling: dict | None
    attention_bias: bool
    torch_dtype: str

    def num_params(self) -> int:
        """Exact parameter count; tied embeddings counted once."""
        d, q, kv = self.embed_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attn + 3 * d * self.intermediate_dim + 2 * d  # + two RMSNorm scales
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + d


def _rope(config: Mapping) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config.json layout."""
    params = config.get("rope_parameters")  # transformers >= 5 folds rope_theta and the scaling into one dict
    if params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = config.get("rope_theta", 10000.0), config.get("rope_scaling")
    if not scaling:
        return float(theta), None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type in (None, "default"):
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def check_supported(spec: ModelSpec) -> None:
    """Raise UserError if torchtune's builders cannot express `spec` exactly."""
    what = f"this {spec.family} checkpoint"
    if spec.family not in SUPPORTED_FAMILIES:
        raise UserError(f"model_type {spec.family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if spec.head_dim * spec.num_heads != spec.embed_dim:
        raise UserError(f"{what} has head_dim={spec.head_dim} != hidden_size/num_attention_heads "
                        f"({spec.embed_dim}/{spec.num_heads}); torchtune's builders cannot express that")
    if spec.num_heads % spec.num_kv_heads:
        raise UserError(f"{what}: num_attention_heads={spec.num_heads} is not a multiple of "
                        f"num_key_value_heads={spec.num_kv_heads}")
    if spec.attention_bias != (spec.family == "qwen2"):
        raise UserError(f"{what} has attention_bias={spec.attention_bias}; torchtune builds q/k/v biases "
                        "for qwen2 only")
    if spec.family == "llama":
        _check_llama_rope(spec)
    elif spec.rope_scaling is not None:
        raise UserError(f"{what} uses rope_scaling {spec.rope_scaling}; torchtune's {spec.family} builder has no "
                        "RoPE scaling. Remove rope_scaling from config.json to train at the original context length")
    if spec.family == "mistral" and spec.tie_word_embeddings:
        raise UserError(f"{what} ties its word embeddings; torchtune's mistral builder cannot")


def _check_llama_rope(spec: ModelSpec) -> None:
    s = spec.rope_scaling
    if s is None:
        if spec.tie_word_embeddings:
            raise UserError("this llama checkpoint ties its word embeddings but has no llama3 rope_scaling; "
                            "torchtune builds tied Llama models only as Llama 3.2 (with scaled RoPE)")
        return
    if s["rope_type"] != "llama3" or "factor" not in s:
        raise UserError(f"llama rope_scaling {s} is not supported; only rope_type 'llama3' (Llama 3.1 / 3.2) is")
    fixed = {k: s.get(k, v) for k, v in _LLAMA3_ROPE_FIXED.items()}
    if fixed != _LLAMA3_ROPE_FIXED:
        raise UserError(f"llama3 rope_scaling {s} is not supported; torchtune fixes {_LLAMA3_ROPE_FIXED}")


def spec_from_hf_config(config: Mapping) -> ModelSpec:
    """A ModelSpec from the fields of a Hugging Face config.json (either transformers 4 or 5 layout)."""
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise UserError(f"the {family} config is missing {', '.join(missing)}; is it a complete config.json?")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        raise UserError(f"this {family} config has hidden_act={config.get('hidden_act')!r}, "
                        f"mlp_bias={config.get('mlp_bias')}; torchtune builds SiLU MLPs without bias")
    if family == "qwen2" and config.get("use_sliding_window", False):
        raise UserError("this qwen2 config has use_sliding_window=true; torchtune has no sliding-window "
                        "attention. Set it to false in config.json (exact for sequences shorter than the window)")
    # Mistral's sliding_window is not applied by torchtune: exact for sequences shorter than the window
    # (4096 for Mistral-7B-v0.1), so it is ignored here rather than refused.
    heads, embed = config["num_attention_heads"], config["hidden_size"]
    theta, scaling = _rope(config)
    spec = ModelSpec(
        family=family, vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, embed_dim=embed,
        intermediate_dim=config["intermediate_size"], head_dim=config.get("head_dim") or embed // heads,
        max_position_embeddings=config.get("max_position_embeddings", 2048), rope_base=theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), rope_scaling=scaling,
        attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
    )
    check_supported(spec)
    return spec


def read_spec(checkpoint_dir: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint folder, from its config.json."""
    path = Path(checkpoint_dir) / "config.json"
    if not Path(checkpoint_dir).is_dir():
        raise UserError(f"checkpoint folder {checkpoint_dir} does not exist; set model.checkpoint_dir "
                        "to a Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    if not path.is_file():
        raise UserError(f"{checkpoint_dir} has no config.json; model.checkpoint_dir must be a Hugging Face "
                        "model folder (config.json, *.safetensors, tokenizer files)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); download the checkpoint again") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object; download the checkpoint again")
    return spec_from_hf_config(config)


def spec_for(*, architecture: Mapping, checkpoint_dir: str | Path | None) -> ModelSpec:
    """The spec of a `model` config entry: checkpoint_dir/config.json when given, else its `architecture`.

    Without files the planner can still plan a 70B run. With a folder, its config.json is the truth,
    but it must be of the family the model name promises.
    """
    named = spec_from_hf_config(architecture)
    return named if checkpoint_dir is None else same_family(read_spec(checkpoint_dir), named, checkpoint_dir)


def same_family(spec: ModelSpec, named: ModelSpec, folder: str | Path) -> ModelSpec:
    """`spec` (a checkpoint folder's), or a UserError when it is not of the family of the model name's `named`."""
    if spec.family != named.family:
        raise UserError(f"{folder} holds a {spec.family} model, but the chosen model config is {named.family}; "
                        f"pick a {spec.family} model name (moai ls lists them)")
    return spec
