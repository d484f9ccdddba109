"""Chat rows with images, made into samples by the checkpoint's own processor (an image-text model's).

Rows are as TRL and the Hub keep them: `messages` whose user turns hold `{"type": "image"}` parts beside
`{"type": "text", "text": ...}` ones, and an `images` column with one image per image part, in order: a path (relative
to the data file's folder, or absolute), bytes, `{"bytes": ..., "path": ...}` as the datasets library stores an Image
feature, or a PIL image. A part may name its image itself (`{"type": "image", "image": PATH}`).

The processor (transformers' AutoProcessor of the checkpoint: its image processor, tokenizer and chat template) renders
the conversation, sizes each image as its rules say and puts the image's tokens in the row. Only the assistant turns
are trained on: a token is trained where it is the same token at the same place of the conversation tokenised without
its images, inside an assistant turn (what the images add is never a target). A sample keeps its tokens and labels
(cached on disk as text data's tokens are); its pixels are made again when its micro-batch is collated (as TRL's
collator does), by the rank that trains on it, so a dataset of scanned pages is not held in memory. A missing or
unreadable image is a UserError naming its row, before the first step.

Test: `python -m pytest tests/test_vision.py -q`.
"""

from __future__ import annotations

import difflib
import hashlib
import io
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moai_recipes.data.local_files import type_name
from moai_recipes.data.pictures import made_if_demo
from moai_recipes.data.tokenizer import assistant_spans
from moai_recipes.errors import UserError
from moai_recipes.models.loss import IGNORE_INDEX

# A processor's outputs that are the text's own (the tokens and their mask); the rest are the images', or one value
# per token (Gemma 3's token_type_ids: which tokens are an image's).
_TEXT_KEYS = ("input_ids", "attention_mask")


def _without_video_check() -> None:
    """transformers 5 checks a processor's video processor against VideoProcessorMixin even when it has none, and that
    class exists only with torchvision: without it an image-text processor cannot be made. The check skips an argument
    that is None (images are what we train; videos are not read)."""
    from transformers import processing_utils

    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    if getattr(check, "moai", False):
        return

    def checked(self, name, argument):
        return None if argument is None else check(self, name, argument)

    checked.moai = True
    processing_utils.ProcessorMixin.check_argument_for_proper_class = checked


def load_processor(folder: Path):
    """The checkpoint's processor. Without torchvision (transformers' video processors need it) the processor is
    made of its image processor (transformers' PIL one), its tokenizer and its chat template, without videos."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    folder = Path(folder)
    if not any((folder / f).exists() for f in ("preprocessor_config.json", "processor_config.json")):
        raise UserError(f"checkpoint folder {folder} has no preprocessor_config.json: an image-text model's images are "
                        "read by its processor; save it there with AutoProcessor.from_pretrained(...)"
                        f".save_pretrained('{folder}')")
    try:
        return AutoProcessor.from_pretrained(str(folder))
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
    _without_video_check()
    from transformers.models.auto.processing_auto import processor_class_from_name

    named = {}
    for f in ("processor_config.json", "preprocessor_config.json"):
        if (folder / f).exists():
            named = json.loads((folder / f).read_text())
            if "processor_class" in named:
                break
    cls = processor_class_from_name(named.get("processor_class", ""))
    if cls is None:
        raise UserError(f"{folder}: its processor_class {named.get('processor_class')!r} is not known to the "
                        "installed transformers")
    template = folder / "chat_template.jinja"
    kwargs = {"chat_template": template.read_text()} if template.exists() else {}
    import inspect

    if "video_processor" in inspect.signature(cls.__init__).parameters:
        kwargs["video_processor"] = None
    return cls(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
               tokenizer=AutoTokenizer.from_pretrained(str(folder)), **kwargs)


def image_samples(folder: Path) -> "ImageSamples":
    """What makes an image-text checkpoint's rows into samples: its processor."""
    config = json.loads((Path(folder) / "config.json").read_text())
    token_id = next((config[k] for k in ("image_token_id", "image_token_index") if isinstance(config.get(k), int)),
                    None)
    return ImageSamples(load_processor(folder), name=str(folder), image_token_id=token_id)


