"""The shipped configs as `moai ls`, `moai cp` and `moai validate` show them: list, copy to edit, check without training.

A copy lives anywhere: `--config-path DIR --config-name NAME` composes it, and the groups it does not
carry itself (model/, dataset/, ...) come from the shipped configs. Test: `python -m pytest tests/test_cli.py -q`.
"""

import difflib
import shutil
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Iterator

import yaml
from omegaconf import OmegaConf

from moai_recipes.config.compose import CONFIG_DIR, GROUPS, group_options, load_config
from moai_recipes.config.schema import SCHEMAS
from moai_recipes.config.shipped_flavors import catalog
from moai_recipes.errors import UserError
from moai_recipes.files import write_text


def recipes() -> list[str]:
    """Each recipe has one config of its name: configs/full_finetune.yaml is `python -m recipes.full_finetune`'s."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def ls_lines() -> list[str]:
    """What `moai ls` prints: the recipes and their configs, then the options of each group."""
    names = recipes()
    w = max(len("RECIPE"), *map(len, names)) + 2
    lines = [f"{'RECIPE':<{w}}{'CONFIG':<{w}}RUN"]
    lines += [f"{r:<{w}}{r:<{w}}moai run {r:<{w}}(from the checkout: python -m recipes.{r})" for r in names]
    lines += ["", "GROUP      OPTIONS (GROUP=OPTION on a command line; `moai cp GROUP/OPTION DEST` copies one)"]
    options = {**group_options(), "flavor": [o.option for o in catalog()]}  # by size, as `moai flavors` lists them
    lines += [f"{g:<11}{' '.join(o)}" for g, o in options.items()]
    return lines


def find_config(name: str) -> Path:
    """A shipped config: a recipe's (`full_finetune`) or a group option (`model/mistral`); `.yaml` may be given."""
    path = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if path.is_file() and path.resolve().parent in (CONFIG_DIR, *(CONFIG_DIR / g for g in GROUPS)):
        return path
    known = recipes() + [f"{g}/{o}" for g, options in group_options().items() for o in options]
    near = difflib.get_close_matches(name, known, n=1)
    raise UserError(f"no config '{name}'{f' (did you mean {near[0]}?)' if near else ''}: give a recipe's config "
                    f"({', '.join(recipes())}) or a group option such as model/mistral; `moai ls` lists them")


def copy_config(name: str, dest: str) -> tuple[Path, Path]:
    """Copy a shipped config to `dest` (a file, or a folder to keep its name in); never overwrites. A recipe's
    config is written whole: its groups' options, then every other key with its default and help (the schema's)."""
    src = find_config(name)
    group = None if src.parent == CONFIG_DIR else src.parent.name
    target = Path(dest).expanduser()
    if target.is_dir() or dest.endswith(("/", "\\")):
        target = target / (group or "") / src.name  # a group option goes where Hydra looks for it: DIR/model/
    elif target.suffix == "":
        target = target.with_name(target.name + ".yaml")
    elif target.suffix != ".yaml":
        raise UserError(f"{dest}: Hydra reads only .yaml files; name the copy {target.stem}.yaml")
    if target.exists():
        raise UserError(f"{target} exists; give another name, or remove it first")
    target.parent.mkdir(parents=True, exist_ok=True)
    if group:
        shutil.copyfile(src, target)
    else:
        write_text(target, "\n".join(recipe_copy(src.stem)) + "\n")
    return src, target


