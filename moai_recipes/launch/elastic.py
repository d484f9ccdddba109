"""Start a flavor's processes on this machine with torch.distributed's elastic launcher.

The user never types torchrun. Under torchrun or SLURM a recipe joins the world it is given; when
the flavor needs several processes on this machine it starts them itself with the elastic
launcher (the engine behind torchrun), each running the same command; with one process it just runs.
"""

import logging
import os
import sys
import uuid

from moai_recipes.errors import (
    EXIT_OUT_OF_MEMORY,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    UserError,
)
from moai_recipes.flavors import Flavor, local_capacity
from moai_recipes.launch import env
from moai_recipes.launch.world import free_port, in_launched_world


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


def relaunch(flavor: Flavor, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` on the flavor's processes with the elastic launcher; return the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n = flavor.num_devices
    env.set_launcher(os.getpid())  # the workers stop with us (world.stop_with_launcher)
    # Each worker gets its share of the cores, as torchrun would, instead of oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"moai-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
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
        if EXIT_OUT_OF_MEMORY in codes:  # a rank left a smaller plan; the others were stopped waiting for it
            return EXIT_OUT_OF_MEMORY
        if codes == [EXIT_STOPPED]:  # every worker saved and stopped on a signal (a scheduler's preemption)
            return EXIT_STOPPED
        print(f"error: worker process failed with exit code {codes} (see its output above)", file=sys.stderr)
        return 1
    return 0
