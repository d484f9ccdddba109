"""A recipe's entry point: compose its config, resolve the flavor, start or join the processes, train.

Both training recipes run through `run_recipe`, so the launch logic lives once.
"""

import sys
from typing import Callable

from omegaconf import DictConfig

from moai_recipes.config import load_config
from moai_recipes.flavors import Flavor, resolve_flavor
from moai_recipes.hub import resolve_checkpoint_dir
from moai_recipes.launch import World, distributed, needs_launch, relaunch
from moai_recipes.outputs import check_output_dir


def model_source(cfg: DictConfig) -> dict:
    return dict(name=cfg.model.name, checkpoint_dir=cfg.model.checkpoint_dir, hf_repo=cfg.model.hf_repo)


def run_recipe(recipe: str, train: Callable[[DictConfig, Flavor, World], None], argv: list[str] | None = None) -> int:
    """Run `train(cfg, flavor, world)` on every process the flavor needs; return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(recipe, argv)
    flavor = resolve_flavor(**cfg.flavor)
    if needs_launch(flavor):
        # The user never types torchrun: start the flavor's processes, each running this same
        # command, with what must not differ between them (the output folder, the checkpoint) pinned.
        check_output_dir(cfg.output_dir)
        checkpoint_dir = resolve_checkpoint_dir(**model_source(cfg))
        return relaunch(flavor, f"recipes.{recipe}", [*argv, f"output_dir={cfg.output_dir}",
                                                      f"model.checkpoint_dir={checkpoint_dir}"])
    with distributed(flavor) as world:
        train(cfg, flavor, world)
    return 0
