"""torchtune decoders built from a ModelSpec, and the pieces of them the recipes reach into.

Build on the meta device, then give memory:

    with torch.device("meta"):
        model = build_model(spec, max_seq_len=4096)
    ... shard ...; model.to_empty(device=device); init_buffers(model, device=device)

Test: `python -m pytest tests/test_models.py -q`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from moai_recipes.models.attention import use_document_attention
from moai_recipes.models.spec import ModelSpec, check_supported

if TYPE_CHECKING:  # importing torchtune takes seconds; the planner needs specs only
    from torchtune.modules import TransformerDecoder


def build_model(spec: ModelSpec, *, max_seq_len: int, lora: dict | None = None,
                quantize_base: bool = False) -> TransformerDecoder:
    """Build the torchtune decoder for `spec` (allocates only on the current device; use meta).

    `max_seq_len` is the length of the RoPE cache. `lora` (LoraOptions.builder_kwargs()) builds the
    same architecture with torchtune's LoRA builders: adapters on the chosen modules. `quantize_base`
    (QLoRA, with `lora` only) keeps the frozen linear weights of the layers as NF4Tensors
    (see nf4_weights for which).
    """
    from torchtune.models import llama3, llama3_1, llama3_2, mistral, qwen2

    check_supported(spec)
    common = dict(vocab_size=spec.vocab_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
                  num_kv_heads=spec.num_kv_heads, embed_dim=spec.embed_dim, intermediate_dim=spec.intermediate_dim,
                  max_seq_len=max_seq_len, norm_eps=spec.norm_eps, rope_base=spec.rope_base)

    def builder(module, name: str):
        return getattr(module, f"lora_{name}") if lora is not None else getattr(module, name)

    assert lora is not None or not quantize_base, "NF4 base weights come with LoRA builders only"
    if lora is not None:
        common.update(lora, quantize_base=quantize_base)
    if spec.family == "qwen2":
        model = builder(qwen2, "qwen2")(**common, tie_word_embeddings=spec.tie_word_embeddings)
    elif spec.family == "mistral":
        model = builder(mistral, "mistral")(**common)
    elif spec.rope_scaling is None:
        model = builder(llama3, "llama3")(**common)
    elif spec.tie_word_embeddings:
        model = builder(llama3_2, "llama3_2")(**common, scale_factor=spec.rope_scaling["factor"],
                                              tie_word_embeddings=True)
    else:
        model = builder(llama3_1, "llama3_1")(**common, scale_factor=spec.rope_scaling["factor"])
    use_document_attention(model)  # packed rows (models/attention.py); padded rows as torchtune computes them
    if quantize_base:
        # torchtune's QLoRA builders add a hook that dequantizes every NF4 weight whenever state_dict() is
        # called (for torchtune's own checkpointer). Ours never needs it: step checkpoints keep the adapters
        # only and the merged export dequantizes one weight at a time; the hook would only cost memory.
        model._state_dict_hooks.clear()
    return model


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a local tensor, not a DTensor) is a QLoRA base weight in NF4 (torchao's NF4Tensor)."""
    from torchao.dtypes.nf4tensor import (
        NF4Tensor,  # loaded with torchtune's builders already
    )

    return isinstance(tensor, NF4Tensor)


def nf4_weights(spec: ModelSpec, opts) -> dict[str, tuple[tuple[int, int], str]]:
    """The weights of each layer that torchtune's QLoRA builders keep in NF4: module -> (shape, its dims).

    Llama and Mistral: every linear of the layer, adapted or not. Qwen2: only the adapted ones.
    Never the embeddings, the norms or the output projection. `opts`: the LoRA options (lora.LoraOptions).
    """
    d, i = spec.embed_dim, spec.intermediate_dim
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = f"hidden_size={d}", f"intermediate_size={i}"
    weights = {"attn.q_proj": ((q, d), f"num_attention_heads*head_dim={q}, {hidden}"),
               "attn.k_proj": ((kv, d), f"num_key_value_heads*head_dim={kv}, {hidden}"),
               "attn.v_proj": ((kv, d), f"num_key_value_heads*head_dim={kv}, {hidden}"),
               "attn.output_proj": ((d, q), f"{hidden}, num_attention_heads*head_dim={q}"),
               "mlp.w1": ((i, d), f"{inter}, {hidden}"), "mlp.w2": ((d, i), f"{hidden}, {inter}"),
               "mlp.w3": ((i, d), f"{inter}, {hidden}")}
    if spec.family != "qwen2":
        return weights
    adapted = set(opts.attn_modules) | ({"w1", "w2", "w3"} if opts.apply_to_mlp else set())
    return {m: w for m, w in weights.items() if m.split(".")[1] in adapted}


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
    """Recompute the RoPE caches on `device` after `to_empty` (they are not in any checkpoint)."""
    # rope_init allocates on the default device, so it must run under the target one.
    with torch.device(device):
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()
