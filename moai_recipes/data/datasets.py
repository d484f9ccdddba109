"""Fine-tuning datasets from local files: instruct, chat, text, and the embedded demo.

Rows are read from JSON, JSONL, Parquet or CSV, turned into tokens and shifted labels at load (so a bad
row fails before training, naming its file and line), and truncated to max_seq_len.
Tested by `python -m pytest tests/test_data.py`.
"""

import csv
import io
import json
import os
import re
from pathlib import Path

import torch

from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError
from moai_recipes.models.tiny import DEMO_DATA
from moai_recipes.train.loss import IGNORE_INDEX

COLUMNS = {"instruct": ("instruction", "input", "output"), "chat": ("messages",), "text": ("text",)}
KINDS = ("demo", "instruct", "chat", "text")
# ShareGPT speaks of human and gpt; the rest is OpenAI's naming.
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised samples; labels[j] is the target of position j (tokens[j + 1]) or IGNORE_INDEX."""

    def __init__(self, samples: list[tuple[list[int], list[int]]], *, dropped: int = 0):
        # int32 tensors: a list of Python ints costs ~36 bytes a token.
        self._tokens = [torch.tensor(t, dtype=torch.int32) for t, _ in samples]
        self._labels = [torch.tensor(l, dtype=torch.int32) for _, l in samples]
        self.dropped = dropped  # rows with no target token left after truncation

    def __len__(self):
        return len(self._tokens)

    def __getitem__(self, i) -> dict:
        return {"tokens": self._tokens[i].tolist(), "labels": self._labels[i].tolist()}

    def length(self, i) -> int:
        return len(self._tokens[i])

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(t) for t in self._tokens)

    def num_target_tokens(self, i) -> int:
        return int((self._labels[i] != IGNORE_INDEX).sum())


def collate(samples: list[dict], *, pad_id: int) -> dict:
    """Right-pad a batch to its longest sample: tokens with pad_id, labels with IGNORE_INDEX."""
    width = max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens[row, : len(s["tokens"])] = torch.tensor(s["tokens"], dtype=torch.long)
        labels[row, : len(s["labels"])] = torch.tensor(s["labels"], dtype=torch.long)
    return {"tokens": tokens, "labels": labels}


def load_dataset(*, kind: str, path: str | None, tokenizer: Tokenizer, max_seq_len: int,
                 column_map: dict | None = None, train_on_input: bool = False) -> SFTDataset:
    """Read and tokenise a whole dataset file; prompts are masked from the loss unless train_on_input."""
    if kind not in KINDS:
        raise UserError(f"dataset.kind={kind} is not a dataset kind; use one of {', '.join(KINDS)}")
    if path is None and kind != "demo":
        raise UserError(f"dataset={kind} reads a local file: set dataset.path=FILE (.json, .jsonl, .parquet or .csv)")
    path = str(DEMO_DATA if path is None else path)
    reads = "instruct" if kind == "demo" else kind
    column_map = dict(column_map or {})
    unknown = sorted(set(column_map) - set(COLUMNS[reads]))
    if unknown:
        raise UserError(f"dataset.column_map.{unknown[0]} is not a column of dataset={kind}, which reads "
                        f"{', '.join(COLUMNS[reads])}; remove it or map one of those")
    samples, dropped = [], 0
    for where, row in read_rows(path):
        try:
            tokens, masked = _tokenize_row(row, reads, tokenizer, column_map)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        tokens, masked = tokens[:max_seq_len], masked[:max_seq_len]
        labels = _shifted_labels(tokens, [False] * len(tokens) if train_on_input else masked)
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
        else:
            samples.append((tokens, labels))
    if not samples:
        raise UserError(f"no row of {path} keeps a token to train on within max_seq_len={max_seq_len} ({dropped} "
                        "dropped); raise max_seq_len, or check that the rows have answers")
    return SFTDataset(samples, dropped=dropped)


def _tokenize_row(row: dict, kind: str, tokenizer: Tokenizer, column_map: dict) -> tuple[list[int], list[bool]]:
    if kind == "text":
        tokens = tokenizer.encode(_string(row, "text", column_map))
        return tokens, [False] * len(tokens)
    to_messages = _instruct_messages if kind == "instruct" else _chat_messages
    return tokenizer.tokenize_messages(to_messages(row, column_map))


def _shifted_labels(tokens: list[int], masked: list[bool]) -> list[int]:
    # The last position has no next token to predict.
    return [IGNORE_INDEX if m else t for t, m in zip(tokens[1:], masked[1:])] + [IGNORE_INDEX] * bool(tokens)


# --- rows -> messages -------------------------------------------------------------------------


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _column(row: dict, name: str, column_map: dict):
    col = column_map.get(name, name)
    if col not in row:
        present = ", ".join(map(str, row)) or "none"
        raise UserError(f"no '{col}' column (columns present: {present}); map it with dataset.column_map.{name}=NAME")
    return col, row[col]


def _string(row: dict, name: str, column_map: dict, *, optional: bool = False) -> str:
    if optional and column_map.get(name, name) not in row:
        return ""
    col, value = _column(row, name, column_map)
    if optional and value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"column '{col}' must be a string, got {_type_name(value)}")
    return value


def _instruct_messages(row: dict, column_map: dict) -> list[dict]:
    prompt = _string(row, "instruction", column_map)
    extra = _string(row, "input", column_map, optional=True)
    if extra:
        prompt += "\n\n" + extra
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _string(row, "output", column_map)}]


def _chat_messages(row: dict, column_map: dict) -> list[dict]:
    if "messages" not in column_map and "messages" not in row and "conversations" in row:
        column_map = {"messages": "conversations"}  # ShareGPT files name the column so
    col, value = _column(row, "messages", column_map)
    if isinstance(value, str):  # CSV cells hold the list as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"column '{col}' holds text that is not a valid JSON list of messages: {e.msg}") from None
    if not isinstance(value, list):
        raise UserError(f"column '{col}' must be a list of messages, got {_type_name(value)}")
    if not value:
        raise UserError(f"column '{col}' holds no messages")
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise UserError(f"message {j} of '{col}' must be an object with role and content, got {_type_name(m)}")
        role = m.get("role") or m.get("from")
        content = m["content"] if "content" in m else m.get("value")
        if role not in ROLES:
            raise UserError(f"message {j} of '{col}' has role {role!r}; use system, user or assistant "
                            "(ShareGPT: human, gpt)")
        if not isinstance(content, str):
            raise UserError(f"message {j} of '{col}' must have string content, got {_type_name(content)}")
        messages.append({"role": ROLES[role], "content": content})
    return messages


# --- files -> rows ----------------------------------------------------------------------------


def read_rows(path: str):
    """Yield (where, row) for each row of a local file, `where` naming the file and line (Parquet: row)."""
    p = Path(path)
    if not p.is_file():
        what = "is not a file" if p.exists() else "does not exist"
        raise UserError(f"dataset.path={path} {what} (relative paths start from the current directory, {os.getcwd()})")
    readers = {".json": _read_json, ".jsonl": _read_jsonl, ".parquet": _read_parquet, ".csv": _read_csv}
    suffix = p.suffix.lower()
    if suffix not in readers:
        raise UserError(f"dataset.path={path}: cannot read '{suffix or p.name}' files; use one of {', '.join(readers)}")
    source = p if suffix == ".parquet" else _read_text(p, path)
    count = 0
    for where, row in readers[suffix](source, path):
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object with named columns, got {_type_name(row)}")
        count += 1
        yield where, row
    if count == 0:
        raise UserError(f"{path} is empty: it holds no rows")


def _read_text(p: Path, name: str) -> str:
    try:
        return p.read_text(encoding="utf-8-sig")  # -sig: tolerate the byte-order mark some editors write
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not UTF-8 text ({e}); save it as UTF-8") from None


def _read_jsonl(text: str, name: str):
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028, which splitlines breaks on.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{name}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
        yield f"{name}:{n}", row


def _read_json(text: str, name: str):
    """A list of objects, or JSON lines saved as .json."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise UserError(f"{name}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        yield from _read_jsonl(text, name)
        return
    if not isinstance(data, list):
        line = text[: len(text) - len(text.lstrip())].count("\n") + 1
        yield f"{name}:{line}", data
        return
    yield from zip((f"{name}:{n}" for n in _element_lines(text)), data)


def _element_lines(text: str):
    """The line each element of a (valid) top-level JSON list starts on."""
    decoder, separator = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    line, counted = 1, 0
    while True:
        pos = separator.match(text, pos).end()
        if text[pos] == "]":
            return
        line, counted = line + text.count("\n", counted, pos), pos
        yield line
        _, pos = decoder.raw_decode(text, pos)


def _read_parquet(p: Path, name: str):
    import pyarrow
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(p).iter_batches()
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield f"{name} row {n}", row
    except pyarrow.ArrowException as e:
        raise UserError(f"{name} is not a readable Parquet file: {e}") from None


def _read_csv(text: str, name: str):
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        if reader.fieldnames is None:
            return
        start = reader.line_num
        for row in reader:
            yield f"{name}:{start + 1}", row
            start = reader.line_num
    except csv.Error as e:
        raise UserError(f"{name}:{reader.line_num}: not valid CSV: {e}") from None