def open_image(value, *, base: Path | None):
    """An image of the `images` column (or an image part) as an RGB PIL image; a UserError saying what is wrong."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        source, name = io.BytesIO(value), f"{len(value)} bytes"
    elif isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise UserError(f"image {value} is a URL: download the images and name their files")
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise UserError(f"image {value} is not a file" + (f" (looked for {path})" if str(path) != value else ""))
        source, name = path, str(path)
    else:
        raise UserError(f"an image must be a path, bytes or a PIL image, got {type_name(value)}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - what PIL says of a damaged or foreign file
        raise UserError(f"image {name} cannot be read: {e}") from None


def _conversation(row: dict, column_map: dict) -> tuple[list[dict], list]:
    """The row's conversation (each message's content a list of parts) and its images as the row holds them (paths,
    bytes...), in the order of its image parts."""
    col = column_map.get("messages", "messages")
    if col not in row:
        raise UserError(f"no '{col}' column (columns present: {', '.join(map(str, row))}); map it with "
                        "dataset.column_map.messages=NAME")
    value = row[col]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"column '{col}' holds text that is not a valid JSON list of messages: {e.msg}") from None
    if not isinstance(value, list) or not value:
        raise UserError(f"column '{col}' must be a non-empty list of messages, got {type_name(value)}")
    images_col = column_map.get("images", "images")
    listed = row.get(images_col)
    listed = [] if listed is None else listed if isinstance(listed, (list, tuple)) else [listed]
    messages, images, used = [], [], 0
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"message {j} of '{col}' must be an object with a role and content")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise UserError(f"message {j} of '{col}' must have string content or a list of parts, got "
                            f"{type_name(content)}")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                own = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
                if own is None:
                    if used >= len(listed):
                        raise UserError(f"message {j} has image part {used + 1}, but column '{images_col}' holds "
                                        f"{len(listed)} image(s): give one image per image part")
                    own, used = listed[used], used + 1
                images.append(own)
                parts.append({"type": "image"})
            elif kind == "text":
                if not isinstance(part.get("text"), str):
                    raise UserError(f"a text part of message {j} has no string 'text'")
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise UserError(f"message {j} of '{col}' has a part of type {kind!r}; parts are image or text")
        messages.append({"role": m["role"], "content": parts})
    if used != len(listed):
        raise UserError(f"column '{images_col}' holds {len(listed)} image(s) but the messages have {used} image "
                        "part(s) that take one: give one image per image part")
    return messages, images


class ImageSamples:
    """Rows made into samples by an image-text model's processor. `image_token_id`: the token each of an image's
    features takes the place of (Qwen's <|image_pad|>, Gemma's soft token), as the model's config.json names it."""

    def __init__(self, processor, *, name: str, image_token_id: int | None = None):
        self.processor, self.name, self.image_token_id = processor, name, image_token_id

    def fingerprint(self) -> str:
        """What the samples depend on: the processor's settings and chat template."""
        digest = hashlib.sha256(self.processor.to_json_string().encode())
        digest.update(str(getattr(self.processor, "chat_template", "")).encode())
        return digest.hexdigest()

    def _render(self, messages: list[dict], **kwargs) -> str:
        try:
            return self.processor.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - the template's own refusal
            raise UserError(f"the chat template of {self.name} rejects this conversation: {e}") from None

    def _process(self, messages: list[dict], images: list) -> dict:
        text = self._render(messages)
        out = self.processor(text=[text], images=images or None, return_tensors="pt")
        return {"text": text, **out}

    def sample(self, row: dict, *, column_map: dict, base: Path | None, max_seq_len: int,
               train_on_input: bool) -> dict | None:
        """{tokens, labels, text: the conversation rendered, images: the row's images as it holds them}; None when no
        target token is left within max_seq_len. A row cut short of its images' tokens is refused (its images would be
        half in the row)."""
        messages, refs = _conversation(row, column_map)
        images = [open_image(ref, base=base) for ref in refs]
        out = self._process(messages, images)
        ids = out["input_ids"][0].tolist()
        trained = self._trained(messages, out["text"], ids) if not train_on_input else None
        if len(ids) > max_seq_len:
            if images and _image_token_ids(self.processor) & set(ids[max_seq_len:]):
                raise UserError(f"the sample is {len(ids)} tokens with its images, more than max_seq_len="
                                f"{max_seq_len}, and cutting it would cut an image; raise max_seq_len or use smaller "
                                "images")
            ids = ids[:max_seq_len]
            trained = trained[:max_seq_len] if trained is not None else None
        masked = [False] * len(ids) if trained is None else [not t for t in trained]
        labels = [IGNORE_INDEX if m else t for t, m in zip(ids[1:], masked[1:])] + [IGNORE_INDEX]
        if all(label == IGNORE_INDEX for label in labels):
            return None
        return {"tokens": ids, "labels": labels, "text": out["text"], "images": refs}

    def pair(self, row: dict, *, column_map: dict, base: Path | None, max_seq_len: int) -> tuple | None:
        """recipes.dpo's pair of a preference row, as TRL 1.16's DPOTrainer makes it for an image-text model
        (DataCollatorForVisionPreference): the prompt conversation, its images' parts in it, rendered with the
        generation prompt and processed with its images; each completion the rest of the prompt-with-it's rendering,
        tokenised alone; no special tokens added (the template has them). (prompt ids, chosen ids, rejected ids, the
        prompt's text, its images as the row holds them); None when the prompt alone fills max_seq_len. A prompt cut
        short of its images' tokens is refused."""
        prompt, refs = _preference_prompt(row, column_map)
        chosen, rejected = (_completion(row, name, column_map) for name in ("chosen", "rejected"))
        if chosen == rejected:
            raise UserError("the chosen and rejected completions are the same: a pair teaches nothing when both sides "
                            "are equal; remove the row")

        text = self._render(prompt, add_generation_prompt=True)
        with_chosen, with_rejected = self._render(prompt + chosen), self._render(prompt + rejected)
        # The prompt is what both renderings begin with (a template may render the generation prompt otherwise).
        text = os.path.commonprefix([text, with_chosen, with_rejected])
        images = [open_image(ref, base=base) for ref in refs]
        made = self.processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
        prompt_ids = made["input_ids"][0].tolist()
        completions = [self.processor(text=[rest[len(text):]], return_tensors="pt",
                                      add_special_tokens=False)["input_ids"][0].tolist()
                       for rest in (with_chosen, with_rejected)]
        if len(prompt_ids) >= max_seq_len:
            if images and _image_token_ids(self.processor) & set(prompt_ids[max_seq_len:]):
                raise UserError(f"the prompt is {len(prompt_ids)} tokens with its images, more than max_seq_len="
                                f"{max_seq_len}, and cutting it would cut an image; raise max_seq_len or use smaller "
                                "images")
            return None
        keep = max_seq_len - len(prompt_ids)
        return prompt_ids, completions[0][:keep], completions[1][:keep], text, refs

    def rl_prompt(self, row: dict, *, column_map: dict, base: Path | None) -> ImageSample:
        """recipes.grpo's prompt of a row, as TRL 1.16's GRPOTrainer makes it for an image-text model: the prompt
        conversation (image parts in it, or TRL's placement for an `images` or `image` column beside string contents)
        rendered with the generation prompt and processed with its images, the tokenizer's special tokens added unless
        the rendering begins with BOS (transformers' processor apply_chat_template decides so)."""
        messages, refs = _preference_prompt(row, column_map)
        text = self._render(messages, add_generation_prompt=True)
        bos = self.processor.tokenizer.bos_token
        special = not (bos and text.startswith(bos))
        images = [open_image(ref, base=base) for ref in refs]
        ids = self.processor(text=[text], images=images or None, return_tensors="pt",
                             add_special_tokens=special)["input_ids"][0]
        return ImageSample(ids.numpy().astype(np.int64), None, text, refs, base, special_tokens=special)

    def _trained(self, messages: list[dict], text: str, ids: list[int]) -> list[bool]:
        """Per token of `ids` (the conversation with its images' tokens): whether it is an assistant turn's."""
        tokenizer = self.processor.tokenizer
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        plain, offsets = enc["input_ids"], enc["offset_mapping"]
        spans = self._assistant_spans(messages, text)
        in_turn = [any(s <= a and b <= e for s, e in spans) for a, b in offsets]
        trained = [False] * len(ids)
        # The tokens the images added (or turned into others) are the difference between the two tokenisations.
        for block in difflib.SequenceMatcher(a=plain, b=ids, autojunk=False).get_matching_blocks():
            for k in range(block.size):
                trained[block.b + k] = in_turn[block.a + k]
        return trained

    def _assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        def render(part, *, add_generation_prompt):
            return self.processor.apply_chat_template(part, tokenize=False, add_generation_prompt=add_generation_prompt)

        return assistant_spans(messages, text, render, name=self.name)

    def prompt(self, question: str, picture: str) -> tuple[list[int], dict]:
        """(tokens, image inputs) of a question about a picture (a path), as the model is asked for its answer."""
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = self.processor(text=[text], images=[open_image(picture, base=None)], return_tensors="pt")
        return out["input_ids"][0].tolist(), {k: v for k, v in out.items() if k not in _TEXT_KEYS and torch.is_tensor(v)}

    def image_inputs(self, text: str, images: list, tokens: list[int], *, special_tokens: bool = True) -> dict:
        """A sample's inputs besides its tokens, made again by the processor from its text and images: the images'
        (pixel_values, image_grid_thw...) and those with a value per token (token_type_ids), cut as the tokens are."""
        out = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=special_tokens)
        made = out["input_ids"][0]
        if made[:len(tokens)].tolist() != tokens:
            raise UserError("a sample's pictures make other tokens than when its row was processed (a picture was "
                            "changed during the run?); run again to process the rows anew")
        inputs = {}
        for k, v in out.items():
            if k in _TEXT_KEYS or not torch.is_tensor(v):
                continue
            # A value per token (Gemma 3's token types; Llama 3.2 Vision's mask of the picture tiles each token sees)
            per_token = v.dim() >= 2 and v.shape[:2] == (1, len(made)) and not v.is_floating_point()
            inputs[k] = v[0, :len(tokens)].tolist() if per_token else v
        return inputs


