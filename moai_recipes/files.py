"""Files written so that a reader (a resuming run, `moai smi`, a user) never sees half of one, and where this
machine's caches live."""

import json
import os
from pathlib import Path

from moai_recipes import env

cache_dir = env.cache_dir  # this machine's cache: where it is, env.py says


def write_text(path: Path, text: str) -> None:
    """Write aside, then rename (atomic on POSIX); the pid keeps concurrent writers off each other's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk leaves nothing half-written behind


def write_json(path: Path, value) -> None:
    write_text(path, json.dumps(value, indent=2) + "\n")
