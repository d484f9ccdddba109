"""The world a process trains in: join the one torchrun or SLURM gives, or be a world of one.

`distributed(flavor)` initialises the process group (gloo on the CPU, NCCL/RCCL on GPUs) and a
device mesh and yields a `World`; elastic.py starts the processes when the flavor needs several.
"""

import os
import signal
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moai_recipes.flavors import Flavor
from moai_recipes.launch import env


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _slurm_to_torch_env() -> None:
    """Map a SLURM job step (srun, one task per device) onto the variables torch.distributed reads."""
    e = os.environ
    if "RANK" in e or "SLURM_PROCID" not in e or int(e.get("SLURM_NTASKS", "1")) < 2:
        return
    e["RANK"], e["WORLD_SIZE"] = e["SLURM_PROCID"], e["SLURM_NTASKS"]
    e["LOCAL_RANK"] = e.get("SLURM_LOCALID", "0")
    # The node srun was started from (an sbatch script's first node, where rank 0 runs), and a port of the job's
    # own: two jobs sharing a node must not meet at the same one. An sbatch script may set both (docs/multinode.md).
    e.setdefault("MASTER_ADDR", e.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    e.setdefault("MASTER_PORT", str(20000 + (int(e.get("SLURM_JOB_ID", "0")) * 7 + int(e.get("SLURM_STEP_ID", "0"))) % 20000))


def in_launched_world() -> bool:
    _slurm_to_torch_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decided_by_main(world: World, decide):
    """`decide()` run on the main process only, its result handed to every process.

    For what every rank must agree on but that depends on a measurement (the plan: its step times use
    this machine's measured speed, and ranks measuring at once would disagree and then deadlock in
    FSDP's collectives). A UserError on the main process ends the group: the launcher stops the others.
    """
    box = [decide() if world.is_main else None]
    if world.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def stop_with_launcher() -> None:
    """In a worker our launcher started: receive SIGTERM when the launcher dies, even by kill -9.

    Otherwise the workers of a killed launcher train on unseen, and the same command run again would
    put a second group in the same folder. SIGTERM is what a scheduler's preemption sends: the run
    saves a checkpoint at the next step boundary and stops (train/loop.py). Linux only.
    """
    launcher = env.launcher_pid()
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != launcher:  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def distributed(flavor: Flavor):
    """Initialise the process group (gloo on CPU, NCCL/RCCL on GPUs) and a 1-D mesh; tear it down after."""
    if in_launched_world():
        stop_with_launcher()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        rank, world_size, local_rank = 0, 1, 0
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    if flavor.device.kind == "gpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=flavor.backend, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=30), device_id=device if device.type == "cuda" else None)
    try:
        mesh = init_device_mesh(device.type, (world_size,))
        yield World(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh)
    finally:
        dist.destroy_process_group()
