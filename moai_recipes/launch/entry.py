"""A recipe's entry point: compose its config, resolve the flavor, start or join the processes, train.

Both training recipes run through `run_recipe`, so the launch logic lives once. When the flavor
needs several processes, a worker that dies (killed, out of memory) does not end the job: the
processes are started again, up to `max_restarts` times, and resume from the last checkpoint.

This module stays light: a process that only starts the workers reads the config and never imports
the recipe (torch's models, torchtune, the data libraries: seconds that every run of several
processes would otherwise pay once more before its workers start).
"""

import gc
import importlib
import sys
from pathlib import Path

from omegaconf import DictConfig

from moai_recipes.checkpoint.run_folder import check_output_dir, read_hint, run_finished
from moai_recipes.config.compose import load_config
from moai_recipes.config.user_settings import switched_flavor
from moai_recipes.errors import (
    EXIT_OUT_OF_MEMORY,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    Stopped,
    exit_on_user_error,
)
from moai_recipes.flavors import Flavor, resolve_flavor
from moai_recipes.launch import env
from moai_recipes.launch.elastic import needs_launch, relaunch
from moai_recipes.launch.registry import registered
from moai_recipes.launch.world import distributed
from moai_recipes.models.sources import model_source, resolve_checkpoint_dir


def run_recipe(module: str, argv: list[str] | None = None) -> int:
    """Run the `train(cfg, flavor, world)` of the recipe module `module` (moai_recipes.recipes.full_finetune) on
    every process the flavor needs; return the exit code (errors.py).

    The recipe's config is configs/<its last name>.yaml, and the processes a flavor launches run that module."""
    argv = sys.argv[1:] if argv is None else argv
    recipe = module.rpartition(".")[2]
    # Read `moai switch`'s choice once: workers started (or restarted) later must not see a newer one.
    argv = [*argv, *switched_flavor(argv)]
    cfg = load_config(recipe, argv)
    flavor = resolve_flavor(**cfg.flavor)
    with registered(flavor):  # `moai smi` lists the run until it ends
        return _launch_or_train(module, argv, cfg, flavor)


@exit_on_user_error
def recipe_main(module: str, argv: list[str] | None = None) -> int:
    """run_recipe as a command's entry point (python -m recipes.full_finetune, moai run full_finetune)."""
    return run_recipe(module, argv)


def _train_function(module: str):
    """The recipe's `train`; the module running as `python -m` (__main__) is not imported a second time."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (main if spec is not None and spec.name == module else importlib.import_module(module)).train


def _launch_or_train(module: str, argv: list[str], cfg: DictConfig, flavor: Flavor) -> int:
    if needs_launch(flavor):
        # The user never types torchrun: start the flavor's processes, each running this same
        # command, with what must not differ between them (the output folder, the checkpoint) pinned.
        check_output_dir(cfg)
        checkpoint_dir = resolve_checkpoint_dir(**model_source(cfg))
        worker_argv = [*argv, f"output_dir={cfg.output_dir}", f"model.checkpoint_dir={checkpoint_dir}"]
        # This process only waits now: what it holds (torch's modules) lives until it exits, when the last
        # collection would walk it all for nothing (0.5 s after the workers end; train/loop.py does the same).
        gc.freeze()
        attempt = starts = 0
        while True:
            env.set_restart(starts)
            starts += 1
            code = relaunch(flavor, module, worker_argv)
            hint = read_hint(Path(cfg.output_dir)) if code == EXIT_OUT_OF_MEMORY else None
            if hint:
                # A step ran out of memory on a rank: it left a smaller plan, which the processes take as they
                # start again (train/out_of_memory.py). Each time smaller, so this ends; not a failure to count.
                print(f"Starting the {flavor.num_devices} processes again with plan.micro_batch_size="
                      f"{hint['micro_batch_size']}, resuming from the last checkpoint (or the first step)", flush=True)
                continue
            if code not in (0, EXIT_USER_ERROR, EXIT_STOPPED) and run_finished(cfg):
                # The folder held no finished run when we started (check_output_dir), so this launch
                # wrote every output before the failure: a worker died on its way out (gloo can abort
                # at exit), and a restart would only refuse the finished folder.
                print(f"warning: a worker failed while exiting (exit code {code}) after the run had saved "
                      f"everything in {cfg.output_dir}; nothing is lost", file=sys.stderr, flush=True)
                return 0
            if code in (0, EXIT_USER_ERROR, EXIT_STOPPED) or attempt == cfg.max_restarts:
                return code
            print(f"A worker failed (exit code {code}): restarting the {flavor.num_devices} processes, resuming from "
                  f"the last checkpoint (restart {attempt + 1} of max_restarts={cfg.max_restarts})", flush=True)
            attempt += 1
    train = _train_function(module)
    with distributed(flavor) as world:
        try:
            train(cfg, flavor, world)
        except Stopped as e:
            if world.is_main:
                print(e, flush=True)
            return EXIT_STOPPED
    return 0
