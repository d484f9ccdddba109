"""Disk space a run needs: its step checkpoints (as many as exist at once) and its export, checked against the free
space of its folder before the first step. A write that finds the disk full anyway (another user of a shared disk)
is files.py's DiskFull.
"""

from pathlib import Path

from moai_recipes.errors import UserError
from moai_recipes.files import free_bytes, in_units

# Bytes a step checkpoint holds per trainable value: the fp32 value and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_TRAINABLE = 12
# What else a run writes besides its checkpoints and its export (metrics, plan, config, loss.png, W&B's files).
SMALL_FILES = 4 * 2**20


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
        parts = [f"{min(saves, keep + 1)} step checkpoint(s) of {in_units(checkpoint)} at once (checkpoint_keep={keep}, "
                 "a new one is complete before the oldest goes)" if held else "",
                 f"the model of {in_units(export)}"]
        raise UserError(f"output_dir={out} is on a disk with {in_units(free)} free, but this run writes about "
                        f"{in_units(needed)}: {', '.join(p for p in parts if p)}; {in_units(needed - free)} short. Free space "
                        "there, lower checkpoint_keep= or checkpoint_every= (checkpoint_every=null: only when "
                        "stopped), or write to another disk (output_dir=...)")
