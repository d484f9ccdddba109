"""A training process: join the world and call the recipe's `train(cfg, flavor, world)`.

`forked(JOB_FILE)` is what the elastic launcher runs in each of a flavor's processes, forked from the launcher
once it imported the recipe (launch/elastic.py); `python -m moai_recipes.launch.worker JOB_FILE` runs the same in a
process of its own (a GPU flavor's workers). It reads the job the launcher wrote (the recipe, its resolved config,
the flavor) and never composes the config again. A recipe that trains in the process that composed its config (one
process, or one of torchrun's or SLURM's) calls `run` directly.
"""

import gc
import importlib
import json
import os
import signal
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moai_recipes import env
from moai_recipes.checkpoint.output_dir import shared_by_worker
from moai_recipes.config.compose import resolved_config
from moai_recipes.errors import (
    EXIT_FAILURE,
    EXIT_OUT_OF_MEMORY,
    EXIT_REDO,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    RedoSkipping,
    RestartSmaller,
    Stopped,
    UserError,
    exit_on_user_error,
)
from moai_recipes.files import write_json
from moai_recipes.flavors import Device, Flavor
from moai_recipes.launch.registry import registered
from moai_recipes.train.world import join_world, stop_with_launcher


@dataclass(frozen=True)
class Job:
    """What a training process runs: everything its launcher decided, so that no process decides it again."""

    recipe: str  # full_finetune, lora_finetune: moai_recipes.recipes.<recipe>.train
    cfg: DictConfig  # composed, validated, output_dir and model.checkpoint_dir pinned
    flavor: Flavor
    job_id: str  # the `moai smi` job
    launcher: int | None = None  # the pid of our launcher, which the workers stop with
    restarts: int = 0  # how many times the launcher has started the processes again

    def write(self, path: Path) -> None:
        write_json(path, {"recipe": self.recipe, "flavor": asdict(self.flavor), "job_id": self.job_id,
                          "launcher": self.launcher, "restarts": self.restarts,
                          "cfg": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)})

    @classmethod
    def read(cls, path: Path) -> "Job":
        d = json.loads(Path(path).read_text())
        flavor = Flavor(**{**d["flavor"], "device": Device(**d["flavor"]["device"])})
        return cls(recipe=d["recipe"], cfg=resolved_config(d["recipe"], d["cfg"]), flavor=flavor, job_id=d["job_id"],
                   launcher=d["launcher"], restarts=d["restarts"])


def run(job: Job, given: env.GivenWorld | None) -> int:
    """Train `job` in the `given` world (None: a world of one); the exit code (errors.py)."""
    if job.launcher is not None:  # first: a launcher killed while we import must not leave us training
        stop_with_launcher(job.launcher)
    train = importlib.import_module(f"moai_recipes.recipes.{job.recipe}").train
    restarts = max(job.restarts, env.restart_count())  # ours, or torchrun's
    while True:
        with join_world(job.flavor, given, restarts=restarts) as world:
            try:
                train(job.cfg, job.flavor, world)
                return 0
            except Stopped as e:
                if world.is_main:
                    print(e, flush=True)
                return EXIT_STOPPED
            except RestartSmaller as e:
                # The other ranks wait inside a collective that will never come: leave at once, without the process
                # group's teardown, and let the launcher (ours, or torchrun) start them all again with the smaller
                # plan.
                print(f"Rank {world.rank}: {e}", file=sys.stderr, flush=True)
                os._exit(EXIT_OUT_OF_MEMORY)
            except RedoSkipping as e:
                if world.is_main:
                    print(e, flush=True)
                if world.world_size > 1:  # every rank leaves here; the launcher starts them all again
                    os._exit(EXIT_REDO)
        # One process starts again by itself, its last run's objects gone with the exception.
        gc.collect()
        restarts += 1


def user_error_file(job_file: Path) -> Path:
    """Where the first worker of a launched group that meets a user's mistake leaves its message for the
    launcher, which prints it (launch/elastic.start_workers)."""
    return Path(job_file).with_suffix(".error")


def leave_user_error(job_file: Path, error: UserError) -> None:
    """Leave `error`'s message for the launcher, unless another worker left one first. Printing it here would race:
    the rank that fails first ends the group, and the launcher stops the others, rank 0 among them, before they
    print what they found (seen: a malformed dataset row refused on cpu-2 with nothing said)."""
    try:
        fd = os.open(user_error_file(job_file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(error))


@exit_on_user_error
def main(argv: list[str]) -> int:
    (path,) = argv
    job = Job.read(Path(path))
    shared_by_worker(job.cfg.output_dir)  # the folder stays held while this worker lives, its launcher gone or not
    with registered(job.flavor, job_id=job.job_id, launcher=job.launcher):
        try:
            return run(job, env.given_world())
        except UserError as e:
            if job.launcher is None:  # torchrun's or SLURM's process: rank 0 says it (errors.exit_on_user_error)
                raise
            leave_user_error(Path(path), e)
            return EXIT_USER_ERROR


def forked(job_file: str) -> None:
    """The elastic launcher's entry in each process it forks (launch/elastic.py): `main`, its code the exit code.
    A crash prints its traceback here, as `python -m` would: the launcher's multiprocessing would only pass it up."""
    # Forked from the launcher, this process has its signal handlers (the elastic agent's, which raise in whatever
    # runs): those of a process of its own until training sets its own (train/loop.py).
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main([job_file])
    except Exception:
        traceback.print_exc()
        code = EXIT_FAILURE
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
