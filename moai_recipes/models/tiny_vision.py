"""The embedded image-text model: a tiny Qwen2.5-VL-shaped checkpoint made on first use, its processor beside it.

Nothing is downloaded. Its tokenizer is a byte-level BPE trained on the demo's texts with the image tokens Qwen's
processor puts in a row; its weights are transformers' own random initialisation from the config; its processor is
Qwen2-VL's image processor at a small resolution and a chat template that renders image parts. The folder has what a
real Qwen2.5-VL checkpoint has (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
preprocessor_config.json, processor_config.json, chat_template.jinja), so every code path is the real one.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moai_recipes.files import cache_dir, made_once
from moai_recipes.models.tiny import BOS, EOS, PAD, SPECIAL_TOKENS, demo_texts, trained_bpe

# What the image-text demo's pictures show and ask (data/pictures.py draws them): the tokenizer learns these words.
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (235, 210, 20)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"shape": "What shape is it?", "colour": "What colour is it?"}


def answer(kind: str, shape: str, colour: str) -> str:
    """The answer to a question of `kind` (QUESTIONS) about a picture of a `colour` `shape`."""
    return f"A {shape}." if kind == "shape" else f"It is {colour}."


QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def image_text_tokenizer(extra: list[str]):
    """A fast tokenizer trained on the demo's texts and the pictures' questions, with `extra` special tokens."""
    from transformers import PreTrainedTokenizerFast

    texts = demo_texts() + [f"{q} {answer(k, s, c)}" for k, q in QUESTIONS.items() for c in COLOURS for s in SHAPES]
    return PreTrainedTokenizerFast(tokenizer_object=trained_bpe(texts, 384, SPECIAL_TOKENS + extra), bos_token=BOS,
                                   eos_token=EOS, pad_token=PAD)


def qwen2_5_vl_parts(tokenizer, *, max_tokens: int = 16, scale: int = 1):
    """(config, image processor) of a tiny Qwen2.5-VL: two text layers of width 64, a two-block vision tower of width
    32 (each `scale` times as many and as wide), images sized to at most `max_tokens` tokens (4 patches of 14 pixels
    each)."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + QWEN_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64 * scale, intermediate_size=96 * scale,
                num_hidden_layers=2 * scale,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                rope_scaling={"type": "mrope", "mrope_section": [2 * scale, 3 * scale, 3 * scale]},
                bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    config = transformers.AutoConfig.for_model(
        "qwen2_5_vl", text_config=text,
        vision_config=dict(depth=2 * scale, hidden_size=32 * scale, intermediate_size=64 * scale, num_heads=2,
                           out_hidden_size=64 * scale,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    images = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * max_tokens, patch_size=14,
                                   merge_size=2, temporal_patch_size=2)
    return config, images


@dataclass
class ProcessorFiles:
    """What an image-text checkpoint's processor is saved as: its tokenizer, image processor, chat template, the
    processor's class and fields, and what the processor reads of the tokenizer's config (Gemma's image tokens)."""

    tokenizer: object
    images: object
    template: str
    processor_class: str
    processor_fields: dict = field(default_factory=dict)
    tokenizer_fields: dict = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        self.tokenizer.save_pretrained(folder)
        if self.tokenizer_fields:
            config_file = folder / "tokenizer_config.json"
            fields = json.loads(config_file.read_text())
            fields.update(self.tokenizer_fields)
            config_file.write_text(json.dumps(fields, indent=2))
        self.images.save_pretrained(folder)
        (folder / "chat_template.jinja").write_text(self.template)
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": self.processor_class,
                                                                  **self.processor_fields}, indent=2))


def write_tiny_vl(folder: Path, *, seed: int = 0, scale: int = 1, max_tokens: int = 16) -> Path:
    """A random tiny Qwen2.5-VL (qwen2_5_vl_parts) and its processor's files, written into `folder`."""
    import transformers

    tokenizer = image_text_tokenizer(QWEN_TOKENS)
    config, images = qwen2_5_vl_parts(tokenizer, max_tokens=max_tokens, scale=scale)
    torch.manual_seed(seed)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    ProcessorFiles(tokenizer, images, QWEN_TEMPLATE, "Qwen2_5_VLProcessor").save(folder)
    return folder


def tiny_vl_checkpoint_dir(cache: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The folder of the tiny image-text model, made (atomically) on first use."""
    return made_once(Path(cache or cache_dir()) / f"tiny-qwen2_5_vl-v1-seed{seed}",
                     lambda tmp: write_tiny_vl(tmp, seed=seed))
