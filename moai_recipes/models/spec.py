"""The architecture of a decoder as its Hugging Face config.json describes it, and what we can build of it.

Test: `python -m pytest tests/test_models.py -q`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moai_recipes.errors import UserError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    rope_scaling: dict | None  # {"rope_type": "linear" | "llama3", ...}; None: plain RoPE
    attention_bias: bool  # biases on the q, k and v projections
    torch_dtype: str
    output_bias: bool = False  # a bias on the attention's output projection too (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # tokens a position attends back to, where the config turns it on

    def num_params(self) -> int:
        """Exact parameter count; tied embeddings counted once."""
        d, q, kv = self.embed_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if self.attention_bias else 0) + (d if self.output_bias else 0)
        layer = attn + 3 * d * self.intermediate_dim + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + d

    @property
    def attention_length(self) -> int:
        """The length of a document whose attention costs as many FLOPs as the rest of its layers' work: per
        token, 6 per weight of a layer (forward and backward); per pair of tokens, 12 per query dimension (the
        scores and the weighted sum, forward and backward). A document of n tokens costs n x (1 + n / this)."""
        d, q, kv = self.embed_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        weights = 2 * d * q + 2 * d * kv + 3 * d * self.intermediate_dim
        return max(1, round(6 * weights / (12 * q)))


def _rope(config: Mapping) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config.json layout."""
    # transformers >= 5 folds rope_theta and the scaling into `rope_parameters`; where a config.json also carries the
    # legacy `rope_scaling`, transformers takes that one (`rope_scaling or rope_parameters`), with rope_theta from it
    # or from the top level: so do we, or we would train another model than the one the user has.
    params = config.get("rope_scaling") or config.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta, scaling = config.get("rope_theta", 10000.0), None
    if not scaling:
        return float(theta), None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type in (None, "default"):
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def check_supported(spec: ModelSpec) -> None:
    """Raise UserError, naming the field, if the model layer (models/build.py) cannot build `spec` exactly."""
    from moai_recipes.models.rope import ROPE_TYPES

    what = f"this {spec.family} checkpoint"
    if spec.family not in SUPPORTED_FAMILIES:
        raise UserError(f"model_type {spec.family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if spec.num_heads % spec.num_kv_heads:
        raise UserError(f"{what}: num_attention_heads={spec.num_heads} is not a multiple of "
                        f"num_key_value_heads={spec.num_kv_heads}")
    if spec.head_dim % 2:
        raise UserError(f"{what} has an odd head_dim={spec.head_dim}; RoPE rotates pairs of dimensions")
    s = spec.rope_scaling
    if s is None:
        return
    if s["rope_type"] not in ROPE_TYPES:
        raise UserError(f"{what} asks for rope_type {s['rope_type']!r} RoPE scaling, which is not supported "
                        f"(supported: {', '.join(ROPE_TYPES)}); remove the scaling from config.json to train at the "
                        "original context length")
    needed = _LLAMA3_ROPE_KEYS if s["rope_type"] == "llama3" else ("factor",)
    missing = [k for k in needed if not isinstance(s.get(k), (int, float))]
    if missing:
        raise UserError(f"{what}: its {s['rope_type']} rope_scaling {s} lacks {', '.join(missing)}")


def check_context(spec: ModelSpec, tokens: int, *, what: str, fix: str) -> None:
    """UserError when `what`, a sequence of `tokens`, would reach past the sliding window config.json turns on:
    attention here covers the whole sequence, which is exact only within the window."""
    if spec.sliding_window is not None and tokens > spec.sliding_window:
        raise UserError(f"{what} ({tokens} tokens) is longer than this {spec.family} model's sliding window "
                        f"({spec.sliding_window} tokens, config.json sliding_window), and sliding-window attention is "
                        f"not supported: {fix}")


def spec_from_hf_config(config: Mapping) -> ModelSpec:
    """A ModelSpec from the fields of a Hugging Face config.json (either transformers 4 or 5 layout); anything it
    asks that we cannot build is a UserError naming the field."""
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise UserError(f"the {family} config is missing {', '.join(missing)}; is it a complete config.json?")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        raise UserError(f"this {family} config has hidden_act={config.get('hidden_act')!r}, "
                        f"mlp_bias={config.get('mlp_bias')}; only SiLU MLPs without bias are supported")
    partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(f"this {family} config has partial_rotary_factor={partial}; only RoPE over the whole head "
                        "is supported")
    heads, embed = config["num_attention_heads"], config["hidden_size"]
    theta, scaling = _rope(config)
    # Qwen2 has biases on q, k and v only; Llama, Mistral and Qwen3 put attention_bias on o_proj too.
    qkv_bias = family == "qwen2" or bool(config.get("attention_bias", False))
    spec = ModelSpec(
        family=family, vocab_size=config["vocab_size"], num_layers=config["num_hidden_layers"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, embed_dim=embed,
        intermediate_dim=config["intermediate_size"], head_dim=config.get("head_dim") or embed // heads,
        max_position_embeddings=config.get("max_position_embeddings", 2048), rope_base=theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), rope_scaling=scaling,
        attention_bias=qkv_bias, output_bias=family != "qwen2" and bool(config.get("attention_bias", False)),
        qk_norm=family == "qwen3", sliding_window=_sliding_window(family, config),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
    )
    check_supported(spec)
    return spec


def _sliding_window(family: str, config: Mapping) -> int | None:
    """The window config.json turns on: Mistral's sliding_window; Qwen's only with use_sliding_window, and only
    where some layer slides (those from max_window_layers on)."""
    window = config.get("sliding_window")
    if not window:
        return None
    if family in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None
        if config.get("max_window_layers", 0) >= config["num_hidden_layers"]:
            return None  # Qwen slides only from layer max_window_layers on: here, on none
    return int(window)


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


def spec_for(*, architecture: Mapping, checkpoint_dir: str | Path | None, any_family: bool = False) -> ModelSpec:
    """The spec of a `model` config entry: checkpoint_dir/config.json when given, else its `architecture`.

    Without files the planner can still plan a 70B run. With a folder, its config.json is the truth, but it must
    be of the family the model name promises; `any_family`: the name promises none (the default, the tiny demo
    model: a folder given without naming a model is taken for what its config.json says).
    """
    named = spec_from_hf_config(architecture)
    if checkpoint_dir is None:
        return named
    spec = read_spec(checkpoint_dir)
    return spec if any_family else same_family(spec, named, checkpoint_dir)


def same_family(spec: ModelSpec, named: ModelSpec, folder: str | Path) -> ModelSpec:
    """`spec` (a checkpoint folder's), or a UserError when it is not of the family of the model name's `named`."""
    if spec.family != named.family:
        raise UserError(f"{folder} holds a {spec.family} model, but the chosen model config is {named.family}; "
                        f"pick a {spec.family} model name (moai ls lists them)")
    return spec
