"""The world a training process runs in: the one torchrun, SLURM or our launcher gave it, or a world of one.

`join_world(flavor)` initialises the process group (gloo on the CPU, NCCL/RCCL on GPUs) and a device mesh and
yields a `World`; launch/ starts the processes when the flavor needs several.
"""

import os
import select
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moai_recipes import env
from moai_recipes.flavors import Flavor


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    data_mesh: DeviceMesh  # replica x expert, flattened: the data-parallel devices (see DIMS)
    shard_mesh: DeviceMesh  # replica x expert x context, flattened: what FSDP2 shards the model over
    expert_shard_mesh: DeviceMesh  # replica x context, flattened: what FSDP2 shards experts split over `expert` over
    restarts: int = 0  # how many times a launcher has started this world again (after a dead worker, out of memory)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # The mesh's dimensions, outermost first: pipeline stages span nodes, tensor cuts stay inside one (the
    # devices of consecutive ranks share a node's fast links), and context devices sit next to them (they exchange
    # every layer's attention inputs). Data parallelism is `replica` x `expert`: both split the global batch (their
    # flattening is the `data` dimension), and a Mixture-of-Experts model's experts are split over `expert`
    # (train/expert_parallel.py). `context` devices share their samples' rows (train/context_parallel.py): FSDP2
    # shards the model over data x context (`shard`), and split experts over replica x context (`expert_shard`).
    DIMS = ("pipeline", "replica", "context", "expert", "tensor")

    def laid_out(self, plan) -> "World":
        """This world with the plan's mesh: pipeline x replica x expert x context x tensor devices
        (planner.plan.Plan)."""
        shape = (plan.pipeline_stages, plan.data_parallel // plan.expert_parallel, plan.context_parallel,
                 plan.expert_parallel, plan.tensor_parallel)
        if tuple(self.mesh.shape) == shape:
            return self
        mesh, data, shard, expert_shard = _mesh(self.device, shape)
        return replace(self, mesh=mesh, data_mesh=data, shard_mesh=shard, expert_shard_mesh=expert_shard)

    def dim(self, name: str) -> DeviceMesh:
        """One dimension of the mesh (DIMS, `data`, `shard` or `expert_shard`), as a 1-D mesh."""
        flattened = {"data": self.data_mesh, "shard": self.shard_mesh, "expert_shard": self.expert_shard_mesh}
        if name in flattened:
            return flattened[name]
        return self.mesh[name]

    def size(self, dim: str) -> int:
        return self.dim(dim).size()

    def coordinate(self, dim: str) -> int:
        """This process's place along a dimension of the mesh."""
        return self.dim(dim).get_local_rank()

    @property
    def data_rank(self) -> int:
        return self.coordinate("data")


def _mesh(device: torch.device, shape: tuple[int, ...]) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh, DeviceMesh]:
    """The device mesh of World.DIMS in `shape`, and flattened from it (kept as they are made: torch deprecates
    slicing a flattened dimension back out of the mesh) its `data` dimension (replica x expert), its `shard`
    dimension (data x context) and its `expert_shard` one (replica x context)."""
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=World.DIMS)
    data = mesh["replica", "expert"]._flatten("data")
    shard = mesh["replica", "context", "expert"]._flatten("shard") if shape[2] > 1 else data
    expert_shard = mesh["replica", "context"]._flatten("expert_shard") if shape[2] > 1 else mesh["replica"]
    return mesh, data, shard, expert_shard


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


def stop_with_launcher(launcher_pid: int) -> None:
    """In a worker our launcher started: receive SIGTERM when the launcher dies, even by kill -9.

    Otherwise the workers of a killed launcher train on unseen, and the same command run again would
    put a second group in the same folder. SIGTERM is what a scheduler's preemption sends: the run
    saves a checkpoint at the next step boundary and stops (train/loop.py). Linux only.

    The launcher is watched itself, by a pidfd that a thread waits on, sleeping until it ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except OSError:  # a kernel before 5.3: no pidfds; asked once a second instead
        launcher = None

    def stop_when_it_ends():
        if launcher is not None:
            select.select([launcher], [], [])
        else:
            while _alive(launcher_pid):
                time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_it_ends, name="moai-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's process has its pid now
        return False
    return True


@contextmanager
def join_world(flavor: Flavor, given: env.GivenWorld | None, *, restarts: int = 0):
    """Initialise the process group of the `given` world (None: a world of one; gloo on CPU, NCCL/RCCL on GPUs)
    and a mesh of data-parallel devices (World.laid_out gives it the plan's shape); tear it down after.
    `restarts`: how many times its launcher has started it again."""
    if given is None:
        given = env.GivenWorld(rank=0, world_size=1, local_rank=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    if flavor.device.kind == "gpu":
        device = torch.device("cuda", given.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=flavor.backend, init_method=given.init_method, rank=given.rank,
                            world_size=given.world_size, timeout=timedelta(minutes=30),
                            device_id=device if device.type == "cuda" else None)
    try:
        mesh, data, shard, expert_shard = _mesh(device, (1, given.world_size, 1, 1, 1))
        yield World(rank=given.rank, world_size=given.world_size, local_rank=given.local_rank, device=device, mesh=mesh,
                    data_mesh=data, shard_mesh=shard, expert_shard_mesh=expert_shard, restarts=restarts)
    finally:
        dist.destroy_process_group()