def _preference_prompt(row: dict, column_map: dict) -> tuple[list[dict], list]:
    """A preference row's prompt conversation, each content a list of parts, and its images (TRL's conventions: image
    parts in the messages with an `images` column, or one `image`; string contents with images get their image parts
    before the first user message's text, as TRL's prepare_multimodal_messages puts them)."""
    from moai_recipes.data.datasets import column  # (data/datasets.py imports this module)

    col, value = column(row, "prompt", column_map)
    if not isinstance(value, list) or not value:
        raise UserError(f"column '{col}' must be a non-empty list of messages for an image-text model, got "
                        f"{type_name(value)}")
    images_col = column_map.get("images", "images")
    if images_col not in row and "image" in row:
        row = {**row, images_col: [row["image"]]}
    has_parts = any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in value)
    listed = row.get(images_col)
    count = 0 if listed is None else len(listed) if isinstance(listed, (list, tuple)) else 1
    if not has_parts and count:  # TRL's placement: the images before the first user message's text
        first = next((j for j, m in enumerate(value) if isinstance(m, dict) and m.get("role") == "user"), 0)
        value = [{**m, "content": [{"type": "image"}] * count + [{"type": "text", "text": m.get("content")}]}
                 if j == first else m for j, m in enumerate(value)]
    return _conversation({**row, "messages": value}, {**column_map, "messages": "messages"})


