"""Tiny random image-text checkpoints, written by the installed transformers from its own config classes with a
processor of their own (the test tokenizer with the model's image tokens, the model's image processor at a small
resolution, a chat template that renders image parts), and rows of generated pictures (coloured shapes, drawn with
PIL) to train them on.

`VISION`: name -> how to make it. `make_vision_checkpoint(folder, name)`; `write_picture_rows(folder, n)`.
"""

import json
from pathlib import Path

import torch

from moai_recipes.models.tiny import BOS, EOS, PAD, SPECIAL_TOKENS, demo_texts

_QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else "
    "message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == "
    "'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_GEMMA_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (235, 210, 20)}
SHAPES = ("square", "circle", "triangle")


def _tokenizer(extra: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = demo_texts() + [f"What shape is it? What colour is it? A {c} {s}." for c in COLOURS for s in SHAPES]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS + extra,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def _qwen2_5_vl(tokenizer):
    import transformers
    from transformers import Qwen2VLImageProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + _QWEN_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=ids[BOS],
                eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    config = transformers.AutoConfig.for_model(
        "qwen2_5_vl", text_config=text,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    images = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                                   temporal_patch_size=2)
    return config, images, _QWEN_TEMPLATE, "Qwen2_5_VLProcessor", {}


def _gemma3(tokenizer):
    import transformers
    from transformers import Gemma3ImageProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + _GEMMA_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                max_position_embeddings=512, rms_norm_eps=1e-5, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=ids[BOS], eos_token_id=ids[EOS],
                pad_token_id=ids[PAD])
    config = transformers.AutoConfig.for_model(
        "gemma3", text_config=text,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=7),
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    images = Gemma3ImageProcessor(size={"height": 28, "width": 28})
    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    return config, images, _GEMMA_TEMPLATE, "Gemma3Processor", {"image_seq_length": 4, "extra": extra}


def _qwen3_vl(tokenizer):
    """Qwen3-VL: 16-pixel patches, learned position embeddings, and the deep-stack (features of the vision tower's
    middle layers added to the language model's first layers at the images' places)."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + _QWEN_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    config = transformers.AutoConfig.for_model(
        "qwen3_vl", text_config=text,
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    images = Qwen2VLImageProcessor(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, patch_size=16, merge_size=2,
                                   temporal_patch_size=2)
    return config, images, _QWEN_TEMPLATE, "Qwen3VLProcessor", {}


VISION = {"qwen2_5_vl": (_qwen2_5_vl, _QWEN_TOKENS), "qwen3_vl": (_qwen3_vl, _QWEN_TOKENS),
          "gemma3_vl": (_gemma3, _GEMMA_TOKENS)}


def make_vision_checkpoint(folder: Path, name: str, *, seed: int = 0) -> Path:
    """A tiny random image-text model `name` saved by transformers' save_pretrained, with its processor's files."""
    import transformers

    from tests.architectures import perturb

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make, tokens = VISION[name]
    tokenizer = _tokenizer(tokens)
    config, images, template, processor_class, processor_fields = make(tokenizer)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    perturb(model)
    with torch.no_grad():  # Gemma 3's projector starts at zeros, where no gradient would reach the vision tower
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    extra = processor_fields.pop("extra", {})
    tokenizer.save_pretrained(folder)
    if extra:  # the processor reads its image tokens' names from the tokenizer's config
        config_file = folder / "tokenizer_config.json"
        fields = json.loads(config_file.read_text())
        fields.update(extra_special_tokens=extra)
        config_file.write_text(json.dumps(fields, indent=2))
    images.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(template)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class,
                                                              **processor_fields}, indent=2))
    return folder


def draw(shape: str, colour: str, *, size: int = 56, seed: int = 0):
    """A picture of one coloured shape on a white ground, placed and sized a little differently by `seed`."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size + rng.randrange(0, 29), size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    r = rng.randrange(size // 4, size // 3)
    cx, cy = rng.randrange(r, image.width - r), rng.randrange(r, size - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def write_picture_rows(folder: Path, count: int, *, seed: int = 0, size: int = 56) -> Path:
    """`count` rows of a picture and a question about it (its shape or its colour) and the answer, as TRL's
    convention has them: messages with an image part, an images column of paths relative to the file."""
    folder = Path(folder)
    (folder / "pictures").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        shape, colour = SHAPES[(i + seed) % len(SHAPES)], list(COLOURS)[(i // 3 + seed) % len(COLOURS)]
        path = f"pictures/{i}.png"
        draw(shape, colour, seed=seed * 1000 + i, size=size).save(folder / path)
        ask_shape = (i + seed) % 2 == 0
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "What shape is it?" if ask_shape else
                                          "What colour is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"A {shape}." if ask_shape else
                                               f"It is {colour}."}]}],
            "images": [path]})
    out = folder / "pictures.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
