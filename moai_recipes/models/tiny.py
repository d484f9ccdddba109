"""The embedded default model: a tiny Llama-architecture Hugging Face checkpoint made on first use.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on the demo data with the
`tokenizers` library, the weights are a seeded random initialisation, and the folder has exactly
what a real Hugging Face checkpoint has (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json), so every code path is the real one.
"""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from moai_recipes.files import cache_dir as machine_cache_dir, made_once

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEMO_DATA = ASSETS / "demo.jsonl"

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# ChatML, as Qwen 2.5 uses: an assistant turn ends with <|im_end|>, which is also a stop token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_ARCH = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5)


def trained_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE (the `tokenizers` library's) trained on `texts`, with `special_tokens`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer(folder: Path, texts: list[str], vocab_size: int = 512) -> int:
    """Train a byte-level BPE on `texts` and write tokenizer.json and tokenizer_config.json.

    Returns the vocabulary size (special tokens included).
    """
    tok = trained_bpe(texts, vocab_size, SPECIAL_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_ARCH["max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))
    return tok.get_vocab_size()


def demo_texts() -> list[str]:
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines() if line.strip()]
    return [" ".join(str(v) for v in row.values()) for row in rows]


def llama_config(vocab_size: int, tokenizer_folder: Path, **arch) -> dict:
    """A config.json for LlamaForCausalLM, as transformers writes it."""
    vocab = json.loads((tokenizer_folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": vocab_size, "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD],
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "rope_scaling": None, "initializer_range": 0.02, **{**TINY_ARCH, **arch},
    }


def _init_llama_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    std = cfg["initializer_range"]

    def normal(*shape):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": normal(v, d), "model.norm.weight": torch.ones(d), "lm_head.weight": normal(v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": normal(d, d), p + "self_attn.k_proj.weight": normal(kv, d),
            p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, d),
            p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
            p + "mlp.down_proj.weight": normal(d, f),
            p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
        })
    return sd


def tiny_checkpoint_dir(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Return the folder of the tiny default checkpoint, making it (atomically) on first use."""
    def make(tmp: Path) -> None:
        vocab_size = write_tokenizer(tmp, demo_texts())
        cfg = llama_config(vocab_size, tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
             "pad_token_id": cfg["pad_token_id"]}))
        save_file(_init_llama_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return made_once(Path(cache_dir or machine_cache_dir()) / f"tiny-llama-v1-seed{seed}", make)
