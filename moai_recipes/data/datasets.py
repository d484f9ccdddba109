"""Fine-tuning datasets: instruct, chat, text and the embedded demo, from a local file or a Hugging Face dataset.

Rows come from a local JSON, JSONL, Parquet or CSV file (local_files.py) or from a Hub dataset id or a
local dataset folder through the datasets library (hf_datasets.py). They are turned into tokens and
shifted labels before training (so a bad row fails first, named by its file and line), truncated to
max_seq_len, and kept as flat arrays, cached on disk (token_cache.py). Tested by
`python -m pytest tests/test_data.py tests/test_hf_datasets.py`.
"""

import hashlib
import json
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from moai_recipes.data import hf_datasets, local_files
from moai_recipes.data.images import collate_images
from moai_recipes.data.hf_datasets import HFSplit
from moai_recipes.data.local_files import type_name
from moai_recipes.data.token_cache import (
    TokenArrays,
    TokenWriter,
    cache_key,
    cached_tokens,
    existing_tokens,
)
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError
from moai_recipes.models.tiny import DEMO_DATA
from moai_recipes.models.loss import IGNORE_INDEX

COLUMNS = {"instruct": ("instruction", "input", "output"), "chat": ("messages", "images"), "text": ("text",),
           "preference": ("prompt", "chosen", "rejected"), "prompt": ("prompt",)}
KINDS = ("demo", "instruct", "chat", "text", "preference", "prompt")
# ShareGPT speaks of human and gpt, some exports of bot; a role not named here (tool, ipython, function) goes to
# the chat template as it is, which renders it or says it cannot.
ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant"}


@dataclass(frozen=True)
class DataSource:
    """What to read and how to make samples of it: a local file (`path`), a Hugging Face split (`hf`), or the
    embedded demo; and the settings the tokens depend on."""

    kind: str
    path: str | None = None
    hf: HFSplit | None = None
    column_map: dict = field(default_factory=dict)
    train_on_input: bool = False
    key: str = "dataset.path"  # the setting that named `path`, for messages

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UserError(f"dataset.kind={self.kind} is not a dataset kind; use one of {', '.join(KINDS)}")
        if self.path is not None and self.hf is not None:
            raise UserError(f"dataset.path={self.path} and dataset.source={self.hf.source} both name the data; "
                            "keep one")
        if self.path is None and self.hf is None and self.kind != "demo":
            raise UserError(f"dataset={self.kind} reads a local file or a Hugging Face dataset: set "
                            "dataset.path=FILE (.json, .jsonl, .parquet or .csv) or dataset.source=OWNER/NAME|FOLDER")
        unknown = sorted(set(self.column_map) - set(COLUMNS[self.reads]))
        if unknown:
            raise UserError(f"dataset.column_map.{unknown[0]} is not a column of dataset={self.kind}, which reads "
                            f"{', '.join(COLUMNS[self.reads])}; remove it or map one of those")

    @property
    def reads(self) -> str:
        """The row layout read: the demo is instruct rows."""
        return "instruct" if self.kind == "demo" else self.kind

    def describe(self) -> str:
        return self.hf.describe() if self.hf else (self.path or "embedded demo")

    def open(self, *, streaming: bool = False):
        """(rows, fingerprint, number of rows if known): `rows` yields (where, row); `fingerprint` digests the
        data (None: unknown, as for a stream)."""
        if self.hf is not None:
            ds = hf_datasets.open_split(self.hf, streaming=streaming)
            return hf_datasets.rows(ds, self.hf), hf_datasets.fingerprint(ds), hf_datasets.num_rows(ds)
        path = str(DEMO_DATA if self.path is None else self.path)
        local_files.check_file(path, key=self.key)
        rows = local_files.read_rows(path, key=self.key)
        return rows, None if streaming else local_files.fingerprint(path), None


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised samples; labels[j] is the target of position j (tokens[j + 1]) or IGNORE_INDEX. Backed by
    flat arrays (memory-mapped from the cache), optionally seen through a subset of sample indices."""

    def __init__(self, arrays: TokenArrays, index: np.ndarray | None = None, *, origin: str = "memory"):
        self._a = arrays
        self.origin = origin  # tokenised (and cached now), cache (tokenised by an earlier run), memory (not cached)
        self._index = np.arange(len(arrays.offsets) - 1) if index is None else index
        self.dropped: int = arrays.meta.get("dropped", 0)  # rows with no target token left after truncation
        self.rows: int = arrays.meta.get("rows", len(self._index))

    def __len__(self):
        return len(self._index)

    def _span(self, i) -> slice:
        j = self._index[i]
        return slice(int(self._a.offsets[j]), int(self._a.offsets[j + 1]))

    def __getitem__(self, i) -> dict:
        span = self._span(i)
        return {"tokens": self._a.tokens[span].tolist(), "labels": self._a.labels[span].tolist()}

    def fingerprint(self) -> str:
        """A digest of the samples as tokenised: their tokens, labels and bounds, in this subset's order."""
        digest = hashlib.sha256(np.ascontiguousarray(self._index).data)
        for array in (self._a.tokens, self._a.labels, self._a.offsets):
            digest.update(np.ascontiguousarray(array).data)  # a memory map is hashed in place, not copied
        return digest.hexdigest()

    def length(self, i) -> int:
        j = self._index[i]
        return int(self._a.offsets[j + 1] - self._a.offsets[j])

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(np.diff(self._a.offsets)[self._index].tolist())

    def num_target_tokens(self, i) -> int:
        return int((self._a.labels[self._span(i)] != IGNORE_INDEX).sum())

    def split_off(self, fraction: float, *, seed: int) -> tuple["SFTDataset", "SFTDataset"]:
        """(train, validation): a seeded `fraction` of the samples held out, the same whatever the flavor."""
        train, val = held_out(len(self), fraction, seed=seed)
        return (SFTDataset(self._a, self._index[train], origin=self.origin),
                SFTDataset(self._a, self._index[val], origin=self.origin))


