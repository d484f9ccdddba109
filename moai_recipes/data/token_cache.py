"""Tokenised samples as flat arrays, written once to this machine's cache and memory-mapped by every run after.

A dataset is tokenised once per (data, tokenizer, settings): the key digests the data's bytes (or the
datasets library's fingerprint), the tokenizer's files, the kind, max_seq_len, column_map,
train_on_input and the source of the code that tokenises. A second run, every rank of a run and a
restarted run map the same files instead of tokenising again; the arrays are read from the page
cache, so a run's own memory does not grow with the data. The first process to come builds the
folder under a file lock while any other waits; it is written aside and renamed, so a reader never
sees half of one. Tested by `python -m pytest tests/test_data.py`.
"""

import array
import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moai_recipes.errors import UserError
from moai_recipes.files import cache_dir

_FLUSH_TOKENS = 1 << 20  # a writer holds at most about this many tokens (8 MiB) before appending them to disk


class TokenArrays:
    """Samples end to end: sample i is tokens[offsets[i]:offsets[i + 1]] with its labels alongside."""

    def __init__(self, tokens: np.ndarray, labels: np.ndarray, offsets: np.ndarray, meta: dict):
        self.tokens, self.labels, self.offsets, self.meta = tokens, labels, offsets, meta


class TokenWriter:
    """Collects samples; into files of `folder` as they come (bounded memory), or in memory without one."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder
        self._tokens, self._labels = array.array("i"), array.array("i")
        self._offsets = array.array("q", [0])
        self._files = None if folder is None else [open(folder / "tokens.bin", "wb"), open(folder / "labels.bin", "wb")]

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def add(self, tokens: list[int], labels: list[int]) -> None:
        self._tokens.extend(tokens)
        self._labels.extend(labels)
        self._offsets.append(self._offsets[-1] + len(tokens))
        if self._files and len(self._tokens) >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for f, values in zip(self._files, (self._tokens, self._labels)):
            f.write(values.tobytes())
            del values[:]

    def finish(self, meta: dict) -> TokenArrays:
        offsets = np.frombuffer(self._offsets, dtype=np.int64)
        if self._files is None:
            return TokenArrays(np.frombuffer(self._tokens, dtype=np.int32),
                               np.frombuffer(self._labels, dtype=np.int32), offsets, meta)
        self._flush()
        for f in self._files:
            f.close()
        np.save(self.folder / "offsets.npy", offsets)
        (self.folder / "meta.json").write_text(json.dumps(meta) + "\n")
        return open_arrays(self.folder)

    def close(self) -> None:
        for f in self._files or ():
            f.close()


def open_arrays(folder: Path) -> TokenArrays:
    offsets = np.load(folder / "offsets.npy")
    n = int(offsets[-1])
    # An empty file cannot be mapped; a dataset always has tokens, but be exact.
    tokens = np.memmap(folder / "tokens.bin", dtype=np.int32, mode="r", shape=(n,)) if n else np.zeros(0, np.int32)
    labels = np.memmap(folder / "labels.bin", dtype=np.int32, mode="r", shape=(n,)) if n else np.zeros(0, np.int32)
    return TokenArrays(tokens, labels, offsets, json.loads((folder / "meta.json").read_text()))


def cache_key(parts: dict) -> str:
    """A digest of what the tokens depend on, the tokenising code included (a change to it is a new cache)."""
    here = Path(__file__).parent
    code = hashlib.sha256()
    for name in ("datasets.py", "tokenizer.py", "token_cache.py"):
        code.update((here / name).read_bytes())
    return hashlib.sha256(json.dumps({**parts, "code": code.hexdigest()}, sort_keys=True).encode()).hexdigest()[:32]


def existing_tokens(key: str) -> TokenArrays | None:
    """The arrays cached under `key`, if a process has built them."""
    folder = cache_dir() / "tokenized" / key
    return open_arrays(folder) if (folder / "meta.json").exists() else None


def cached_tokens(key: str, build) -> tuple[TokenArrays, bool]:
    """The arrays cached under `key`, built by `build(writer) -> meta` if no process has yet; and whether this
    call built them."""
    root = cache_dir() / "tokenized"
    folder = root / key
    if (folder / "meta.json").exists():
        return open_arrays(folder), False
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f"{key}.lock"):
            if (folder / "meta.json").exists():  # another process built it while this one waited
                return open_arrays(folder), False
            tmp = root / f".{key}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            writer = TokenWriter(tmp)
            try:
                writer.finish(build(writer))
                os.replace(tmp, folder)
            finally:
                writer.close()
                shutil.rmtree(tmp, ignore_errors=True)  # a full disk or a bad row leaves nothing half-written
    except OSError as e:
        raise UserError(f"cannot write the tokenised data to {root} ({e.strerror or e}); free space there, set "
                        "MOAI_CACHE=DIR to cache elsewhere, or dataset.cache=false to tokenise in memory") from None
    return open_arrays(folder), True


@contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
