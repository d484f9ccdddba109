"""A training recipe's command: compose its config once, then train in this process or start the flavor's.

    python -m recipes.full_finetune KEY=VALUE ...          (the checkout; recipes/ holds one-line shims)
    python -m moai_recipes.launch full_finetune KEY=VALUE  (moai run full_finetune, from any folder)

One way down. This process composes the config and resolves the flavor, once:
- a flavor of one process, or a process torchrun or SLURM started: it trains here (worker.run);
- a flavor of several processes on this machine: it pins what every process must share (the output folder, the
  model's folder), writes the job (worker.Job) to a file and starts the processes on launch/worker.py, which
  read it: on the CPU forked from this process once it imported the recipe (launch/elastic.prepare_workers), on
  GPUs started bare. A worker that dies (killed, out of memory) does not end the job: the processes are started
  again, up to `max_restarts` times, and resume from the last checkpoint.
"""

import gc
import os
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from moai_recipes import env
from moai_recipes.checkpoint.output_dir import check_output_dir, holding_run_folder, read_hint, run_finished
from moai_recipes.config.compose import load_config
from moai_recipes.errors import (
    EXIT_OUT_OF_MEMORY,
    EXIT_REDO,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    UserError,
    exit_on_user_error,
)
from moai_recipes.flavors import Flavor, resolve_flavor
from moai_recipes.launch.registry import new_job_id, registered
from moai_recipes.models.sources import model_source, resolve_model_dir

if TYPE_CHECKING:
    from moai_recipes.launch.worker import Job

TRAINING_RECIPES = ("full_finetune", "lora_finetune", "dpo", "grpo")  # what `train(cfg, flavor, world)` moai_recipes.recipes has


@exit_on_user_error
def main(recipe: str, argv: list[str] | None = None) -> int:
    """Run the training recipe `recipe` (full_finetune) with the command line `argv`; return the exit code
    (errors.py)."""
    cfg = load_config(recipe, sys.argv[1:] if argv is None else argv)
    # Imported once the config composed: `--cfg job`, `--help` and a mistyped key answer without torch's import
    # (2.5 s -> 0.45 s), which the processes and the training need.
    from moai_recipes.launch.worker import Job, run

    flavor = resolve_flavor(**cfg.flavor)
    given = env.given_world()
    check_world(flavor, given)
    job = Job(recipe=recipe, cfg=cfg, flavor=flavor, job_id=new_job_id())
    launching = given is None and flavor.num_devices > 1
    # The run folder is this run's while it lives (torchrun's and SLURM's processes: rank 0 holds it for them).
    holding = holding_run_folder(cfg.output_dir, workers=launching) if given is None or given.rank == 0 else nullcontext()
    with holding, registered(flavor, job_id=job.job_id):  # `moai smi` lists the run until it ends
        return launch(job) if launching else run(job, given)


def check_world(flavor: Flavor, given: env.GivenWorld | None) -> None:
    """A UserError when the world torchrun or SLURM gave is not the flavor's, or (none given) when this machine
    lacks the flavor's devices."""
    from moai_recipes.launch.elastic import check_capacity

    if given is None:
        check_capacity(flavor)
    elif given.world_size != flavor.num_devices:
        raise UserError(f"flavor {flavor.name} has {flavor.num_devices} devices but the launcher started "
                        f"{given.world_size} processes; start {flavor.num_devices} (torchrun --nproc_per_node ...) "
                        f"or pick a flavor of {given.world_size} devices")


@contextmanager
def _one_thread():
    import torch  # imported by what runs inside anyway; not before a refused command needs it

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def launch(job: "Job") -> int:
    """Start the job's processes on this machine and wait for them; start them again after a dead worker (up to
    max_restarts) or an out-of-memory step (each time with a smaller plan, so this ends)."""
    from moai_recipes.launch.elastic import forks_workers, prepare_workers, start_workers
    from moai_recipes.launch.worker import Job

    cfg, flavor = job.cfg, job.flavor
    # What must not differ between the processes, decided here once: the folder (a timestamped default would
    # differ) and the model's folder (the tiny default made, a Hub download fetched once).
    check_output_dir(cfg, verify=False)  # refused early; the workers' rank 0 reads the checkpoint back
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    # Making the tiny default model here (a fresh cache) must not start an OpenMP team in a process that forks the
    # workers: libgomp is not fork-safe, and each forked worker hung at its first parallel region (seen: cpu-2's first
    # run on a new machine, stuck in RoPE's cos). One thread runs no parallel region; the workers start their own.
    forked = forks_workers(flavor)
    with _one_thread() if forked else nullcontext():
        cfg.model.checkpoint_dir = str(resolve_model_dir(**model_source(cfg)))
        if forked:  # after the checks above: a refused command does not wait for the imports
            prepare_workers(job.recipe, cfg)
    # This process only waits now: what it holds (torch's modules) lives until it exits, when the last collection
    # would walk it all for nothing (0.5 s after the workers end; train/process.py freezes the workers' too), and
    # a forked worker shares it untouched.
    gc.freeze()
    failures = starts = 0
    with tempfile.TemporaryDirectory(prefix="moai-job-") as folder:
        while True:
            job_file = Path(folder) / f"job-{starts}.json"
            Job(recipe=job.recipe, cfg=cfg, flavor=flavor, job_id=job.job_id, launcher=os.getpid(),
                restarts=starts).write(job_file)
            starts += 1
            code = start_workers(flavor, job_file, job.recipe)
            hint = read_hint(Path(cfg.output_dir)) if code == EXIT_OUT_OF_MEMORY else None
            if hint:
                # A step ran out of memory on a rank: it left a smaller plan, which the processes take as they start
                # again (train/out_of_memory.py). Each time smaller, so this ends; not a failure to count.
                print(f"Starting the {flavor.num_devices} processes again with plan.micro_batch_size="
                      f"{hint['micro_batch_size']}, resuming from the last checkpoint (or the first step)", flush=True)
                continue
            if code == EXIT_REDO:  # a partly applied step that proved not finite: redone skipped (errors.py)
                print(f"Starting the {flavor.num_devices} processes again to redo the steps since the last checkpoint",
                      flush=True)
                continue
            if code not in (0, EXIT_USER_ERROR, EXIT_STOPPED) and run_finished(cfg):
                # The folder held no finished run when we started (check_output_dir), so this launch wrote every
                # output before the failure: a worker died on its way out (gloo can abort at exit), and a restart
                # would only refuse the finished folder.
                print(f"warning: a worker failed while exiting (exit code {code}) after the run had saved "
                      f"everything in {cfg.output_dir}; nothing is lost", file=sys.stderr, flush=True)
                return 0
            if code in (0, EXIT_USER_ERROR, EXIT_STOPPED) or failures == cfg.max_restarts:
                return code
            failures += 1
            print(f"A worker failed (exit code {code}): restarting the {flavor.num_devices} processes, resuming from "
                  f"the last checkpoint (restart {failures} of max_restarts={cfg.max_restarts})", flush=True)