def _completion(row: dict, name: str, column_map: dict) -> list[dict]:
    """A preference row's chosen or rejected turns, each content a list of text parts (as TRL makes them)."""
    from moai_recipes.data.datasets import column

    col, value = column(row, name, column_map)
    if not isinstance(value, list) or not value:
        raise UserError(f"column '{col}' must be a non-empty list of messages for an image-text model, got "
                        f"{type_name(value)}")
    messages, images = _conversation({"messages": value}, {"messages": "messages", "images": "images"})
    if images:
        raise UserError(f"column '{col}' holds an image part: a completion is text; put the images in the prompt")
    return messages


def _image_token_ids(processor) -> set[int]:
    tokenizer = processor.tokenizer
    ids = set()
    for attr in ("image_token", "boi_token", "eoi_token", "vision_start_token", "vision_end_token"):
        token = getattr(processor, attr, None) or getattr(tokenizer, attr, None)
        if isinstance(token, str):
            i = tokenizer.convert_tokens_to_ids(token)
            if isinstance(i, int) and i >= 0:
                ids.add(i)
    for attr in ("image_token_id", "image_token_index"):
        i = getattr(processor, attr, None)
        if isinstance(i, int):
            ids.add(i)
    return ids


@dataclass
class ImageSample:
    tokens: np.ndarray
    labels: np.ndarray | None
    text: str  # the conversation as the chat template renders it (the processor makes the images' inputs from it)
    images: list  # the row's image values as the data holds them (paths, bytes...), opened when read
    base: Path | None
    special_tokens: bool = True  # whether the processor added the tokenizer's special tokens (a DPO prompt's: no)


