"""Whether a step checkpoint holds what was written to it.

Its meta.json lists each of its files with its size and SHA-256 (`checksums`, at save). `damage` reads them back: a
missing, truncated or changed file is named, so a resume never loads a damaged checkpoint silently
(checkpoint/output_dir.py passes over it to the one before). The hashing is shared: with `share=(rank, ranks)` a
process hashes every ranks-th file only (SHA-256 runs at about 1 GB/s a core; a 70B model's full training state is
840 GB), and the sizes of all. A Hugging Face folder's shards are checked against their own headers
(models/hf_format.py).
"""

import json
from pathlib import Path

from moai_recipes.files import sha256_of


def all_gathered(value) -> list:
    """Every process's `value`, in rank order (a collective; one process: [value])."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def checksums(folder: Path, share: tuple[int, int] = (0, 1), *, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """{file name: {bytes, sha256}} of this share of the files of `folder` (all: share (0, 1)), but meta.json (which
    holds them) and `skip`."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in ("meta.json", *skip))
    rank, ranks = share
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)}
            for name in names[rank::ranks]}


def damage(checkpoint: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with a step checkpoint (None: every file as saved): every file's presence and size, and the
    SHA-256 of this share of them. A checkpoint saved before checksums were recorded is taken as it is."""
    try:
        files = json.loads((checkpoint / "meta.json").read_text()).get("files", {})
    except (OSError, ValueError) as e:
        return f"{checkpoint / 'meta.json'} cannot be read ({e})"
    for name, want in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        have = path.stat().st_size
        if have != want["bytes"]:
            return f"{path} is {'truncated' if have < want['bytes'] else 'longer than saved'} ({have} of {want['bytes']} bytes)"
    rank, ranks = share
    for name in sorted(files)[rank::ranks]:
        if sha256_of(checkpoint / name) != files[name]["sha256"]:
            return f"{checkpoint / name} is damaged (its SHA-256 differs from the one saved)"
    return None
