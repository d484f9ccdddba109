"""A run's folder: never overwrite an earlier run, and write the resolved config and the plan."""

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moai_recipes.errors import UserError

# What marks a folder as holding an earlier run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "plan.json", "model", "adapter", "checkpoints")


def check_output_dir(output_dir: str) -> Path:
    """Refuse a folder that holds an earlier run; an empty or missing folder is fine."""
    out = Path(output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir={output_dir} is a file; give a folder")
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found:
        raise UserError(f"output_dir={output_dir} holds an earlier run ({', '.join(found)}); pass another "
                        f"output_dir=... or remove that folder")
    return out


def write_json(path: Path, value) -> None:
    """Write aside, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def write_config(out: Path, cfg: DictConfig) -> None:
    tmp = out / ".config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(tmp, out / "config.yaml")