class _ImageInputs(Mapping):
    """A sample's image inputs, made by the processor when first looked at: every rank reads a step's whole global
    batch (train/micro_batches.py splits it), and makes the pixels of its own share only."""

    def __init__(self, dataset: "ImageTextDataset", sample: ImageSample):
        self._dataset, self._sample, self._made = dataset, sample, None

    def made(self) -> dict:
        """The inputs, made now and not kept (a micro-batch's collation holds only their concatenation)."""
        if self._made is not None:
            return self._made
        s = self._sample
        images = [open_image(v, base=s.base) for v in s.images]
        self._dataset.processed += 1
        return (self._dataset.maker.image_inputs(s.text, images, s.tokens.tolist(), special_tokens=s.special_tokens)
                if images else {})

    def _inputs(self) -> dict:
        if self._made is None:
            self._made = self.made()
        return self._made

    def __getitem__(self, key):
        return self._inputs()[key]

    def __iter__(self):
        return iter(self._inputs())

    def __len__(self):
        return len(self._inputs())


class ImageTextDataset(torch.utils.data.Dataset):
    """Samples of an image-text model: tokens and labels made once; their images opened and processed when a sample's
    `images` (the processor's image inputs for it) are first looked at."""

    def __init__(self, samples: list[ImageSample], maker: ImageSamples, *, rows: int, dropped: int,
                 origin: str = "memory"):
        self._samples, self.maker = samples, maker
        self.rows, self.dropped, self.origin = rows, dropped, origin
        self.processed = 0  # samples whose pictures this process has made into inputs

    def __len__(self):
        return len(self._samples)

    def __getitem__(self, i) -> dict:
        s = self._samples[i]
        return {"tokens": s.tokens.tolist(), "labels": s.labels.tolist(), "images": _ImageInputs(self, s)}

    def image_load(self) -> dict | None:
        """What the planner prices the vision tower by (the fields of planner/plan.ImageLoad): each sample's image
        tokens, and the image inputs of the sample with the most; None without images."""
        return image_load(self.maker, [s.tokens for s in self._samples], lambda i: self[i]["images"])

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(s.tokens) for s in self._samples)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.maker.fingerprint().encode())
        for s in self._samples:
            digest.update(s.tokens.tobytes())
            digest.update(s.labels.tobytes())
        return digest.hexdigest()

    def split_off(self, fraction: float, *, seed: int):
        from moai_recipes.data.datasets import held_out

        train, val = held_out(len(self), fraction, seed=seed)
        pick = lambda index: ImageTextDataset([self._samples[j] for j in index], self.maker,  # noqa: E731
                                              rows=self.rows, dropped=self.dropped, origin=self.origin)
        return pick(train), pick(val)


