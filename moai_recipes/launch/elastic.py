"""Start a flavor's processes on this machine with torch.distributed's elastic launcher (the engine behind
torchrun), each on the worker entry (launch/worker.py) with the job file the launcher wrote.

The user never types torchrun. Under torchrun or SLURM a recipe joins the world it is given instead
(launch/entry.py).
"""

import logging
import sys
import uuid
from pathlib import Path

from moai_recipes.errors import (
    EXIT_FAILURE,
    EXIT_OUT_OF_MEMORY,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    UserError,
)
from moai_recipes.flavors import Flavor, local_capacity
from moai_recipes.train.world import free_port


def check_capacity(flavor: Flavor) -> None:
    """A UserError when this machine lacks the GPUs the flavor's processes need."""
    have = local_capacity(flavor)
    if flavor.device.kind == "gpu" and have < flavor.num_devices:
        what = f"{have} GPU{'s' if have != 1 else ''}" if have else "no GPU"
        raise UserError(
            f"flavor {flavor.name} needs {flavor.num_devices} {flavor.device.name} devices but this machine has {what}. "
            f"Across several machines start it under torchrun or SLURM (one process per device); "
            f"to see how it would run, plan it here: python -m recipes.plan flavor=... model=... batch_size=...; "
            f"to train on this machine's CPU use flavor=cpu, cpu-2 or cpu-4")


def start_workers(flavor: Flavor, job_file: Path) -> int:
    """Run `python -m moai_recipes.launch.worker job_file` on the flavor's processes until they end; return the
    group's exit code (errors.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=flavor.num_devices,
                          run_id=f"moai-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"is_host": True}, max_restarts=0,
                          monitor_interval=0.1)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "moai_recipes.launch.worker", str(job_file))
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
        return EXIT_FAILURE
    return 0
