"""The shipped configs as `moai ls`, `moai cp` and `moai validate` show them: list, copy to edit, check without training.

A copy lives anywhere: `--config-path DIR --config-name NAME` composes it, and the groups it does not
carry itself (model/, dataset/, ...) come from the shipped configs. Test: `python -m pytest tests/test_cli.py -q`.
"""

import difflib
import math
import shutil
from pathlib import Path
from typing import Iterator

from omegaconf import OmegaConf

from moai_recipes.config.compose import CONFIG_DIR, GROUPS, group_options, load_config
from moai_recipes.config.shipped_flavors import catalog
from moai_recipes.errors import UserError


def recipes() -> list[str]:
    """Each recipe has one config of its name: configs/full_finetune.yaml is `python -m recipes.full_finetune`'s."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def ls_lines() -> list[str]:
    """What `moai ls` prints: the recipes and their configs, then the options of each group."""
    names = recipes()
    w = max(len("RECIPE"), *map(len, names)) + 2
    lines = [f"{'RECIPE':<{w}}{'CONFIG':<{w}}RUN"]
    lines += [f"{r:<{w}}{r:<{w}}python -m recipes.{r}" for r in names]
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
    """Copy a shipped config to `dest` (a file, or a folder to keep its name in); never overwrites."""
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
    shutil.copyfile(src, target)
    return src, target


def _from_root(path: Path) -> str:
    """`path` as the recipes, run from the repository root, reach it."""
    path, root = path.resolve(), CONFIG_DIR.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def how_to_use(src: Path, target: Path) -> list[str]:
    """The commands that run a copy, printed by `moai cp`."""
    if src.parent == CONFIG_DIR:
        return ["Edit it, check it, and run it from the repository root:", f"  moai validate {target}",
                f"  python -m recipes.{src.stem} --config-path {_from_root(target.parent)} --config-name {target.stem}"]
    group, folder = src.parent.name, _from_root(target.parent.parent)
    if target.parent.name != group:
        return [f"Hydra finds a {group} option only in a folder named {group}/: move it to DIR/{group}/{target.name}, "
                f"copy a recipe's config beside (moai cp full_finetune DIR/), then run from the repository root:",
                f"  python -m recipes.full_finetune --config-path DIR {group}={target.stem}"]
    return [f"Edit it; the recipe configs of {folder} pick it with {group}={target.stem}:",
            f"  moai cp full_finetune {folder}/      (once: the recipe's config must be in that folder too)",
            f"  python -m recipes.full_finetune --config-path {folder} {group}={target.stem}"]


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
    yield "OK: nothing wrong found." + ("" if recipe == "generate" else
                                        " Whether it fits in memory, and how it would run: python -m recipes.plan "
                                        "with the same overrides (method=lora for LoRA)")


def _check_inputs(recipe: str, cfg) -> Iterator[str]:
    """What `recipe` reads before it starts, checked; a line per check passed."""
    # Imported only now: torch and torchtune take seconds, which a mistake in the config need not wait for.
    from moai_recipes.checkpoint.run_folder import check_output_dir
    from moai_recipes.data.datasets import load_dataset
    from moai_recipes.data.tokenizer import Tokenizer
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.inference.device_map import check_device_map
    from moai_recipes.inference.sampling import sampling_options
    from moai_recipes.models.hf_format import HFCheckpoint
    from moai_recipes.models.lora import lora_options
    from moai_recipes.models.peft_adapter import PeftAdapter
    from moai_recipes.models.sources import resolve_checkpoint_dir
    from moai_recipes.models.spec import spec_for

    flavor = resolve_flavor(**cfg.flavor) if "flavor" in cfg else None
    if flavor:
        yield f"Flavor {flavor.describe()}"
    adapter = None
    if recipe == "generate":  # what recipes.generate checks before it reads a weight (the prompt comes when it runs)
        s = sampling_options(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                             max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        check_device_map(cfg.device_map, cfg.max_memory_gb)
        how = "greedy" if s.temperature == 0 else (f"temperature {s.temperature:g}, top_p {s.top_p:g}"
                                                    + (f", top_k {s.top_k}" if s.top_k else ""))
        yield f"Sampling: {how}, up to {s.max_new_tokens} new tokens; device_map {cfg.device_map}"
        adapter = PeftAdapter.open(cfg.adapter_dir) if cfg.adapter_dir else None
    if "model" not in cfg:
        return
    m = cfg.model
    if adapter and not m.checkpoint_dir:  # generate's base: the one adapter_config.json names
        if adapter.base_on_hub:
            yield (f"Adapter {adapter.folder}: r={adapter.rank} on the base {adapter.base_model}, which the first run "
                   "downloads from the Hugging Face Hub (not checked here; model.checkpoint_dir=DIR checks a local copy)")
            return
        folder = adapter.base_model_dir()
    elif not m.checkpoint_dir and m.name != "tiny" and m.hf_repo:
        spec = spec_for(architecture=m.architecture, checkpoint_dir=None)
        yield (f"Model {m.name}: {spec.family}, {spec.num_params() / 1e9:.3g}B parameters; the first run downloads "
               f"{m.hf_repo} from the Hugging Face Hub (not checked here; model.checkpoint_dir=DIR checks a local copy)")
        return
    else:
        folder = resolve_checkpoint_dir(name=m.name, checkpoint_dir=m.checkpoint_dir, hf_repo=m.hf_repo)
    ckpt = HFCheckpoint.open(folder)  # config.json, the weights' files, names and dtypes
    # Training recipes build the family the model name says; generate, like transformers, whatever config.json says.
    spec = ckpt.spec if recipe == "generate" else spec_for(architecture=m.architecture, checkpoint_dir=ckpt.folder)
    tokenizer = Tokenizer.from_checkpoint(ckpt.folder)
    yield (f"Model {'' if recipe == 'generate' else m.name + ' '}from {ckpt.folder}: {spec.family}, "
           f"{spec.num_params() / 1e6:.1f}M parameters in {len(ckpt.files)} safetensors file(s), tokenizer of "
           f"{tokenizer.vocab_size} tokens")
    if adapter:
        adapter.check_base(ckpt)
        yield (f"Adapter {adapter.folder}: r={adapter.rank}, alpha={adapter.alpha:g} on {len(adapter.weights)} "
               "weights of this base")
    if "lora" in cfg and cfg.get("method", "lora") == "lora":
        lora_options(**cfg.lora, spec=spec, world_size=flavor.num_devices if flavor else 1)
        lora = cfg.lora
        targets = [*lora.attn_modules, *(["the MLP"] if lora.apply_to_mlp else []),
                   *(["the output"] if lora.apply_to_output else [])]
        yield f"LoRA: rank {lora.rank} on {', '.join(targets)}" + (", the base in NF4 (QLoRA)" if lora.quantize_base else "")
    if "dataset" in cfg:
        d = cfg.dataset
        data = load_dataset(kind=d.kind, path=d.path, tokenizer=tokenizer, max_seq_len=cfg.max_seq_len,
                            column_map=dict(d.column_map), train_on_input=d.train_on_input)
        per_epoch = math.ceil(len(data) / cfg.batch_size)
        steps = min(per_epoch * cfg.epochs, cfg.max_steps or math.inf)
        yield (f"Data {d.kind} ({d.path or 'embedded demo'}): {len(data)} samples"
               f"{f' ({data.dropped} dropped: no target token within max_seq_len)' if data.dropped else ''}, "
               f"{per_epoch} steps per epoch of global batch {cfg.batch_size}, {steps} steps")
    if "resume" in cfg:
        out, resume_from = check_output_dir(cfg)
        yield f"Output {out}: " + (f"resumes from {resume_from}" if resume_from else "a new run")