def recipe_copy(recipe: str) -> list[str]:
    """The lines of an editable copy of a recipe's config: the shipped defaults list (which option of each
    group), then each key of the schema that is no group's, with its default and its help as a comment."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{recipe}.yaml").defaults)
    lines = [f"# A copy of moai-recipes' {recipe} config: every key with its default, to edit. A group's keys",
             f"# (model.*, optimizer.lr, ...) come with its option; moai run {recipe} --cfg job shows all.",
             "defaults:"]
    lines += [f"  - {next(iter(d))}: {next(iter(d.values()))}" if isinstance(d, dict) else f"  - {d}" for d in defaults]
    return lines + [""] + _schema_lines(SCHEMAS[recipe](), indent="", skip=GROUPS)


def _schema_lines(node, *, indent: str, skip=()) -> list[str]:
    lines = []
    for f in fields(node):
        value = getattr(node, f.name)
        if f.name in skip:
            continue
        if is_dataclass(value):
            lines += [f"{indent}{f.name}:", *_schema_lines(value, indent=indent + "  ")]
            continue
        shown = yaml.safe_dump(value.value if isinstance(value, Enum) else value, default_flow_style=True)
        lines.append(f"{indent}{f.name}: {shown.splitlines()[0]}  # {f.metadata['help']}")
    return lines


def how_to_use(src: Path, target: Path) -> list[str]:
    """The commands that run a copy, printed by `moai cp`."""
    if src.parent == CONFIG_DIR:
        return ["Edit it, check it, and run it (from any folder):", f"  moai validate {target}",
                f"  moai run {src.stem} --config-path {target.parent.resolve()} --config-name {target.stem}"]
    group, folder = src.parent.name, target.parent.parent.resolve()
    if target.parent.name != group:
        return [f"Hydra finds a {group} option only in a folder named {group}/: move it to DIR/{group}/{target.name}, "
                f"copy a recipe's config beside (moai cp full_finetune DIR/), then run:",
                f"  moai run full_finetune --config-path DIR {group}={target.stem}"]
    return [f"Edit it; the recipe configs of {folder} pick it with {group}={target.stem}:",
            f"  moai cp full_finetune {folder}/      (once: the recipe's config must be in that folder too)",
            f"  moai run full_finetune --config-path {folder} {group}={target.stem}"]


def recipe_of(path: Path) -> str:
    """The recipe a config file is for: its defaults list names the recipe's schema (`full_finetune_schema`)."""
    try:
        defaults = OmegaConf.load(path).get("defaults") or []
    except Exception as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    for d in defaults:
        if isinstance(d, str) and d.removesuffix("_schema") in recipes():
            return d.removesuffix("_schema")
    raise UserError(f"{path} is no recipe's config: its defaults list names no schema "
                    f"({', '.join(r + '_schema' for r in recipes())}); start from a copy of one: moai cp full_finetune NEW.yaml")


def validate(config: str, overrides: list[str]) -> Iterator[str]:
    """Compose `config` (a recipe's name or a config file) with `overrides` and check what a run reads before
    its first step: the flavor, the checkpoint folder, the tokenizer, the data, the output folder (generate: the
    sampling settings, the adapter and its base). Yields a line per check passed, then OK; the first failure is a
    UserError."""
    path = Path(config).expanduser()
    if config in recipes():
        recipe, argv, source = config, list(overrides), CONFIG_DIR / f"{config}.yaml"
    elif path.is_file():
        recipe, source = recipe_of(path), path
        argv = ["--config-path", str(path.parent), "--config-name", path.stem, *overrides]
    else:
        raise UserError(f"'{config}' is neither a recipe's config ({', '.join(recipes())}) nor a file; a group option "
                        f"is checked within a recipe's: moai validate full_finetune model=mistral")
    cfg = load_config(recipe, argv)
    yield f"Config {source} composes for recipes.{recipe}; values valid"
    yield from _check_inputs(recipe, cfg)
    yield "OK: nothing wrong found." + ("" if recipe in ("generate", "export", "eval", "dpo") else
                                        " Whether it fits in memory, and how it would run: moai run plan "
                                        "with the same overrides (method=lora for LoRA)")


def _check_inputs(recipe: str, cfg) -> Iterator[str]:
    """What `recipe` reads before it starts, read as the recipe reads it (inputs.py) without downloading or
    writing anything; a line per thing read."""
    # Imported only now: torch and torchtune take seconds, which a mistake in the config need not wait for.
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.inputs import model_and_adapter, read_generate_inputs, read_inputs

    if recipe == "generate":  # what recipes.generate checks before it reads a weight (the prompt comes when it runs)
        yield from read_generate_inputs(cfg, dry=True).describe(cfg)
        return
    if recipe in ("export", "eval"):
        hf, adapter = model_and_adapter(cfg, dry=True)
        yield f"Model from {hf.folder}: {hf.spec.family}" if hf else f"Model {cfg.model.name}: on the Hub, not checked"
        if adapter:
            yield f"Adapter {adapter.folder}: r={adapter.rank} on {len(adapter.weights)} weights, merged into the file"
        return
    flavor = resolve_flavor(**cfg.flavor)
    yield f"Flavor {flavor.describe()}"
    yield from read_inputs(cfg, flavor, dry=True, output=recipe != "plan").describe(cfg)
    if recipe == "grpo":  # the reward functions import as the run will import them
        from moai_recipes.train.rewards import Rewards

        rewards = Rewards.named(list(cfg.rewards), list(cfg.reward_weights) if cfg.reward_weights is not None else None)
        yield f"Rewards: {', '.join(rewards.names)}"
