"""Whether a step checkpoint holds what was written to it.

Its meta.json lists each of its files with its size and SHA-256 (`checksums`, at save). `damage` reads them back: a
missing, truncated or changed file is named, so a resume never loads a damaged checkpoint silently
(checkpoint/output_dir.py passes over it to the one before). A Hugging Face folder's shards are checked against their
own headers (models/hf_format.py).
"""

import hashlib
import json
from pathlib import Path

_CHUNK = 8 * 2**20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(folder: Path) -> dict[str, dict]:
    """{file name: {bytes, sha256}} of every file of `folder` but meta.json (which holds them)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "meta.json"}


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a step checkpoint (None: every file as saved). A checkpoint saved before checksums
    were recorded is taken as it is."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"{checkpoint / 'meta.json'} cannot be read ({e})"
    for name, want in meta.get("files", {}).items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        have = path.stat().st_size
        if have != want["bytes"]:
            return f"{path} is {'truncated' if have < want['bytes'] else 'longer than saved'} ({have} of {want['bytes']} bytes)"
        if _sha256(path) != want["sha256"]:
            return f"{path} is damaged (its SHA-256 differs from the one saved)"
    return None
