"""The architecture of a decoder as its Hugging Face config.json describes it, and which code builds it.

Two implementations fill one interface (models/build.build_model): our native layers (models/build.py, torchtune's
modules) for the Llama, Mistral and Qwen lineage, where they are measured faster, and transformers' own modules
(models/transformers_model.py) for any other decoder-only causal LM the installed transformers builds. `auto` takes
the native layers where they build the config exactly and transformers' otherwise. A spec of transformers' modules
carries its config.json (what it is rebuilt from, in any process) and its exact parameter counts by part (`Parts`),
counted on the model built on the meta device: what the planner needs of an architecture it has no formula for.

Test: `python -m pytest tests/test_models.py tests/test_architectures.py -q`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from moai_recipes.errors import UserError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")  # our native layers build these
IMPLEMENTATIONS = ("auto", "native", "transformers")
MOE_FAMILIES = ("qwen3_moe", "mixtral")  # Mixture-of-Experts: some layers' MLP is routed experts (models/moe.py)
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Parts:
    """A model's parameters counted where they are, exactly, on the model built on the meta device (transformers'
    modules: the planner's memory and time models need them of architectures it has no formula for)."""

    root: int  # outside the decoder layers: embeddings (per-layer ones too), the final norm, the output (once if tied)
    layers: tuple[int, ...]  # each decoder layer's
    active_layers: tuple[int, ...]  # what one token computes with of each layer (a sparse layer: its top-k experts)
    kinds: tuple[str, ...]  # each layer's kind: its mixer, its MLP and its shapes (e.g. "full_attention, dense")
    tensors: int  # parameter tensors in all (each costs the optimizer a call)
    output: int  # the output projection's own (0 when tied to the embedding)
    layer_tensors: tuple[int, ...] = ()  # each decoder layer's parameter tensors
    # Why documents cannot share a row (a token mixer whose state would cross from one to the next); None: they can.
    unpackable: str | None = None
    routed: tuple[int, ...] = ()  # each layer's routed experts' parameters (0 for a dense one)
    experts_dispatchable: bool = False  # its experts take tokens by transformers' experts interface (expert parallelism)

    def representative(self, kind: str) -> int:
        """The first layer of a kind (the one the planner traces)."""
        return self.kinds.index(kind)


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
    # Mixture-of-Experts (qwen3_moe, mixtral): the layers `moe_layers` replace their MLP with `num_experts` SwiGLU
    # experts of `expert_dim` (moe_intermediate_size), each token sent to the `experts_per_token` a linear router
    # scores highest (softmax, top-k, renormalised with `norm_topk_prob`). The other layers keep a dense MLP of
    # intermediate_dim. The load-balancing loss is added with `router_aux_loss_coef`.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_dim: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    # Which code builds it (IMPLEMENTATIONS): "native" (models/build.py) or "transformers" (transformers' own modules,
    # models/transformers_model.py), the latter with its config.json (canonical JSON: what every process rebuilds it
    # from), the folder of its remote code where the user trusts it (model.trust_remote_code), its counts by part.
    implementation: str = "native"
    hf_config: str = ""
    code_dir: str | None = None
    parts: Parts | None = None
    # An image-text model (Qwen2.5-VL, Gemma 3...): its rows hold images, read by its processor (data/images.py).
    reads_images: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def native(self) -> bool:
        return self.implementation == "native"

    @property
    def mxfp4(self) -> bool:
        """Whether its checkpoints hold the experts in MXFP4 (gpt-oss's: dequantized to bf16 on load)."""
        return '"quant_method": "mxfp4"' in self.hf_config

    @property
    def why_not_packed(self) -> str | None:
        """Why this model's rows cannot hold several documents (None: they can, each attending to itself)."""
        return self.parts.unpackable if self.parts is not None else None

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        """Weights of a layer's MLP: dense, or its router and experts (`active`: the top-k experts a token uses)."""
        return self._sparse_mlp_params(active) if layer in self.moe_layers else 3 * self.embed_dim * self.intermediate_dim

    def _sparse_mlp_params(self, active: bool) -> int:
        experts = self.experts_per_token if active else self.num_experts
        return self.embed_dim * self.num_experts + experts * 3 * self.embed_dim * self.expert_dim

    def mean_mlp_params(self, *, active: bool = False) -> float:
        """A layer's MLP weights, averaged over the layers (dense and sparse alike). Counted by kind of layer, not
        layer by layer: the planner asks for each of its candidates (70B on 48xlarge: 98,000 times over 80 layers)."""
        sparse = self._sparse_layers
        dense = self.num_layers - sparse
        return (dense * 3 * self.embed_dim * self.intermediate_dim
                + sparse * self._sparse_mlp_params(active)) / self.num_layers

    @functools.cached_property
    def _sparse_layers(self) -> int:
        return len({i for i in self.moe_layers if 0 <= i < self.num_layers})

    @functools.cached_property
    def key(self) -> str:
        """The spec written out (repr), once: what the planner's traces are keyed by (planner/activations.py), asked
        for hundreds of thousands of times in a large search. Not a hash: rope_scaling is a dict."""
        return repr(self)

    def num_params(self, *, active: bool = False) -> int:
        """Exact parameter count; tied embeddings counted once. `active`: those one token computes with (a
        Mixture-of-Experts layer's top-k experts, not all of them)."""
        if self.parts is not None:
            return self.parts.root + sum(self.parts.active_layers if active else self.parts.layers)
        d, q, kv = self.embed_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if self.attention_bias else 0) + (d if self.output_bias else 0)
        layer = attn + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        mlps = sum(self.mlp_params(i, active=active) for i in range(self.num_layers))
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + mlps + d

    @functools.cached_property  # each of a search's candidates carries it
    def attention_length(self) -> int:
        """The length of a document whose attention costs as many FLOPs as the rest of its layers' work: per
        token, 6 per weight of a layer that it computes with (forward and backward); per pair of tokens, 12 per
        query dimension (the scores and the weighted sum, forward and backward). A document of n tokens costs
        n x (1 + n / this)."""
        d, q, kv = self.embed_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.parts is not None:
            weights = sum(self.parts.active_layers) / self.num_layers
        else:
            weights = 2 * d * q + 2 * d * kv + self.mean_mlp_params(active=True)
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
    if spec.is_moe and not 0 < spec.experts_per_token <= spec.num_experts:
        raise UserError(f"{what} routes each token to num_experts_per_tok={spec.experts_per_token} of "
                        f"{spec.num_experts} experts; it must be between 1 and the number of experts")
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


