"""Files written so that a reader (a resuming run, `moai smi`, a user) never sees half of one."""

import json
import os
from pathlib import Path


def write_json(path: Path, value) -> None:
    """Write aside, then rename (atomic on POSIX); the pid keeps concurrent writers off each other's file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)
