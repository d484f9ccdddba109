"""Tiny random checkpoints of the architectures people fine-tune now, written by the installed transformers from its
own config classes: each scaled down to a few layers of width 64 but keeping what makes the architecture itself
(layer kinds and their pattern, windows short enough to matter on test rows, sinks, soft-capping, shared experts,
latent attention, NoPE layers, per-layer inputs, tied embeddings).

`ARCHITECTURES`: name -> (model_type, config fields). `make_checkpoint(folder, name)` writes one with the test
tokenizer, its norms and biases perturbed so that a misplaced weight shows.
"""

import json
from pathlib import Path

import torch

# Windows of 8 tokens and chunks of 16: test rows of 24-40 tokens cross them.
WINDOW = 8
ARCHITECTURES = {
    # Gemma 3: local (sliding) and global layers, their own RoPE bases, q/k norm, scaled embeddings, tied output.
    "gemma3": ("gemma3_text", dict(num_hidden_layers=3, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")),
    # Gemma 4: per-layer inputs, shared key-value layers, local/global layers of different head sizes.
    "gemma4": ("gemma4_text", dict(num_hidden_layers=4, head_dim=32, global_head_dim=64, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                "full_attention"],
                                   hidden_size_per_layer_input=16,
                                   num_kv_shared_layers=2, tie_word_embeddings=True)),
    # gpt-oss: attention sinks, alternating 8-token windows, biased experts with a clamped SwiGLU.
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])),
    # Qwen3.5: Gated DeltaNet linear attention beside gated full attention (3:1).
    "qwen3_5": ("qwen3_5_text", dict(num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
                                     linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                     layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                  "full_attention"])),
    # Qwen3.5-MoE: the same, the MLPs routed experts with a shared expert.
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_hidden_layers=2, head_dim=16, linear_key_head_dim=16,
                                             linear_value_head_dim=16, linear_num_key_heads=2,
                                             linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                             layer_types=["linear_attention", "full_attention"])),
    # DeepSeek-V3: multi-head latent attention, a dense first layer, then sigmoid-routed experts beside a shared one.
    "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                        moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                        num_key_value_heads=4)),
    # Llama 4 (text): chunked local attention with RoPE beside global NoPE layers, experts every other layer.
    "llama4": ("llama4_text", dict(num_hidden_layers=4, head_dim=16, attention_chunk_size=16, num_local_experts=4,
                                   num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size_mlp=128,
                                   no_rope_layer_interval=2)),
    # Phi-4: fused qkv and gate_up projections.
    "phi4": ("phi3", dict(num_hidden_layers=2)),
    # SmolLM3: NoPE every 4th layer, tied output.
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=4, tie_word_embeddings=True)),
    # GLM-4.5: a dense first layer, then sigmoid-routed experts with a shared one; partial RoPE.
    "glm4_moe": ("glm4_moe", dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                                  num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32)),
}


def make_config(name: str, vocab: int, **fields_and_ids):
    """transformers' config object of a tiny `name` (its fields overridden by `fields_and_ids`)."""
    import transformers

    model_type, fields = ARCHITECTURES[name]
    common = dict(vocab_size=vocab, **({"vocab_size_per_layer_input": vocab} if model_type == "gemma4_text" else {}), hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5)
    return transformers.AutoConfig.for_model(model_type, **{**common, **fields, **fields_and_ids})


def make_checkpoint(folder: Path, name: str, *, seed: int = 0, dtype: str = "float32", **fields) -> Path:
    """A tiny random `name` saved by transformers' save_pretrained, with the test tokenizer (config fields
    overridden by `fields`)."""
    import transformers

    from moai_recipes.models.tiny import demo_texts, write_tokenizer

    folder = Path(folder)
    vocab = write_tokenizer(folder, demo_texts(), vocab_size=384)
    ids = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    config = make_config(name, vocab, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                         pad_token_id=ids["<|pad|>"], **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    perturb(model)
    model.save_pretrained(folder)
    return folder


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Norms start at ones and biases at zeros, where a weight in the wrong place would not show; routers of std
    0.02 score every expert alike, and experts of std 0.02 add next to nothing: move them all."""
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias") or "sinks" in name:
            p.add_(torch.randn_like(p) * 0.1)
        if "experts" in name:
            p.mul_(3)
        if name.endswith(("gate.weight", "router.weight")):
            p.mul_(20)
