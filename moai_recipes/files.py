"""Files written so that a reader (a resuming run, `moai smi`, a user) never sees half of one, a write that finds the
disk full turned into the user's error it is (DiskFull: exit 2, the folder, the bytes, the way out; the aside copy
removed), and where this machine's caches live.

Every writer of a run (step checkpoints, the Hugging Face export, the adapter, metrics.jsonl, loss.png, W&B's files)
writes aside and renames. `room_for` wraps one process's write; `Writes` one rank's part of a write all ranks take
part in (a rank that finds the disk full goes on to the collective where they agree, instead of leaving the others
waiting in one). A full disk is ENOSPC or EDQUOT anywhere in what was raised (errors.is_disk_full).
"""

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from moai_recipes import env
from moai_recipes.errors import UserError, is_disk_full

cache_dir = env.cache_dir  # this machine's cache: where it is, env.py says


def demo_pictures_dir() -> Path:
    """Where the image-text demo's pictures are drawn into (data/pictures.demo_pictures), in this machine's cache."""
    return cache_dir() / "pictures-v2-2000-112"


def made_once(folder: Path, make) -> Path:
    """`folder`, made by `make(tmp)` in a folder beside it and renamed into place, unless a process made it before (a
    reader never sees half of it; of two processes making it at once, one keeps its own)."""
    if folder.exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        make(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not folder.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def sha256_of(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


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


class DiskFull(UserError):
    """A write found no room; the message says where, how much and what to do."""


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or would: its nearest existing parent)."""
    folder = Path(folder).resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def in_units(n: float) -> str:
    """Bytes as a person reads them: 3.0 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def disk_full(folder: Path, what: str, *, needed: int | None = None, resumes_from: Path | None = None) -> DiskFull:
    """The error of a write of `what` under `folder` that found the disk full; `resumes_from`: the run's last complete
    checkpoint, where the caller knows it."""
    need = f"; it needs about {in_units(needed)}" if needed else ""
    then = (f"the same command resumes from the last complete checkpoint ({resumes_from})" if resumes_from else
            "nothing written before is lost: the same command resumes from the run's last complete checkpoint, if it "
            "has one")
    return DiskFull(f"the disk of {folder} is full: {what} could not be written ({in_units(free_bytes(folder))} "
                    f"free{need}). Free space there, keep fewer step checkpoints (checkpoint_keep=1), or write to "
                    f"another disk (output_dir=...); {then}")


def remove(paths) -> None:
    """Delete files and folders (the aside copies of a write that failed)."""
    for path in paths:
        if path is not None and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path is not None:
            path.unlink(missing_ok=True)


@contextmanager
def room_for(folder: Path, what: str, *, needed: int | None = None, aside=(), resumes_from=lambda: None):
    """Write `what` under `folder` (one process's write); a full disk removes the `aside` copies and raises
    DiskFull. `resumes_from()`: the run's last complete checkpoint, looked up only then."""
    try:
        yield
    except BaseException as error:
        if not is_disk_full(error):
            raise
        remove(aside)
        raise disk_full(folder, what, needed=needed, resumes_from=resumes_from()) from None


class Writes:
    """One rank's part of a write every rank takes part in: a full disk is caught, not raised, so that the rank goes
    on to the collective where the ranks agree (`failed_anywhere`) instead of leaving the others waiting in one."""

    def __init__(self):
        self.full = False

    def run(self, write) -> None:
        """Call `write()` unless an earlier part found the disk full; a full disk is remembered, not raised."""
        if self.full:
            return
        try:
            write()
        except BaseException as error:
            if not is_disk_full(error):
                raise
            self.full = True

    def failed_anywhere(self) -> bool:
        """Whether any rank found the disk full (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.full
        # A group of NCCL alone reduces device tensors only (ours have gloo beside it for the host: flavors.backend).
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([float(self.full)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