def spec_from_hf_config(config: Mapping, *, implementation: str = "auto", trust_remote_code: bool = False,
                        folder: str | Path | None = None, longest: int | None = None) -> ModelSpec:
    """A ModelSpec from the fields of a Hugging Face config.json (either transformers 4 or 5 layout), built by
    `implementation` (IMPLEMENTATIONS; auto: our native layers where they build it exactly, else transformers'
    modules). `folder` holds the config (a model's remote code lives there); `longest`: the longest row a run will
    have (a sliding window our layers do not compute matters only past it). What nothing here can build is a
    UserError naming why."""
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"model.implementation={implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    family = config.get("model_type")
    if implementation != "transformers" and family in SUPPORTED_FAMILIES:
        try:
            spec = _native_spec(config)
            # A sliding window our layers would compute as full attention, on rows longer than it: transformers'
            # modules compute it (forced native, check_context refuses such rows).
            window = spec.sliding_window
            if implementation == "native" or window is None or longest is None or longest <= window:
                return spec
        except UserError:
            if implementation == "native":
                raise
    elif implementation == "native":
        raise UserError(f"model.implementation=native: our own layers build {', '.join(SUPPORTED_FAMILIES)}, not "
                        f"model_type {family!r}; leave model.implementation=auto to train it with transformers' modules")
    from moai_recipes.models.transformers_model import transformers_spec

    return transformers_spec(config, trust_remote_code=trust_remote_code, folder=folder)


def _native_spec(config: Mapping) -> ModelSpec:
    """The spec of a config our native layers (models/build.py) build; anything they cannot is a UserError naming the
    field."""
    family = config.get("model_type")
    if family in _SHARED_EXPERT_FAMILIES:
        raise UserError(f"model_type {family!r} has shared experts beside its routed ones "
                        f"(shared_expert_intermediate_size / n_shared_experts), which our own layers do not build")
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise UserError(f"the {family} config is missing {', '.join(missing)}; is it a complete config.json?")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        raise UserError(f"this {family} config has hidden_act={config.get('hidden_act')!r}, "
                        f"mlp_bias={config.get('mlp_bias')}; our own layers build SiLU MLPs without bias")
    partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(f"this {family} config has partial_rotary_factor={partial}; our own layers rotate the whole "
                        "head")
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
        qk_norm=family in ("qwen3", "qwen3_moe"), sliding_window=_sliding_window(family, config),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        **(_experts(family, config) if family in MOE_FAMILIES else {}),
    )
    check_supported(spec)
    return spec


# Mixture-of-Experts families whose layers also hold shared (always active) experts: not built here.
_SHARED_EXPERT_FAMILIES = ("qwen2_moe", "deepseek_v2", "deepseek_v3", "qwen3_next")