def load_image_dataset(source, maker: ImageSamples, *, max_seq_len: int, progress: bool = False,
                       cache: bool = False, write_cache: bool = True) -> ImageTextDataset:
    """Every row of `source` (data/datasets.DataSource, kind chat) made into a sample by the processor; a row's
    problem is a UserError naming it. `cache`: a local file's samples (their tokens, labels, texts and the paths of
    their pictures) kept in this machine's cache, as text data's tokens are (data/token_cache.py), keyed by the file,
    the pictures' sizes and times, the processor and the settings: a second run, and every other rank of a run, reads
    them instead of processing every picture again. `write_cache`: a dry read writes none."""
    if source.reads != "chat":
        raise UserError(f"dataset={source.kind}: an image-text model trains on chat rows (dataset=chat), whose "
                        "messages hold image parts and an images column")
    if source.path:
        made_if_demo(source.path)
    base = Path(source.path).resolve().parent if source.path else None
    rows, digest, total = source.open()
    key = _cache_key(source, maker, base, digest, max_seq_len) if cache and source.path and digest else None
    if key is None:
        return _processed(rows, source, maker, base, max_seq_len=max_seq_len, progress=progress, total=total)
    from moai_recipes.data.token_cache import cached_tokens, existing_tokens

    def build(writer) -> dict:
        data = _processed(rows, source, maker, base, max_seq_len=max_seq_len, progress=progress, total=total)
        for sample in data._samples:
            writer.add(sample.tokens.tolist(), sample.labels.tolist())
        return {"rows": data.rows, "dropped": data.dropped, "texts": [s.text for s in data._samples],
                "images": [s.images for s in data._samples]}

    if write_cache:
        arrays, built = cached_tokens(key, build)
    else:
        arrays, built = existing_tokens(key), False
        if arrays is None:
            return _processed(rows, source, maker, base, max_seq_len=max_seq_len, progress=progress, total=total)
    meta, offsets = arrays.meta, arrays.offsets
    samples = [ImageSample(np.asarray(arrays.tokens[offsets[i]:offsets[i + 1]], dtype=np.int64),
                           np.asarray(arrays.labels[offsets[i]:offsets[i + 1]], dtype=np.int64),
                           meta["texts"][i], meta["images"][i], base) for i in range(len(offsets) - 1)]
    return ImageTextDataset(samples, maker, rows=meta["rows"], dropped=meta["dropped"],
                            origin="tokenised" if built else "cache")


def _cache_key(source, maker: ImageSamples, base: Path | None, digest: str, max_seq_len: int) -> str | None:
    """What a local file's samples depend on, its pictures' sizes and modification times included; None where a
    picture is not a file the rows name by path (bytes in the rows: processed each run)."""
    from moai_recipes.data.local_files import read_rows
    from moai_recipes.data.token_cache import cache_key

    pictures = hashlib.sha256()
    for _, row in read_rows(source.path, key=source.key):
        try:
            refs = _conversation(row, source.column_map)[1]
        except UserError:
            return None  # named with its row when processed
        for value in refs:
            if not isinstance(value, str):
                return None
            path = Path(value) if Path(value).is_absolute() or base is None else base / value
            try:
                stat = path.stat()
            except OSError:
                return None  # named with its row when processed
            pictures.update(f"{value}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return cache_key({"data": digest, "pictures": pictures.hexdigest(), "processor": maker.fingerprint(),
                      "kind": "chat with images", "column_map": dict(sorted(source.column_map.items())),
                      "train_on_input": source.train_on_input, "max_seq_len": max_seq_len,
                      "images.py": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()})


