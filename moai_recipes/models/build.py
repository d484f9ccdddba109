"""Decoders composed from torchtune's modules as a config.json describes them (a ModelSpec), and the pieces
of them the recipes reach into.

Not torchtune's fixed-size model builders: every layer is put together here from its modules
(MultiHeadAttention, FeedForward, RMSNorm, TransformerDecoder, LoRALinear, FrozenNF4Linear), so any
checkpoint of the Llama, Mistral, Qwen2 and Qwen3 lineage builds: tied or untied embeddings, any RoPE
rope.py computes, q/k/v biases, per-head q/k RMSNorm, any head_dim and grouped-query ratio, and the
Mixture-of-Experts Qwen3-MoE and Mixtral, whose sparse layers' MLP is models/moe.py's MoE. Weights keep
the Hugging Face layout (rope.py rotates halves), so the names in hf_format.py are the only mapping.

Build on the meta device, then give memory:

    with torch.device("meta"):
        model = build_model(spec, max_seq_len=4096)
    ... shard ...; model.to_empty(device=device); init_buffers(model, device=device)

Test: `python -m pytest tests/test_models.py -q` (against transformers: tests/test_real_configs.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from moai_recipes.models.attention import use_document_attention
from moai_recipes.models.moe import MoE
from moai_recipes.models.rope import RotaryEmbedding
from moai_recipes.models.spec import ModelSpec, check_supported

if TYPE_CHECKING:  # importing torchtune takes seconds; the planner needs specs only
    from torchtune.modules import TransformerDecoder


def build_model(spec: ModelSpec, *, max_seq_len: int, lora: dict | None = None,
                quantize_base: bool = False) -> TransformerDecoder:
    """The torchtune decoder of `spec` (allocates only on the current device; use meta).

    `max_seq_len` is the length of the RoPE tables. `lora` (LoraOptions.builder_kwargs()) puts adapters on
    the chosen linears (torchtune's LoRALinear). `quantize_base` (QLoRA, with `lora` only) keeps every
    linear weight of the layers in NF4, adapted or not (see nf4_weights); never the embeddings, norms or
    output.
    """
    if not spec.native:  # transformers' own modules (models/transformers_model.py)
        from moai_recipes.models.transformers_model import model_of

        assert lora is not None or not quantize_base, "NF4 base weights come with LoRA only"
        return model_of(spec, lora=lora, quantize_base=quantize_base)
    from torchtune.modules import RMSNorm, TiedLinear, TransformerDecoder

    check_supported(spec)
    assert lora is not None or not quantize_base, "NF4 base weights come with LoRA only"
    linears = _Linears(lora, quantize_base)
    d = spec.embed_dim
    embeddings = nn.Embedding(spec.vocab_size, d)
    # One RoPE for every layer (as torchtune's builders share theirs): its cos and sin tables cover max_seq_len
    # positions, and a copy per layer held L of them (SmolLM2 at a 20,480-token row: 300 MB of a 1.3 GB peak).
    rope = RotaryEmbedding(spec.head_dim, max_seq_len=max_seq_len, base=spec.rope_base, scaling=spec.rope_scaling)
    layers = nn.ModuleList(_layer(spec, linears, rope, max_seq_len, i) for i in range(spec.num_layers))
    output = (TiedLinear(embeddings) if spec.tie_word_embeddings else
              linears("output", d, spec.vocab_size, quantize=False))
    model = TransformerDecoder(tok_embeddings=embeddings, layers=layers, max_seq_len=max_seq_len,
                               num_heads=spec.num_heads, head_dim=spec.head_dim, norm=RMSNorm(d, eps=spec.norm_eps),
                               output=output)
    use_document_attention(model)  # packed rows (models/attention.py); padded rows as torchtune computes them
    return model


def _layer(spec: ModelSpec, linears: _Linears, rope: nn.Module, max_seq_len: int, index: int) -> nn.Module:
    from torchtune.modules import (
        FeedForward,
        MultiHeadAttention,
        RMSNorm,
        TransformerSelfAttentionLayer,
    )

    d, h, q, kv = spec.embed_dim, spec.head_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    q_proj = linears("q_proj", d, q, bias=spec.attention_bias)
    k_proj = linears("k_proj", d, kv, bias=spec.attention_bias)
    if spec.qk_norm:
        _norm_heads(q_proj, RMSNorm(h, eps=spec.norm_eps), h)
        _norm_heads(k_proj, RMSNorm(h, eps=spec.norm_eps), h)
    attn = MultiHeadAttention(
        embed_dim=d, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=h, q_proj=q_proj,
        k_proj=k_proj, v_proj=linears("v_proj", d, kv, bias=spec.attention_bias),
        output_proj=linears("output_proj", q, d, bias=spec.output_bias),
        pos_embeddings=rope,
        max_seq_len=max_seq_len)
    if index in spec.moe_layers:
        adapters = linears.lora if linears.lora and linears.lora.get("apply_lora_to_experts") else None
        mlp = MoE(dim=d, hidden_dim=spec.expert_dim, num_experts=spec.num_experts, top_k=spec.experts_per_token,
                  norm_topk_prob=spec.norm_topk_prob, scores_in_fp32=spec.family == "mixtral", layer=index,
                  rank=adapters["lora_rank"] if adapters else 0, alpha=adapters["lora_alpha"] if adapters else 0.0,
                  quantize=linears.quantize_base)
    else:
        i = spec.intermediate_dim
        mlp = FeedForward(gate_proj=linears("w1", d, i), down_proj=linears("w2", i, d), up_proj=linears("w3", d, i))
    return TransformerSelfAttentionLayer(attn=attn, mlp=mlp, sa_norm=RMSNorm(d, eps=spec.norm_eps),
                                         mlp_norm=RMSNorm(d, eps=spec.norm_eps))


class _Linears:
    """Makes each linear of the model: plain, LoRA-adapted where the options say, NF4 under QLoRA."""

    def __init__(self, lora: dict | None, quantize_base: bool):
        self.lora, self.quantize_base = lora, quantize_base
        self.adapted = set()
        if lora is not None:
            self.adapted = set(lora["lora_attn_modules"]) | ({"w1", "w2", "w3"} if lora["apply_lora_to_mlp"] else set())
            self.adapted |= {"output"} if lora["apply_lora_to_output"] else set()

    def __call__(self, name: str, in_dim: int, out_dim: int, *, bias: bool = False, quantize: bool = True) -> nn.Module:
        from torchtune.modules.low_precision import FrozenNF4Linear
        from torchtune.modules.peft import LoRALinear

        nf4 = self.quantize_base and quantize
        if name in self.adapted:
            o = self.lora
            return LoRALinear(in_dim, out_dim, rank=o["lora_rank"], alpha=o["lora_alpha"], dropout=o["lora_dropout"],
                              use_bias=bias, quantize_base=nf4)
        return FrozenNF4Linear(in_dim, out_dim, bias=bias) if nf4 else nn.Linear(in_dim, out_dim, bias=bias)


def _norm_heads(proj: nn.Module, norm: nn.Module, head_dim: int) -> None:
    """Qwen3's q/k norm: RMSNorm over each head of the projection's output, before RoPE as in transformers.

    torchtune's MultiHeadAttention applies its q_norm/k_norm after RoPE, which is not the same function (the
    norm's scale does not commute with the rotation), so the norm runs as a forward hook of the projection
    instead. It is the projection's child `head_norm`: saved, sharded and frozen (LoRA) with it, and named
    self_attn.q_norm / k_norm in the checkpoint (hf_format.py)."""
    proj.head_norm = norm

    def normed(module, args, out):
        return module.head_norm(out.unflatten(-1, (-1, head_dim))).flatten(-2)

    proj.register_forward_hook(normed)


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a local tensor, not a DTensor) is a QLoRA base weight in NF4 (torchao's NF4Tensor)."""
    from torchao.dtypes.nf4tensor import (
        NF4Tensor,  # loaded with torchtune's builders already
    )

    return isinstance(tensor, NF4Tensor)


def nf4_weights(spec: ModelSpec, opts) -> dict[str, tuple[tuple[int, int], str]]:
    """The weights of each layer that QLoRA keeps in NF4: module -> (shape, its dims). Every linear of the layer,
    adapted or not; never the embeddings, the norms or the output projection. `opts`: lora.LoraOptions (the same
    for any targets, kept for callers that may narrow it)."""
    d, i = spec.embed_dim, spec.intermediate_dim
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = f"hidden_size={d}", f"intermediate_size={i}"
    weights = {"attn.q_proj": ((q, d), f"num_attention_heads*head_dim={q}, {hidden}"),
               "attn.k_proj": ((kv, d), f"num_key_value_heads*head_dim={kv}, {hidden}"),
               "attn.v_proj": ((kv, d), f"num_key_value_heads*head_dim={kv}, {hidden}"),
               "attn.output_proj": ((d, q), f"{hidden}, num_attention_heads*head_dim={q}")}
    if len(spec.moe_layers) < spec.num_layers:  # dense MLPs
        weights.update({"mlp.w1": ((i, d), f"{inter}, {hidden}"), "mlp.w2": ((d, i), f"{hidden}, {inter}"),
                        "mlp.w3": ((i, d), f"{inter}, {hidden}")})
    if spec.is_moe:  # a sparse layer's experts, each projection stacked and held as [E x out, in] (GroupedExperts)
        e, x = spec.num_experts, spec.expert_dim
        stacked = f"num_experts={e} x moe_intermediate_size={x}"
        weights.update({"mlp.experts.w1": ((e * x, d), f"{stacked}, {hidden}"),
                        "mlp.experts.w3": ((e * x, d), f"{stacked}, {hidden}"),
                        "mlp.experts.w2": ((e * d, x), f"num_experts={e} x {hidden}, moe_intermediate_size={x}")})
    return weights


@contextmanager
def head_skipped(model: torch.nn.Module):
    """Within it, the decoder returns the last layer's hidden states instead of logits, so that the loss
    can run the final norm and the output projection chunk by chunk (loss.chunked_cross_entropy_sum).
    torchtune's TransformerDecoder.forward ends with `self.unembed(h)` (norm, then output): skipped here.
    The modules stay the same objects (FSDP2's hooks, which gather the norm and output with the root, stay)."""
    model.unembed = lambda h: h  # a function on the instance shadows the method
    try:
        yield model
    finally:
        del model.unembed


def init_buffers(model: torch.nn.Module, *, device: torch.device | str) -> None:
    """Recompute the RoPE caches on `device` after `to_empty` (they are not in any checkpoint); transformers'
    modules get back the buffers they computed when built."""
    if hasattr(model, "_initial_buffers"):
        from moai_recipes.models.transformers_model import restore_buffers

        restore_buffers(model, device)
        return
    # rope_init allocates on the default device, so it must run under the target one.
    with torch.device(device):
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()
