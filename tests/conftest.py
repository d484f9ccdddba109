"""Shared fixtures: tiny Hugging Face checkpoints of each family, made by transformers itself.

Run the suite with `make test`. Nothing is downloaded: the tokenizer is trained on the demo data
and the weights are a seeded random initialisation written by `save_pretrained`.
"""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# torchtune's wheel ships a top-level `recipes` that raises on import: ours must come first.
sys.path.insert(0, str(ROOT))

from moai_recipes.models.tiny import demo_texts, write_tokenizer  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2")


def make_hf_checkpoint(folder: Path, family: str = "llama", *, tie: bool = False, max_shard_size: str | None = None,
                       dtype: str = "float32", num_layers: int = 2, hidden: int = 64, intermediate: int | None = None,
                       seed: int = 0) -> Path:
    """Write a tiny Hugging Face checkpoint of `family` with transformers' own save_pretrained."""
    import torch
    import transformers

    folder = Path(folder)
    vocab = write_tokenizer(folder, demo_texts(), vocab_size=384)
    ids = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden + 32,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                  pad_token_id=ids["<|pad|>"], tie_word_embeddings=tie)
    if family == "llama":
        cfg = transformers.LlamaConfig(rope_theta=500000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(rope_theta=10000.0, sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":  # per-head q/k norm, and a head_dim that is not hidden / heads
        cfg = transformers.Qwen3Config(rope_theta=1000000.0, head_dim=hidden // 2, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).to(getattr(torch, dtype))
    with torch.no_grad():  # norms start at ones; perturb them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """One tiny checkpoint per family: {'llama': Path, 'mistral': Path, 'qwen2': Path}."""
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The embedded demo checkpoint (tiny Llama, its tokenizer and chat template), written for this module."""
    from moai_recipes.models.tiny import tiny_checkpoint_dir

    return tiny_checkpoint_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from moai_recipes.data.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(tiny_dir)


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "offline"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOAI_CACHE", str(tmp_path_factory.getbasetemp() / "moai-cache"))
    # The developer's own `moai switch` choice (and running recipes) must never reach a test.
    monkeypatch.setenv("MOAI_HOME", str(tmp_path_factory.getbasetemp() / "moai-home"))