def _processed(rows, source, maker: ImageSamples, base: Path | None, *, max_seq_len: int, progress: bool,
               total: int | None) -> ImageTextDataset:
    samples, n_rows, dropped = [], 0, 0
    bar = tqdm(rows, total=total, unit=" rows", desc=f"Processing {source.describe()}", disable=not progress,
               file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 15, leave=False)
    for where, row in bar:
        n_rows += 1
        try:
            s = maker.sample(row, column_map=source.column_map, base=base, max_seq_len=max_seq_len,
                             train_on_input=source.train_on_input)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if s is None:
            dropped += 1
            continue
        samples.append(ImageSample(np.asarray(s["tokens"], dtype=np.int64), np.asarray(s["labels"], dtype=np.int64),
                                   s["text"], s["images"], base))
    bar.close()
    if n_rows == 0:
        raise UserError(f"{source.describe()} holds no rows; check dataset.split and dataset.data_files")
    if not samples:
        raise UserError(f"no row of {source.describe()} keeps a token to train on within max_seq_len={max_seq_len} "
                        f"({dropped} dropped); raise max_seq_len, or check that the rows have answers")
    return ImageTextDataset(samples, maker, rows=n_rows, dropped=dropped)


def image_load(maker: ImageSamples, tokens: list[np.ndarray], inputs, *, copies: int = 1) -> dict | None:
    """The fields of planner/plan.ImageLoad for samples of `tokens` whose i-th sample's image inputs are `inputs(i)`,
    each run `copies` times a sample (a DPO pair's prompt: with its chosen and its rejected completion); None
    without images."""
    if maker.image_token_id is None or not tokens:
        return None
    counts = tuple(int((t == maker.image_token_id).sum()) for t in tokens)
    most = max(range(len(counts)), key=counts.__getitem__)
    if not counts[most]:
        return None
    return dict(example=image_example(inputs(most)), example_tokens=counts[most],
                tokens=tuple(copies * c for c in counts))


def image_example(inputs: Mapping) -> tuple:
    """One sample's image inputs as the planner traces the vision tower on them (planner/plan.ImageLoad.example): each
    tensor's name, shape and dtype, and the values of an integer one (Qwen's grid of patches)."""
    return tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                  tuple(v.flatten().tolist()) if not v.is_floating_point() else None)
                 for k, v in inputs.items() if torch.is_tensor(v))


def assumed_picture(settings: Mapping, size: tuple[int, int]) -> dict:
    """The image inputs of one blank picture `size` (height, width) pixels, as the image processor that `settings`
    describe (a preprocessor_config.json's fields: image_processor_type and its settings) makes them: what a plan
    without data prices an image-text model's pictures by (recipes.plan picture_size=...)."""
    import transformers
    from PIL import Image

    settings = dict(settings)
    kind = str(settings.pop("image_processor_type", "")).removesuffix("Fast")
    cls = getattr(transformers, kind, None) if kind else None
    if cls is None:
        raise UserError(f"model.image_processor.image_processor_type={kind or None!r} is not an image processor of "
                        "the installed transformers; copy the checkpoint's preprocessor_config.json fields")
    height, width = size
    if height < 1 or width < 1:
        raise UserError(f"picture_size={list(size)} must be a height and a width of at least one pixel")
    try:
        processor = cls(**settings)
        out = processor(images=[Image.new("RGB", (width, height), "white")], return_tensors="pt")
    except (TypeError, ValueError) as e:
        raise UserError(f"model.image_processor: {kind} refuses its settings or picture_size={list(size)}: {e}") \
            from None
    return {k: v for k, v in out.items() if torch.is_tensor(v)}


# Image inputs a processor lays out a row at a time, the row's pictures along dim 1, padded to the batch's most (Llama 3.2
# Vision's); other models' are every row's pictures end to end along dim 0.
_PER_ROW = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")