def held_out(count: int, fraction: float, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) sample indices: a seeded `fraction` of `count` samples held out, the same on any flavor."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919)
    order = torch.randperm(count, generator=g).numpy()
    n_val = round(fraction * count)
    if n_val == 0 or n_val == count:
        raise UserError(f"dataset.val_split={fraction:g} of {count} samples leaves "
                        f"{'no validation sample' if n_val == 0 else 'nothing to train on'}; use a fraction "
                        f"that keeps both (at least {1 / count:.2g})" if count > 1 else
                        "dataset.val_split needs at least 2 samples; give a validation file with dataset.val_path")
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def collate(samples: list[dict], *, pad_id: int) -> dict:
    """Right-pad a batch to its longest sample: tokens with pad_id, labels with IGNORE_INDEX."""
    width = max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens[row, : len(s["tokens"])] = torch.tensor(s["tokens"], dtype=torch.long)
        labels[row, : len(s["labels"])] = torch.tensor(s["labels"], dtype=torch.long)
    if any("images" in s for s in samples):  # an image-text model's samples (data/images.py)
        return {"tokens": tokens, "labels": labels, "images": collate_images(samples, width)}
    return {"tokens": tokens, "labels": labels}


def load_dataset(source: DataSource, tokenizer: Tokenizer, *, max_seq_len: int, cache: bool = False,
                 write_cache: bool = True, progress: bool = False) -> SFTDataset:
    """Tokenise a whole dataset; prompts are masked from the loss unless source.train_on_input.

    `cache`: reuse (and, with `write_cache`, write) the tokens cached on disk for this data, tokenizer and
    settings; else tokenise in memory. `progress`: a bar on stderr while tokenising."""
    rows, digest, total = source.open()
    build = lambda writer: _tokenize_all(rows, source, tokenizer, max_seq_len, writer,
                                         progress=progress, total=total)
    if not cache or digest is None:
        return SFTDataset(_in_memory(build), origin="memory")
    key = cache_key({"data": digest, "tokenizer": tokenizer.fingerprint(), "kind": source.kind,
                     "column_map": dict(sorted(source.column_map.items())), "train_on_input": source.train_on_input,
                     "max_seq_len": max_seq_len})
    if not write_cache:
        arrays = existing_tokens(key)
        return SFTDataset(arrays, origin="cache") if arrays is not None else SFTDataset(_in_memory(build), origin="memory")
    arrays, built = cached_tokens(key, build)
    return SFTDataset(arrays, origin="tokenised" if built else "cache")


def _in_memory(build) -> TokenArrays:
    writer = TokenWriter()
    return writer.finish(build(writer))


def sample_from_row(row: dict, source: DataSource, tokenizer: Tokenizer, max_seq_len: int):
    """(tokens, labels) of one row, truncated; None when no target token is left."""
    tokens, masked = _tokenize_row(row, source.reads, tokenizer, source.column_map)
    tokens, masked = tokens[:max_seq_len], masked[:max_seq_len]
    labels = _shifted_labels(tokens, [False] * len(tokens) if source.train_on_input else masked)
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return tokens, labels


