"""Step checkpoints: the whole recipe state, sharded with torch.distributed.checkpoint, never half-written.

A checkpoint holds what changes during training — the trainable parameters and their optimizer
state (DCP, each rank writes its shards), the LR schedule, every rank's RNG, the step and the data
position (a GLOBAL sample index) — plus the plan. The frozen base of a LoRA run is not saved: it
is the Hugging Face checkpoint the run started from. DCP reshards on load, so a checkpoint made on
`cpu-2` resumes on `cpu` or `cpu-4`; the global batches do not depend on the flavor, so the loss
curve continues as if nothing had changed.

Layout: output_dir/checkpoints/step-000004/{*.distcp, .metadata, train_state.pt, rng-rank*.pt, meta.json}.
It is written as .step-000004.tmp and renamed when complete; only renamed folders count. What a save
cost (seconds, bytes) is returned; the run's log keeps it in output_dir/checkpoints.jsonl (metrics.py).
"""

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)


from moai_recipes import env
from moai_recipes.checkpoint.integrity import all_gathered, checksums
from moai_recipes.checkpoint.no_code import SafeLoadPlanner, SafeReader, UnsafeCheckpoint, load_data
from moai_recipes.errors import UserError
from moai_recipes.files import Writes, disk_full, remove
from moai_recipes.checkpoint.output_dir import (
    checkpoint_dir,
    complete_checkpoints,
    read_meta,
)


@dataclass
class TrainState:
    """What a training step changes, and so what a step checkpoint holds (of the model: the trainable part)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object  # an LR scheduler: state_dict() and load_state_dict()
    # What else a step changes, of the objective's own (recipes.grpo: the completions it trains on again next step):
    # state_dict() on every rank (it may gather), the same global value on each; load_state_dict(). None: nothing.
    objective: object = None


def _trainable_state(model: nn.Module, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {"model": {k: v for k, v in model_sd.items() if k in trainable}, "optim": optim_sd}


def save_checkpoint(out: Path, state: TrainState, meta: dict, *, world, keep: int) -> tuple[Path, float, int]:
    """Write the state after `meta["step"]` steps, with `meta` (the step, the data position `samples_seen`,
    the flavor and the plan) in its meta.json; keep the newest `keep`. Returns (folder, seconds, bytes).
    Every rank must call it."""
    start = time.perf_counter()
    final = checkpoint_dir(out, meta["step"])
    tmp = final.with_name(f".{final.name}.tmp")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
    trainable = _trainable_state(state.model, state.optimizer)
    objective = state.objective.state_dict() if state.objective is not None else None  # every rank: it may gather

    def shards():  # every rank's part
        dcp.save(trainable, checkpoint_id=str(tmp))  # a failure on any rank is raised on every rank
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / f"rng-rank{world.rank}.pt")

    def complete():  # the main rank's, once every shard is on disk: the checkpoint becomes visible
        time.sleep(env.fault_save_delay())
        torch.save({"scheduler": state.scheduler.state_dict(), "objective": objective}, tmp / "train_state.pt")
        files = {**shared_sums, **checksums(tmp, skip=tuple(shared_sums))}  # and train_state.pt
        about = {**meta, "world_size": world.world_size, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "files": dict(sorted(files.items()))}
        (tmp / "meta.json").write_text(json.dumps(about, indent=2) + "\n")
        if final.exists():  # a resumed run saving the same step again: the old one goes only once the new is in place
            old = final.with_name(f".{final.name}.old.tmp")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)

    # A full disk on any rank ends the save on every rank (they agree after each part), leaves no .tmp and keeps
    # the last complete checkpoint, which the same command resumes.
    writes = Writes()
    if world.is_main:
        writes.run(lambda: tmp.mkdir(parents=True))
    shared_sums = {}
    if not writes.failed_anywhere():  # also the barrier: the folder exists
        writes.run(shards)
        if not writes.failed_anywhere():
            # Every rank hashes its share of the files all ranks wrote; the main rank records them all.
            shared_sums = {k: v for part in all_gathered(checksums(tmp, (world.rank, world.world_size)))
                           for k, v in part.items()}
            if world.is_main:
                writes.run(complete)
    if writes.failed_anywhere():
        if world.is_main:
            remove([tmp])
        raise disk_full(final.parent, f"the checkpoint of step {meta['step']}", needed=_global_bytes(trainable),
                        resumes_from=(complete_checkpoints(out) or [None])[-1])
    size = 0
    if world.is_main:
        for old in complete_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        size = sum(f.stat().st_size for f in final.iterdir())
    dist.barrier()
    return final, time.perf_counter() - start, size


def _global_bytes(state: dict) -> int:
    """Bytes of a state dict's tensors, whole (a DTensor's shape is the whole tensor's)."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _global_bytes(value)
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def load_checkpoint(path: Path, state: TrainState, world) -> dict:
    """Restore a checkpoint into the (already sharded, base-loaded) model, the optimizer and the schedule;
    returns its meta."""
    try:
        return _load(path, state, world)
    except UnsafeCheckpoint as unsafe:
        raise UserError(f"{unsafe.path}: not loaded: {unsafe.why}. A step checkpoint holds tensors and plain values "
                        "only, and this file asks to run code. Resume from a checkpoint this project wrote, or start "
                        "again without resume=") from None


def _load(path: Path, state: TrainState, world) -> dict:
    # Read as data only (checkpoint/no_code.py): a checkpoint folder from elsewhere never runs code here.
    saved = _trainable_state(state.model, state.optimizer)
    reader, planner = SafeReader(path), SafeLoadPlanner(path)
    try:
        dcp.load(saved, storage_reader=reader, planner=planner)
    except BaseException:  # DCP wraps (and sometimes words anew) what its reader and planner raised
        refused = reader.refused or planner.refused
        if refused:
            raise refused from None
        raise
    set_state_dict(state.model, state.optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                   options=StateDictOptions(strict=False))
    train_state = load_data(path / "train_state.pt")
    state.scheduler.load_state_dict(train_state["scheduler"])
    if state.objective is not None:
        state.objective.load_state_dict(train_state.get("objective"))
    rng = path / f"rng-rank{world.rank}.pt"
    if rng.exists():  # a rank the saving run did not have keeps its own seed
        states = load_data(rng)
        torch.set_rng_state(states["cpu"])
        if states["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
    return read_meta(path)


def resume(path: Path, state: TrainState, batches, world) -> dict:
    """Restore the checkpoint at `path` and move `batches` (data.batches or data.stream) to the step after it;
    returns its meta."""
    meta = load_checkpoint(path, state, world)
    batches.resume(meta["step"], meta)
    return meta
