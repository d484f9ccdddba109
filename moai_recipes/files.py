"""Files written so that a reader (a resuming run, `moai smi`, a user) never sees half of one, and where this
machine's caches live."""

import json
import os
from pathlib import Path

from moai_recipes import env


def cache_dir() -> Path:
    """The cache of this machine (MOAI_CACHE, else ~/.cache/moai-recipes): the tiny checkpoint, converted models,
    the CPU's measured speed, the planner's layer traces."""
    return env.cache_dir()


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
