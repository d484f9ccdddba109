"""Processes for a flavor: join the world we are given, or start one with the elastic launcher.

The user never types torchrun. A recipe asks `launch_or_join` first: under torchrun or SLURM it
joins the world in the environment; when the flavor needs several processes on this machine it
starts them itself with torch.distributed's elastic launcher (the engine behind torchrun),
each running the same command; with one process it just runs.
"""

import logging
import os
import signal
import socket
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moai_recipes.errors import EXIT_USER_ERROR, UserError
from moai_recipes.flavors import Flavor, local_capacity

# A run stopped on SIGTERM/SIGINT at a step boundary, its state saved: not a failure to retry.
EXIT_STOPPED = 0
LAUNCHER_ENV = "MOAI_LAUNCHER_PID"  # set for the workers our launcher starts


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
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
    env.setdefault("MASTER_PORT", "29500")


def in_launched_world() -> bool:
    _slurm_to_torch_env()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def needs_launch(flavor: Flavor) -> bool:
    """True when this process must start the flavor's processes itself."""
    if in_launched_world():
        given = int(os.environ["WORLD_SIZE"])
        if given != flavor.num_devices:
            raise UserError(f"flavor {flavor.name} has {flavor.num_devices} devices but the launcher started "
                            f"{given} processes; start {flavor.num_devices} (torchrun --nproc_per_node ...) or pick a "
                            f"flavor of {given} devices")
        return False
    if flavor.num_devices == 1:
        _check_capacity(flavor)
        return False
    _check_capacity(flavor)
    return True


def _check_capacity(flavor: Flavor) -> None:
    have = local_capacity(flavor)
    if flavor.device.kind == "gpu" and have < flavor.num_devices:
        what = f"{have} GPU{'s' if have != 1 else ''}" if have else "no GPU"
        raise UserError(
            f"flavor {flavor.name} needs {flavor.num_devices} {flavor.device.name} devices but this machine has {what}. "
            f"Across several machines start it under torchrun or SLURM (one process per device); "
            f"to see how it would run, plan it here: python -m recipes.plan flavor=... model=... batch_size=...; "
            f"to train on this machine's CPU use flavor=cpu, cpu-2 or cpu-4")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(flavor: Flavor, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` on the flavor's processes with the elastic launcher; return the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n = flavor.num_devices
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers stop with us (stop_with_launcher)
    # Each worker gets its share of the cores, as torchrun would, instead of oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"moai-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                          rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", module, *argv)
    except SignalException:
        # The launcher was interrupted too: the workers got the signal, saved and stopped.
        return EXIT_STOPPED
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if EXIT_USER_ERROR in codes:
            return EXIT_USER_ERROR  # the worker already printed the message
        print(f"error: worker process failed with exit code {codes} (see its output above)", file=sys.stderr)
        return 1
    return 0


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
    saves a checkpoint at the next step boundary and stops (training.train_loop). Linux only.
    """
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before we asked
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
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
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
