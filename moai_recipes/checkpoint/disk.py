"""Disk space: what a run will write, checked before its first step, and a write that finds the disk full turned
into the user's error it is (exit 2, naming the folder, the bytes and the way out) with nothing half-written left.

Every writer of a run (step checkpoints, the Hugging Face export, the adapter, metrics.jsonl, loss.png, W&B's
files) writes aside and renames; `room_for` wraps such a write: on ENOSPC or EDQUOT anywhere in what it raised (DCP
gathers its ranks' failures into one CheckpointException) it removes the aside copy and raises DiskFull.
"""

import shutil
from contextlib import contextmanager
from pathlib import Path

from moai_recipes.checkpoint.output_dir import complete_checkpoints
from moai_recipes.errors import UserError, is_disk_full

# Bytes a step checkpoint holds per trainable value: the fp32 value and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_TRAINABLE = 12
# What else a run writes besides its checkpoints and its export (metrics, plan, config, loss.png, W&B's files).
SMALL_FILES = 4 * 2**20


class DiskFull(UserError):
    """A write found no room; the message says where, how much and what to do."""


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or would: its nearest existing parent)."""
    folder = Path(folder).resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def way_out(run: Path | None) -> str:
    """What to do after a full disk in the run folder `run`: free space, keep fewer checkpoints or write elsewhere,
    then run the same command again."""
    last = complete_checkpoints(run) if run else []
    then = (f"the same command resumes from the last complete checkpoint ({last[-1]})" if last else
            "nothing written before is lost")
    return (f"Free space there, keep fewer step checkpoints (checkpoint_keep=1), or write to another disk "
            f"(output_dir=...); {then}")


def disk_full(folder: Path, what: str, *, needed: int | None = None, run: Path | None = None) -> DiskFull:
    """The error of a write of `what` under `folder` (of the run folder `run`) that found the disk full."""
    need = f"; it needs about {size(needed)}" if needed else ""
    return DiskFull(f"the disk of {folder} is full: {what} could not be written ({size(free_bytes(folder))} "
                    f"free{need}). {way_out(run)}")


def remove(paths) -> None:
    for path in paths:
        if path is not None and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path is not None:
            path.unlink(missing_ok=True)


@contextmanager
def room_for(folder: Path, what: str, *, needed: int | None = None, aside=(), run: Path | None = None):
    """Write `what` under `folder` (one process's write); a full disk removes the `aside` copies and raises
    DiskFull."""
    try:
        yield
    except BaseException as error:
        if not is_disk_full(error):
            raise
        remove(aside)
        raise disk_full(folder, what, needed=needed, run=run) from None


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
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([float(self.full)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def check_room(out: Path, *, checkpoint: int, saves: int, keep: int, export: int, reclaimable: int = 0) -> None:
    """Refuse, before the first step, a run whose checkpoints and export cannot fit the free space of `out`.

    `checkpoint`: bytes of one step checkpoint; `saves`: how many this run makes; `keep`: checkpoint_keep (a new one
    is written whole before the oldest goes, so keep + 1 exist for a moment); `export`: the final model or adapter;
    `reclaimable`: bytes of the earlier checkpoints a resumed run will replace.
    """
    held = min(saves, keep + 1) * checkpoint
    needed = held + export + SMALL_FILES - reclaimable
    free = free_bytes(out)
    if needed > free:
        parts = [f"{min(saves, keep + 1)} step checkpoint(s) of {size(checkpoint)} at once (checkpoint_keep={keep}, "
                 "a new one is complete before the oldest goes)" if held else "",
                 f"the model of {size(export)}"]
        raise UserError(f"output_dir={out} is on a disk with {size(free)} free, but this run writes about "
                        f"{size(needed)}: {', '.join(p for p in parts if p)}; {size(needed - free)} short. Free space "
                        "there, lower checkpoint_keep= or checkpoint_every= (checkpoint_every=null: only when "
                        "stopped), or write to another disk (output_dir=...)")
