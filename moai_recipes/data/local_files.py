"""Rows of a local data file: JSON, JSONL, Parquet or CSV, each row named by its file and line (Parquet: row)
so that whoever refuses it can say where it is. Tested by `python -m pytest tests/test_data.py`."""

import csv
import io
import json
import os
import re
from pathlib import Path

from moai_recipes.errors import UserError
from moai_recipes.files import sha256_of

SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


def type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def fingerprint(path: str) -> str:
    """A digest of the file's bytes: what a tokenisation cache is keyed by (a file edited in place is new data)."""
    return sha256_of(path)



def check_file(path: str, *, key: str = "dataset.path") -> None:
    """Refuse a path that is not a readable data file, before anything reads it."""
    p = Path(path)
    if not p.is_file():
        what = "is not a file" if p.exists() else "does not exist"
        raise UserError(f"{key}={path} {what} (relative paths start from the current directory, {os.getcwd()})")
    if p.suffix.lower() not in SUFFIXES:
        raise UserError(f"{key}={path}: cannot read '{p.suffix.lower() or p.name}' files; use one of {', '.join(SUFFIXES)}")


def read_rows(path: str, *, key: str = "dataset.path"):
    """Yield (where, row) for each row of a local file, `where` naming the file and line (Parquet: row). `key` is
    the setting that named the file, for the messages. JSONL and Parquet are read a row at a time (streaming
    mode relies on it); JSON and CSV files are read whole."""
    check_file(path, key=key)
    p = Path(path)
    readers = {".json": _read_json, ".jsonl": _read_jsonl, ".parquet": _read_parquet, ".csv": _read_csv}
    suffix = p.suffix.lower()
    count = 0
    for where, row in readers[suffix](p if suffix in (".parquet", ".jsonl") else _read_text(p, path), path):
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object with named columns, got {type_name(row)}")
        count += 1
        yield where, row
    if count == 0:
        raise UserError(f"{path} is empty: it holds no rows")


def _read_text(p: Path, name: str) -> str:
    try:
        return p.read_text(encoding="utf-8-sig")  # -sig: tolerate the byte-order mark some editors write
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not UTF-8 text ({e}); save it as UTF-8") from None


def _jsonl_lines(source: Path | str, name: str):
    """(line number, line) of JSON lines text, or of a file read a line at a time."""
    if isinstance(source, str):
        # split("\n"), not splitlines(): JSON strings may hold raw U+2028, which splitlines breaks on.
        yield from enumerate(source.split("\n"), 1)
        return
    # newline="\n" for the same reason: a lone \r inside a string is not a line end either.
    with open(source, encoding="utf-8-sig", newline="\n") as f:
        n = 0
        try:
            for n, line in enumerate(f, 1):
                yield n, line
        except UnicodeDecodeError as e:
            raise UserError(f"{name}:{n + 1} is not UTF-8 text ({e}); save the file as UTF-8") from None


def _read_jsonl(source: Path | str, name: str):
    for n, line in _jsonl_lines(source, name):
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
