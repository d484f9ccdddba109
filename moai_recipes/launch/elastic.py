"""Start a flavor's processes on this machine with torch.distributed's elastic launcher (the engine behind
torchrun), each on the worker entry (launch/worker.py) with the job file the launcher wrote.

The user never types torchrun. Under torchrun or SLURM a recipe joins the world it is given instead
(launch/entry.py).
"""

import importlib
import logging
import sys
import uuid
from pathlib import Path

from omegaconf import DictConfig

from moai_recipes import env
from moai_recipes.errors import (
    EXIT_FAILURE,
    EXIT_OUT_OF_MEMORY,
    EXIT_REDO,
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


def forks_workers(flavor: Flavor) -> bool:
    """Whether the flavor's workers are forked from the launcher, which imported the recipe (prepare_workers), rather
    than started bare, each importing it again: on the CPU. A GPU's processes start bare: torchao and torchtune ask
    the GPU its capability as they are imported, which sets CUDA up in the importing process, and CUDA cannot be
    used in a process forked from one that set it up. MOAI_FORK_WORKERS=0 starts a CPU flavor's bare too."""
    return flavor.device.kind == "cpu" and env.fork_workers()


def prepare_workers(recipe: str, cfg: DictConfig | None = None) -> None:
    """Import the training recipe `recipe` here, in the launcher, before anything else runs (forks_workers), and what
    reading the run's inputs `cfg` will import (inputs.import_ahead): each worker is then forked from this process
    with the training stack (torch, torchtune, torchao, the recipe, the model's code) imported once, rather than
    started bare to import it all again (cpu-4's 4 processes on 2 cores started in 7.0 s against 11.5 s).

    Forked from the launcher itself, not from a fork server of its own: a fork server is one more interpreter that
    imports torch and the recipe again (4 s of CPU a run, 40% of what a short cpu-2 run spends). What the launcher
    runs besides by the time it forks (the rendezvous store's server thread of the elastic agent) a forked worker
    never touches: it joins the store as a client, and ends by os._exit, with no destructor run. The workers stop
    when the launcher dies (train/world.stop_with_launcher)."""
    importlib.import_module(f"moai_recipes.recipes.{recipe}")
    if cfg is not None:
        from moai_recipes.inputs import import_ahead

        import_ahead(cfg)


def _cheap_event_names() -> None:
    """torch's rendezvous names each event it records after the method recording it, found by inspect.stack(): that
    reads the source of every frame on the stack, 0.8 s of each launch with the training stack imported (a third of a
    cpu-2 launcher's time). The same name, read from the frame itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a shallower stack, as torch's own answers it
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def start_workers(flavor: Flavor, job_file: Path, recipe: str) -> int:
    """Run the worker entry on `job_file` in the flavor's processes until they end; return the group's exit code
    (errors.py). Forked (forks_workers): launch/worker.forked, from this process, which imported `recipe` (the job's
    moai_recipes.recipes.<recipe>); else bare: python -m moai_recipes.launch.worker job_file."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # It logs a failed worker as a traceback of its own process pool: the worker printed what went wrong already
    # (worker.forked), and this process says which exit code ended the group.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Nor the pids it stops once one worker has failed: this process says why the group ended.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    from moai_recipes.launch import worker

    _cheap_event_names()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=flavor.num_devices,
                          run_id=f"moai-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"is_host": True}, max_restarts=0,
                          monitor_interval=0.1, start_method="fork")
    try:
        if forks_workers(flavor):
            prepare_workers(recipe)  # imported already, unless the caller did not
            elastic_launch(config, entrypoint=worker.forked)(str(job_file))
        else:
            elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "moai_recipes.launch.worker", str(job_file))
    except SignalException:
        # The launcher was interrupted too: the workers got the signal, saved and stopped.
        return EXIT_STOPPED
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if EXIT_USER_ERROR in codes:
            said = worker.user_error_file(job_file)
            if said.exists():  # the first worker that met the mistake left its message
                print(f"error: {said.read_text()}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        if EXIT_OUT_OF_MEMORY in codes:  # a rank left a smaller plan; the others were stopped waiting for it
            return EXIT_OUT_OF_MEMORY
        if EXIT_REDO in codes:  # every rank left to redo the steps since the last checkpoint, one skipped
            return EXIT_REDO
        if codes == [EXIT_STOPPED]:  # every worker saved and stopped on a signal (a scheduler's preemption)
            return EXIT_STOPPED
        print(f"error: worker process failed with exit code {codes} (see its output above)", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:
        if _interrupted(e, SignalException):
            return EXIT_STOPPED
        raise
    return 0


def _interrupted(error: BaseException, signalled: type) -> bool:
    """Whether `error` came of a signal to this process (a `signalled` in its chain of causes). torch's metrics
    wrapper (elastic/metrics/api.prof) reads the clock inside its try: a SIGTERM that lands before that raises
    the SignalException there, and its finally then fails on the clock it never read, an UnboundLocalError over the
    signal (seen once in a suite of 2026-11-28, the workers saved and stopped as asked)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, signalled):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