def collate_images(samples: list[dict], width: int | None, *, left: bool = False) -> dict:
    """A micro-batch's image inputs: each image input of its samples concatenated along the images (as the processor
    makes them for several images; Llama 3.2 Vision's a row each, its pictures padded to the most of any row); each one
    with a value per token (a list) padded with 0 to the rows' `width` (at their start, `left`: prompts left-padded
    for sampling), or (`width` None) laid end to end as the samples' tokens are in a packed row (a token's value
    per picture, Llama 3.2 Vision's cross-attention mask, on the row's pictures: each sample's in its own columns)."""
    out: dict[str, torch.Tensor] = {}
    made = [made_inputs(s.get("images")) for s in samples]
    per_row = any("aspect_ratio_ids" in inputs for inputs in made)
    for k in sorted({k for inputs in made for k in inputs}):
        values = [inputs[k] for inputs in made if k in inputs]
        if torch.is_tensor(values[0]):
            out[k] = _rows_of_pictures(made, k, packed=width is None) if per_row and k in _PER_ROW else torch.cat(values)
            continue
        out[k] = _per_token(samples, made, k, width, left=left)
    return out


def _rows_of_pictures(made: list[dict], key: str, *, packed: bool) -> torch.Tensor:
    """Llama 3.2 Vision's input `key` ([1, pictures, ...] a sample): one packed row of every sample's pictures, or a
    row a sample, its pictures padded with zeros (no picture: aspect ratio 0) to the most of any."""
    present = [inputs[key] for inputs in made if key in inputs]
    if packed:
        return torch.cat(present, dim=1)
    most = max(v.shape[1] for v in present)
    rest = present[0].shape[2:]
    rows = torch.zeros(len(made), most, *rest, dtype=present[0].dtype)
    for r, inputs in enumerate(made):
        if key in inputs:
            rows[r, :inputs[key].shape[1]] = inputs[key][0]
    return rows


def _per_token(samples: list[dict], made: list[dict], key: str, width: int | None, *, left: bool) -> torch.Tensor:
    """An input with a value per token (a list a sample; a value per token and picture tile for Llama 3.2 Vision's
    cross-attention mask): [rows, width, ...], or one packed row, 0 where a sample has none. A prompt's (a DPO pair's,
    a GRPO completion's row) goes on over the sample's other tokens as transformers' generate continues it: token
    types 0, the tiles a token sees those the prompt's last token sees."""
    own = [continued(torch.tensor(inputs[key], dtype=torch.long), len(s["tokens"])) if inputs.get(key) else None
           for s, inputs in zip(samples, made)]
    shapes = [t.shape[1:] for t in own if t is not None]
    if width is None:  # one row: each sample's tokens after the last's, its pictures after the last's
        pictures = sum(t.shape[1] for t in own if t is not None) if shapes and len(shapes[0]) else None
        rest = (() if pictures is None else (pictures, *(max(d) for d in zip(*[sh[1:] for sh in shapes]))))
        row = torch.zeros(1, sum(len(s["tokens"]) for s in samples), *rest, dtype=torch.long)
        at = seen = 0
        for s, t in zip(samples, own):
            if t is not None:
                where = (0, slice(at, at + len(t))) + ((slice(seen, seen + t.shape[1]),) if rest else ())
                row[where + tuple(slice(0, d) for d in t.shape[2:])] = t
                seen += t.shape[1] if rest else 0
            at += len(s["tokens"])
        return row
    rest = tuple(max(d) for d in zip(*shapes)) if shapes else ()
    rows = torch.zeros(len(samples), width, *rest, dtype=torch.long)
    for r, t in enumerate(own):
        if t is not None:
            start = width - len(t) if left else 0
            rows[(r, slice(start, start + len(t))) + tuple(slice(0, d) for d in t.shape[1:])] = t
    return rows


def continued(value: torch.Tensor, length: int) -> torch.Tensor:
    """A per-token input [tokens, ...] of a prompt, over `length` tokens: 0 for each token after it (a token type), or
    (a value per picture tile: Llama 3.2 Vision's cross-attention mask) the last prompt token's, as transformers'
    generate goes on."""
    more = length - value.shape[0]
    if more <= 0:
        return value
    after = value.new_zeros(more) if value.dim() == 1 else value[-1:].expand(more, *value.shape[1:])
    return torch.cat([value, after])


def made_inputs(images) -> dict:
    """A sample's image inputs as a dict: made now where they are made when looked at (_ImageInputs)."""
    return images.made() if isinstance(images, _ImageInputs) else dict(images or {})