def _tokenize_all(rows, source: DataSource, tokenizer: Tokenizer, max_seq_len: int, writer: TokenWriter, *,
                  progress: bool, total: int | None) -> dict:
    n_rows = dropped = 0
    bar = tqdm(rows, total=total, unit=" rows", desc=f"Tokenising {source.describe()}", disable=not progress,
               file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 15, leave=False)
    for where, row in bar:
        n_rows += 1
        try:
            sample = sample_from_row(row, source, tokenizer, max_seq_len)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if sample is None:
            dropped += 1
        else:
            writer.add(*sample)
    bar.close()
    if n_rows == 0:
        raise UserError(f"{source.describe()} holds no rows; check dataset.split and dataset.data_files")
    if not len(writer):
        raise UserError(f"no row of {source.describe()} keeps a token to train on within max_seq_len={max_seq_len} "
                        f"({dropped} dropped); raise max_seq_len, or check that the rows have answers")
    return {"rows": n_rows, "dropped": dropped, "samples": len(writer)}


def _tokenize_row(row: dict, kind: str, tokenizer: Tokenizer, column_map: dict) -> tuple[list[int], list[bool]]:
    if kind == "text":
        tokens = tokenizer.encode(_string(row, "text", column_map))
        return tokens, [False] * len(tokens)
    if kind == "instruct":
        return tokenizer.tokenize_messages(_instruct_messages(row, column_map))
    messages = _chat_messages(row, column_map)
    for j, m in enumerate(messages):
        if m["role"] not in tokenizer.roles:
            col = column_map.get("messages", "messages")
            template = "the chat template of " + tokenizer.name if tokenizer.has_chat_template else "a model without a chat template"
            raise UserError(f"message {j} of '{col}' has role {m['role']!r}, which {template} does not know; "
                            f"use {', '.join(tokenizer.roles)} (ShareGPT: human, gpt)")
    return tokenizer.tokenize_messages(messages)


def _shifted_labels(tokens: list[int], masked: list[bool]) -> list[int]:
    # The last position has no next token to predict.
    return [IGNORE_INDEX if m else t for t, m in zip(tokens[1:], masked[1:])] + [IGNORE_INDEX] * bool(tokens)


# --- rows -> messages -------------------------------------------------------------------------


def column(row: dict, name: str, column_map: dict):
    col = column_map.get(name, name)
    if col not in row:
        present = ", ".join(map(str, row)) or "none"
        raise UserError(f"no '{col}' column (columns present: {present}); map it with dataset.column_map.{name}=NAME")
    return col, row[col]


def _string(row: dict, name: str, column_map: dict, *, optional: bool = False) -> str:
    if optional and column_map.get(name, name) not in row:
        return ""
    col, value = column(row, name, column_map)
    if optional and value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"column '{col}' must be a string, got {type_name(value)}")
    return value


def _instruct_messages(row: dict, column_map: dict) -> list[dict]:
    prompt = _string(row, "instruction", column_map)
    extra = _string(row, "input", column_map, optional=True)
    if extra:
        prompt += "\n\n" + extra
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _string(row, "output", column_map)}]


def image_refusal(j: int, col: str) -> UserError:
    """What a text recipe or model says of a message holding an image part."""
    return UserError(f"message {j} of '{col}' holds an image: images are trained by recipes.full_finetune, "
                     "recipes.lora_finetune, recipes.dpo and recipes.grpo, with an image-text model (Qwen2.5-VL, "
                     "Qwen3-VL, Gemma 3, Llama 3.2 Vision) "
                     "as model.checkpoint_dir; this model or recipe reads text only")


def _chat_messages(row: dict, column_map: dict) -> list[dict]:
    if "messages" not in column_map and "messages" not in row and "conversations" in row:
        column_map = {"messages": "conversations"}  # ShareGPT files name the column so
    col, value = column(row, "messages", column_map)
    if isinstance(value, str):  # CSV cells hold the list as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"column '{col}' holds text that is not a valid JSON list of messages: {e.msg}") from None
    if not isinstance(value, list):
        raise UserError(f"column '{col}' must be a list of messages, got {type_name(value)}")
    if not value:
        raise UserError(f"column '{col}' holds no messages")
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise UserError(f"message {j} of '{col}' must be an object with role and content, got {type_name(m)}")
        role = m.get("role") or m.get("from")
        content = m["content"] if "content" in m else m.get("value")
        if not isinstance(role, str) or not role:
            raise UserError(f"message {j} of '{col}' has role {role!r}; give each message a role (system, user, "
                            "assistant, or one the model's chat template knows, such as tool)")
        if isinstance(content, list) and all(isinstance(p, dict) for p in content):
            if any(p.get("type") == "image" for p in content):
                raise image_refusal(j, col)
            if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                content = "".join(p["text"] for p in content)  # text parts, as TRL's conversational rows hold them
        if not isinstance(content, str):
            raise UserError(f"message {j} of '{col}' must have string content, got {type_name(content)}")
        # Other keys (name, tool_calls) are kept for templates that render them.
        extra = {k: v for k, v in m.items() if k not in ("role", "from", "content", "value")}
        messages.append({**extra, "role": ROLES.get(role, role), "content": content})
    return messages
