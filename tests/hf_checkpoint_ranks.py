"""The two-process halves of tests/test_hf_checkpoint.py: FSDP2-sharded loads, saves and exports on two gloo processes.

    python -m tests.hf_checkpoint_ranks load_and_save|export_memory RENDEZVOUS JOBS_JSON

The test forks it from its zygote (tests/zygote.py: the stack imported once, no thread started), and it forks its two
ranks: a fork of a process that ran no torch threads is safe for gloo, and spares each rank the imports a spawned
one pays again (6 s of CPU a rank).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.hf_format import HFFolder, load_weights, save_weights

SEQ = 128


def tokens_for(hf: HFFolder) -> torch.Tensor:
    """The rows both ranks and the test's transformers reference run (the test imports it from here)."""
    return torch.randint(0, hf.spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _exit_cleanly() -> None:
    """End a worker that did its work. torch 2.13's gloo can abort while the interpreter exits, after
    destroy_process_group ("terminate called without an active exception", about 1 run in 20 of these
    tests): everything is written, so leave without running C++ static destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(rank: int, work, world_size: int, rendezvous: str, jobs: list[tuple[str, str, str]]) -> None:
    """One rank of the gloo world: `work(rank, mesh, *job)` for each job, then leave together."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for job in jobs:
            work(rank, mesh, *job)
        dist.barrier()  # rank 0 writes last: both are done before either tears gloo down
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def _sharded(folder: str, mesh) -> tuple[HFFolder, torch.nn.Module]:
    """Build on meta, shard, give memory, load: the recipe's path."""
    from moai_recipes.train.parallel import shard_model

    hf = HFFolder.open(folder)
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=SEQ)
    shard_model(model, mesh=mesh, param_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf)
    return hf, model


def _load_and_save(rank: int, mesh, folder: str, out_dir: str, logits_file: str) -> None:
    """Load sharded, run, save: the logits (rank 0's) and the saved checkpoint are the test's to compare."""
    hf, model = _sharded(folder, mesh)
    with torch.no_grad():
        logits = model.eval()(tokens_for(hf))
    if rank == 0:
        torch.save(logits, logits_file)
    save_weights(model, hf, Path(out_dir), rank=rank)


def _export_memory(rank: int, mesh, folder: str, out_dir: str, peaks_file: str) -> None:
    """Load sharded, then export under MemTracker; writes the peak of the bytes the export added on this rank."""
    from torch.distributed._tools.mem_tracker import MemTracker

    hf, model = _sharded(folder, mesh)
    tracker = MemTracker()
    tracker.track_external(model)  # the shards exist already: their views (to_local) are not new memory
    before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
    with tracker:
        save_weights(model, hf, Path(out_dir), rank=rank)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    Path(f"{peaks_file}.{rank}").write_text(str(peak - before))


WORK = {"load_and_save": _load_and_save, "export_memory": _export_memory}

if __name__ == "__main__":
    work, rendezvous, jobs = sys.argv[1], sys.argv[2], json.loads(Path(sys.argv[3]).read_text())
    mp.start_processes(_rank, args=(WORK[work], 2, rendezvous, [tuple(job) for job in jobs]), nprocs=2, join=True,
                       start_method="fork")