def _experts(family: str, config: Mapping) -> dict:
    """A Mixture-of-Experts config's routed experts, as transformers reads them: Qwen3-MoE's num_experts,
    moe_intermediate_size, decoder_sparse_step and mlp_only_layers (the others dense); Mixtral's num_local_experts
    of intermediate_size in every layer, top-k always renormalised. What transformers would compute and we cannot
    (router jitter, shared experts) is refused by name."""
    what = f"this {family} config"
    if float(config.get("router_jitter_noise") or 0.0) > 0:
        raise UserError(f"{what} has router_jitter_noise={config['router_jitter_noise']}: a router that multiplies "
                        "its inputs by random noise while training is not supported; set it to 0 in config.json")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if config.get(key):
            raise UserError(f"{what} has {key}={config[key]}: shared experts beside the routed ones are not supported")
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        raise UserError(f"{what} names no experts (num_experts / num_local_experts); is it a complete config.json?")
    layers = config["num_hidden_layers"]
    if family == "mixtral":
        sparse, expert_dim, norm_topk = tuple(range(layers)), config["intermediate_size"], True
    else:
        if "moe_intermediate_size" not in config:
            raise UserError(f"{what} is missing moe_intermediate_size; is it a complete config.json?")
        step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        expert_dim, norm_topk = config["moe_intermediate_size"], bool(config.get("norm_topk_prob", False))
    top_k = config.get("num_experts_per_tok") or (2 if family == "mixtral" else 8)  # transformers' defaults
    return {"num_experts": int(experts), "experts_per_token": int(top_k),
            "expert_dim": int(expert_dim), "norm_topk_prob": norm_topk, "moe_layers": sparse,
            "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001))}


def _sliding_window(family: str, config: Mapping) -> int | None:
    """The window config.json turns on: Mistral's sliding_window; Qwen's only with use_sliding_window, and only
    where some layer slides (those from max_window_layers on)."""
    window = config.get("sliding_window")
    if not window:
        return None
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        if not config.get("use_sliding_window", False):
            return None
        if config.get("max_window_layers", 0) >= config["num_hidden_layers"]:
            return None  # Qwen slides only from layer max_window_layers on: here, on none
    return int(window)


def with_aux_loss_coef(spec: ModelSpec, coef: float | None) -> ModelSpec:
    """`spec` with the load-balancing loss weighted by `coef` (None: as config.json says)."""
    if coef is None:
        return spec
    if not spec.is_moe:
        raise UserError(f"model.router_aux_loss_coef={coef} weighs a Mixture-of-Experts model's load-balancing loss, "
                        f"and this {spec.family} model has no experts; leave it out")
    if coef < 0:
        raise UserError(f"model.router_aux_loss_coef={coef} is negative; use 0 (no balancing loss) or more")
    return replace(spec, router_aux_loss_coef=float(coef))


def read_config(checkpoint_dir: str | Path) -> dict:
    """A Hugging Face checkpoint folder's config.json."""
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
    return config


def read_spec(checkpoint_dir: str | Path, *, implementation: str = "auto", trust_remote_code: bool = False,
              longest: int | None = None) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint folder, from its config.json."""
    return spec_from_hf_config(read_config(checkpoint_dir), implementation=implementation,
                               trust_remote_code=trust_remote_code, folder=checkpoint_dir, longest=longest)


def spec_for(*, architecture: Mapping, checkpoint_dir: str | Path | None, any_family: bool = False,
             implementation: str = "auto", trust_remote_code: bool = False, longest: int | None = None) -> ModelSpec:
    """The spec of a `model` config entry: checkpoint_dir/config.json when given, else its `architecture`.

    Without files the planner can still plan a 70B run. With a folder, its config.json is the truth, but it must
    be of the family the model name promises; `any_family`: the name promises none (the default, the tiny demo
    model: a folder given without naming a model is taken for what its config.json says).
    """
    how = dict(implementation=implementation, trust_remote_code=trust_remote_code, longest=longest)
    if checkpoint_dir is None:
        return spec_from_hf_config(architecture, **how)
    config = read_config(checkpoint_dir)
    if not any_family:
        same_family(config.get("model_type"), architecture.get("model_type"), checkpoint_dir)
    return spec_from_hf_config(config, folder=checkpoint_dir, **how)


def same_family(family: str | None, named: str | None, folder: str | Path) -> None:
    """A UserError when a checkpoint folder's model_type is not the family of the model name's (a multimodal
    config's language model, gemma3 against gemma3_text, is the same family)."""
    if str(family).removesuffix("_text") != str(named).removesuffix("_text"):
        raise UserError(f"{folder} holds a {family} model, but the chosen model config is {named}; "
                        f"pick a {family} model name (moai ls lists them), or leave the model name out")
