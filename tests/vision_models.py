"""Tiny random image-text checkpoints, written by the installed transformers from its own config classes with a
processor of their own (the test tokenizer with the model's image tokens, the model's image processor at a small
resolution, a chat template that renders image parts), and rows of generated pictures (moai_recipes/data/pictures.py)
to train them on.

`VISION`: name -> how to make it. `make_vision_checkpoint(folder, name)`.
"""

import json
from pathlib import Path

import torch

from moai_recipes.data.pictures import write_picture_rows
from moai_recipes.models.tiny import BOS, EOS, PAD, SPECIAL_TOKENS
from moai_recipes.models.tiny_vision import (
    QWEN_TEMPLATE,
    QWEN_TOKENS,
    ProcessorFiles,
    image_text_tokenizer,
    qwen2_5_vl_parts,
)

_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else "
    "message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == "
    "'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_GEMMA_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]


def _qwen2_5_vl(tokenizer):
    config, images = qwen2_5_vl_parts(tokenizer)
    return config, images, QWEN_TEMPLATE, "Qwen2_5_VLProcessor", {}, {}


def _qwen3_vl(tokenizer):
    """Qwen3-VL: 16-pixel patches, learned position embeddings, and the deep-stack (features of the vision tower's
    middle layers added to the language model's first layers at the images' places)."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + QWEN_TOKENS}
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
    return config, images, QWEN_TEMPLATE, "Qwen3VLProcessor", {}, {}


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
    return config, images, _GEMMA_TEMPLATE, "Gemma3Processor", {"image_seq_length": 4}, \
        {"extra_special_tokens": extra}


_MLLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_MLLAMA_TOKENS = ["<|image|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _mllama(tokenizer):
    """Llama 3.2 Vision: each picture cut into up to 4 tiles of 28 pixels, read by cross-attention layers (here the
    second of three) from the vision tower's features of every tile."""
    import transformers
    from transformers import MllamaImageProcessor

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + _MLLAMA_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                cross_attention_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=28, patch_size=7, max_num_tiles=4, intermediate_layers_indices=[0],
                  vision_output_dim=64)
    config = transformers.AutoConfig.for_model("mllama", text_config=text, vision_config=vision,
                                               image_token_index=ids["<|image|>"])
    images = MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=4)
    return config, images, _MLLAMA_TEMPLATE, "MllamaProcessor", {}, {}


VISION = {"qwen2_5_vl": (_qwen2_5_vl, QWEN_TOKENS), "qwen3_vl": (_qwen3_vl, QWEN_TOKENS),
          "gemma3_vl": (_gemma3, _GEMMA_TOKENS), "mllama": (_mllama, _MLLAMA_TOKENS)}


def make_vision_checkpoint(folder: Path, name: str, *, seed: int = 0) -> Path:
    """A tiny random image-text model `name` saved by transformers' save_pretrained, with its processor's files, its
    weights perturbed (tests/architectures.perturb) so that a misplaced one shows."""
    import transformers

    from tests.architectures import perturb

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make, tokens = VISION[name]
    tokenizer = image_text_tokenizer(tokens)
    config, images, template, processor_class, processor_fields, tokenizer_fields = make(tokenizer)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    perturb(model)
    with torch.no_grad():  # Gemma 3's projector starts at zeros, where no gradient would reach the vision tower
        for name_, p in model.named_parameters():
            if "cross_attn" in name_ and "gate" in name_:  # Llama 3.2 Vision's gates: the pictures matter (tanh 0.76)
                p.fill_(1.0)
            elif not p.any():
                p.normal_(0, 0.05)
    model.save_pretrained(folder)
    ProcessorFiles(tokenizer, images, template, processor_class, processor_fields, tokenizer_fields).save(folder)
    return folder


_WRONG = {"circle": "a square", "square": "a triangle", "triangle": "a circle", "red": "green", "green": "blue",
         "blue": "yellow", "yellow": "red"}


def picture_pairs(folder: Path) -> Path:
    """The pictures' rows as preference rows: the question (after its picture) the prompt, the answer chosen, a wrong
    one rejected."""
    source = write_picture_rows(folder, 8, size=56)
    rows = []
    for line in source.read_text().splitlines():
        row = json.loads(line)
        question, answer = row["messages"]
        right = answer["content"][0]["text"]
        wrong = next((right.replace(k, v) for k, v in _WRONG.items() if k in right), right + " No.")
        turn = lambda text: [{"role": "assistant", "content": [{"type": "text", "text": text}]}]  # noqa: E731
        rows.append({"prompt": [question], "chosen": turn(right), "rejected": turn(wrong), "images": row["images"]})
    out = folder / "pairs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def picture_prompts(folder: Path, count: int = 4, *, size: int = 56) -> Path:
    """The pictures' rows as recipes.grpo's prompts: the question (after its picture) the prompt, the answer a column
    the rewards read, the pictures (`size` pixels high) in an `images` column."""
    source = write_picture_rows(folder, count, size=size)
    rows = []
    for line in source.read_text().splitlines():
        row = json.loads(line)
        question, answer = row["messages"]
        rows.append({"prompt": [question], "answer": answer["content"][0]["text"], "images": row["images"]})
    out = folder / "prompts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
