"""Prompts for recipes.grpo: rows with a `prompt` column, a string or a conversation (TRL's conversational format:
a list of {role, content} ending with a user turn), tokenised as TRL 1.16's GRPOTrainer tokenises them: a string as
transformers' `tokenizer(text)` (BOS where the tokenizer adds one), a conversation through the chat template with the
generation prompt. Every other column of a row goes to the reward functions, as TRL passes them.

An image-text model's prompts (conversations whose user turns hold pictures: image parts with an `images` column, or
TRL's `image`/`images` column beside string contents) are made by its processor as TRL's GRPOTrainer makes them
(data/images.ImageSamples.rl_prompt); a prompt's image inputs are made again, by the rank that samples it, when its
round is sampled (data/images.py), and go with each of its completions. The reward functions get the image columns as
the rows hold them (paths, bytes, or the datasets library's images).

A prompt that leaves fewer than `max_completion_length` tokens of max_seq_len is dropped (its completions would be cut
shorter than the run's other ones); the run says how many.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from moai_recipes.data.datasets import DataSource, column
from moai_recipes.data.images import ImageSample, ImageSamples, _ImageInputs, image_load
from moai_recipes.data.local_files import type_name
from moai_recipes.data.preferences import _check_messages
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError


class PromptSet(torch.utils.data.Dataset):
    """Tokenised prompts. A sample is {"index", "prompt" (the row's value as given), "tokens" (its token ids),
    "columns" (the row's other columns)}; a completion row of it is up to its prompt and `completion_length` tokens
    long (the planner's length of it). An image-text model's prompts (`pictures`: each prompt's text and images,
    `maker` its processor) have "images" too: the prompt's image inputs, made by the processor when first looked at."""

    def __init__(self, rows: list[tuple[list[int], object, dict]], *, read: int, dropped: int,
                 completion_length: int, origin: str = "memory", pictures: list[ImageSample] | None = None,
                 maker: ImageSamples | None = None):
        self._rows, self.rows, self.dropped, self.origin = rows, read, dropped, origin
        self.completion_length = completion_length
        self._pictures, self.maker = pictures, maker
        self.processed = 0  # prompts whose pictures this process has made into inputs (data/images._ImageInputs)

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i) -> dict:
        ids, value, columns = self._rows[i]
        prompt = {"index": i, "tokens": ids, "prompt": value, "columns": columns}
        if self._pictures is not None:
            prompt["images"] = _ImageInputs(self, self._pictures[i])
        return prompt

    def image_load(self) -> dict | None:
        """What the planner prices the vision tower by (planner/plan.ImageLoad): each prompt's images, which each of
        its completions' rows carries."""
        if self.maker is None:
            return None
        return image_load(self.maker, [p.tokens for p in self._pictures], lambda i: self[i]["images"])

    @property
    def conversational(self) -> bool:
        return bool(self._rows) and isinstance(self._rows[0][1], list)

    @property
    def lengths(self) -> tuple[int, ...]:
        """A completion row's tokens at most: its prompt and max_completion_length (what the planner prices)."""
        return tuple(len(ids) + self.completion_length for ids, _, _ in self._rows)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps([ids for ids, _, _ in self._rows]).encode())
        if self.maker is not None:  # the pictures are named by the rows, made by the processor
            digest.update(self.maker.fingerprint().encode())
            digest.update(json.dumps([[str(v) for v in p.images] for p in self._pictures]).encode())
        return digest.hexdigest()

    def split_off(self, fraction: float, *, seed: int):
        raise UserError("dataset.val_split is not offered for prompts: recipes.grpo logs each step's rewards")


def load_prompts(source: DataSource, tokenizer: Tokenizer, *, max_seq_len: int, max_completion_length: int,
                 progress: bool = False, images: ImageSamples | None = None) -> PromptSet:
    """Every row of `source` made into a prompt; `images`: an image-text model's processor, which makes them."""
    rows, _, total = source.open()
    kept, pictures, read, dropped = [], [], 0, 0
    base = Path(source.path).resolve().parent if source.path else None
    bar = tqdm(rows, total=total, unit=" rows", desc=f"Tokenising {source.describe()}", disable=not progress,
               file=sys.stderr, leave=False)
    room = max_seq_len - max_completion_length
    if room < 1:
        raise UserError(f"max_seq_len={max_seq_len} leaves no room for a prompt beside max_completion_length="
                        f"{max_completion_length}: raise max_seq_len above it")
    for where, row in bar:
        read += 1
        try:
            if images is not None:
                picture = images.rl_prompt(row, column_map=source.column_map, base=base)
                ids, value = picture.tokens.tolist(), column(row, "prompt", source.column_map)[1]
            else:
                ids, value = prompt_tokens(row, tokenizer, source.column_map)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if len(ids) > room:
            dropped += 1
            continue
        col = source.column_map.get("prompt", "prompt")
        kept.append((ids, value, {k: v for k, v in row.items() if k != col}))
        if images is not None:
            pictures.append(picture)
    if read == 0:
        raise UserError(f"{source.describe()} holds no rows; check dataset.split and dataset.data_files")
    if not kept:
        raise UserError(f"every prompt of {source.describe()} is longer than max_seq_len - max_completion_length = "
                        f"{room} tokens ({dropped} dropped); raise max_seq_len")
    if len({type(v) for _, v, _ in kept}) > 1:
        raise UserError(f"{source.describe()} mixes string prompts and conversations: use one or the other")
    return PromptSet(kept, read=read, dropped=dropped, completion_length=max_completion_length,
                     pictures=pictures if images is not None else None, maker=images)


def prompt_tokens(row: dict, tokenizer: Tokenizer, column_map: dict) -> tuple[list[int], object]:
    col, value = column(row, "prompt", column_map)
    if isinstance(value, str):
        return tokenizer.encode_as_transformers(value), value
    if isinstance(value, list):
        _check_messages(col, value)
        return tokenizer.encode_rendered(tokenizer.render(value, add_generation_prompt=True)), value
    raise UserError(f"column '{col}' must hold a string or a list of messages, found {type_name(value)}")
