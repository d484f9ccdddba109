"""Compose a recipe's config with Hydra from the command line, validate it, and answer `--cfg job`.

We use Hydra's compose API rather than `@hydra.main` so that a user's mistake becomes one clean
message and exit code 2 (see errors.py) and the working directory is left alone. A launcher of several
processes composes once and hands its workers the resolved config (`resolved_config`, launch/worker.py).
"""

import difflib
import functools
import re
import sys
from datetime import datetime
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moai_recipes.config.schema import SCHEMAS, RecipeConfig, store_schemas
from moai_recipes.config.user_settings import switched_flavor
from moai_recipes.errors import UserError
from moai_recipes.files import demo_pictures_dir

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# ${asset:facts.jsonl}: a file shipped in the package (moai_recipes/assets), for configs that name embedded data.
OmegaConf.register_new_resolver("asset", lambda name: str(ASSETS / name), replace=True)


# ${pictures:shapes.jsonl}: the image-text demo's pictures in the cache (files.demo_pictures_dir), drawn by the data
# layer when a run first reads them (data/pictures.made_if_demo).
OmegaConf.register_new_resolver("pictures", lambda name: str(demo_pictures_dir() / name), replace=True)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "dataset", "optimizer", "flavor", "logger")


USAGE = """usage: python -m recipes.{recipe} [--cfg job] [--config-path DIR] [--config-name NAME] [key=value ...]

Compose configs/{recipe}.yaml with the groups {groups}, then apply key=value overrides:
  GROUP=OPTION (model=mistral)            pick an option of a group
  KEY=VALUE (model.checkpoint_dir=DIR)    set any key; --cfg job lists them
  --cfg job                               print the composed config and exit
  --config-path DIR --config-name NAME    compose your own copy of a config (moai cp)
Options of each group:
{options}"""


def group_options(config_dir: Path = CONFIG_DIR) -> dict[str, list[str]]:
    """Each group's options: those of `config_dir` and, behind them on the search path, the shipped ones."""
    return {g: sorted({p.stem for d in (config_dir, CONFIG_DIR) for p in (d / g).glob("*.yaml")}) for g in GROUPS}


def recipe_groups(config_file: Path) -> list[str]:
    """The groups a config composes, in the order of its defaults (generate has only `model`)."""
    return [g for d in _defaults(config_file) if OmegaConf.is_dict(d) for g in d if g in GROUPS]


def _defaults(config_file: Path) -> list:
    try:
        return list(OmegaConf.load(config_file).get("defaults") or [])
    except Exception:  # a malformed or missing file: composing it says what is wrong
        return []


def _split_argv(argv: list[str], recipe: str) -> tuple[dict, list[str]]:
    flags = {"cfg": None, "config_path": str(CONFIG_DIR), "config_name": recipe}
    overrides, it = [], iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            groups = recipe_groups(Path(flags["config_path"]) / f"{flags['config_name']}.yaml")
            opts = "\n".join(f"  {g}: {', '.join(o)}" for g, o in group_options().items() if g in groups)
            print(USAGE.format(recipe=recipe, groups=", ".join(groups), options=opts))
            sys.exit(0)
        name, eq, value = arg.partition("=")
        if name in ("--cfg", "-c", "--config-path", "-cp", "--config-name", "-cn"):
            value = value if eq else next(it, None)
            if value is None:
                raise UserError(f"{name} needs a value")
            key = {"--cfg": "cfg", "-c": "cfg", "--config-path": "config_path", "-cp": "config_path"}.get(name, "config_name")
            flags[key] = value
        elif arg.startswith("-"):
            raise UserError(f"unknown option {arg}; see --help")
        else:
            overrides.append(arg)
    if flags["cfg"] not in (None, "job", "all"):
        raise UserError(f"--cfg {flags['cfg']}: valid values are job, all")
    return flags, overrides


def _explain(e: Exception, overrides: list[str], config_dir: Path, recipe: str) -> str:
    """Turn Hydra's and OmegaConf's exceptions into one sentence that says what to do."""
    msg = str(e).strip()
    cause = e.__cause__ or e.__context__
    if isinstance(e, MissingConfigException) or "Could not find" in msg:
        for group, options in group_options(config_dir).items():
            for o in overrides:
                key, _, value = o.partition("=")
                if key.lstrip("+~") == group and value not in options:
                    near = difflib.get_close_matches(value, options, n=1)
                    hint = f" (did you mean {group}={near[0]}?)" if near else ""
                    return f"unknown {group} '{value}'{hint}; valid: {', '.join(options)}"
        return msg.splitlines()[0]
    if cause is not None and isinstance(cause, OmegaConfBaseException):
        text = str(cause).splitlines()[0]
        key = getattr(cause, "full_key", None)
        if "not in struct" in text or "Key '" in text and "not in" in text:
            parent = key.rsplit(".", 1)[0] if key and "." in key else None
            return f"unknown key '{key}'{_did_you_mean(key, parent, recipe)}; see the keys with --cfg job"
        choices = re.search(r"Invalid value '(.*)', expected one of \[(.*)\]", text)
        if choices and key:  # a choice of the schema (an enum)
            return f"{key}={choices.group(1)}: valid values are {choices.group(2)}"
        return f"bad value for '{key}': {text}" if key else text
    return msg.splitlines()[0] if msg else type(e).__name__


def _did_you_mean(key: str | None, parent: str | None, recipe: str) -> str:
    if not key:
        return ""
    fields = _schema_keys(parent, recipe)
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], fields, n=1)
    return f" (did you mean {(parent + '.') if parent else ''}{near[0]}?)" if near else ""


@functools.cache
def _schema(recipe: str) -> DictConfig:
    """A recipe's schema as a config, read only: made once a process (20 ms each, and every command asks)."""
    schema = OmegaConf.structured(SCHEMAS.get(recipe, RecipeConfig))
    OmegaConf.set_readonly(schema, True)
    return schema


def _schema_keys(parent: str | None, recipe: str) -> list[str]:
    node = _schema(recipe)
    for part in (parent.split(".") if parent else []):
        node = node.get(part) if isinstance(node, DictConfig) else None
    return list(node.keys()) if isinstance(node, DictConfig) else []


def load_config(recipe: str, argv: list[str] | None = None) -> DictConfig:
    """Compose `configs/<recipe>.yaml` with the command line; print it and exit on `--cfg`."""
    argv = sys.argv[1:] if argv is None else argv
    flags, overrides = _split_argv(argv, recipe)
    config_dir = Path(flags["config_path"]).resolve()
    config_file = config_dir / f"{flags['config_name']}.yaml"
    if not config_file.exists():
        raise UserError(f"no config {config_file.name} in {config_dir}")
    if config_dir != CONFIG_DIR:  # a copy (`moai cp`) finds the groups it does not have itself among the shipped ones
        shipped = str(CONFIG_DIR).replace("'", "\\'")
        overrides.append(f"hydra.searchpath=['file://{shipped}']")
    overrides += _switched_flavor(overrides, config_file)
    overrides = _open_maps_take_new_keys(overrides, flags["config_name"])
    store_schemas({d for d in _defaults(config_file) if isinstance(d, str)})
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=flags["config_name"], overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UserError(_explain(e, overrides, config_dir, flags["config_name"])) from None
    # Training recipes; generate and export write no run folder, eval decides beside what it evaluates.
    if "output_dir" in cfg and cfg.output_dir is None and "tasks" not in cfg:
        cfg.output_dir = f"outputs/{recipe}/{datetime.now():%Y-%m-%d_%H-%M-%S}"
    validate(cfg)
    if flags["cfg"]:
        print(OmegaConf.to_yaml(cfg), end="")
        sys.exit(0)
    return cfg


def _open_maps_take_new_keys(overrides: list[str], recipe: str) -> list[str]:
    """`dataset.column_map.output=response` as the docs write it: a key new to an open map of the schema (a dict
    field, not a dataclass) is added, where Hydra would want `+` for a new key and refuse `+` for an existing one
    (`++` does both)."""
    schema = _schema(recipe)
    out = []
    for o in overrides:
        key, eq, _ = o.partition("=")
        parent = key.rpartition(".")[0]
        node = OmegaConf.select(schema, parent) if eq and parent and not key.startswith(("+", "~")) else None
        out.append(f"++{o}" if isinstance(node, DictConfig) and node._metadata.object_type is dict else o)
    return out


def resolved_config(recipe: str, values: dict) -> DictConfig:
    """A config composed and resolved before (a launcher's, for its workers: launch/worker.py), typed again by the
    recipe's schema so that it reads as load_config's did."""
    cfg = OmegaConf.merge(OmegaConf.structured(SCHEMAS[recipe]), values)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _switched_flavor(overrides: list[str], config_file: Path) -> list[str]:
    """The flavor chosen with `moai switch` for a config with a flavor group, unless the command line picks one."""
    switched = switched_flavor(overrides)
    if not switched:
        return []
    if "flavor" not in recipe_groups(config_file):  # `generate` has none
        return []
    valid = group_options(config_file.parent)["flavor"]
    if switched[0].partition("=")[2] not in valid:  # checked here: the user did not type it
        raise UserError(f"your default {switched[0]} (chosen with `moai switch`) is no flavor of this installation; "
                        f"choose another with `moai switch` (valid: {', '.join(valid)}) or pick one with flavor=NAME")
    return switched


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def _validate_dataset(d: DictConfig) -> None:
    _check(d.shuffle_buffer >= 1, f"dataset.shuffle_buffer={d.shuffle_buffer} must be at least 1 (1: the data's order)")
    v = d.val_split
    _check(v is None or d.val_path is None, f"dataset.val_split={v} and dataset.val_path={d.val_path} both name a "
                                            "validation set; keep one")
    if isinstance(v, bool) or isinstance(v, (int, float)) and not 0 < v < 1:
        raise UserError(f"dataset.val_split={v} must be a fraction between 0 and 1 (0.05 holds out 5% of the samples) "
                        "or the name of a split of dataset.source")
    if isinstance(v, str):
        _check(d.source is not None, f"dataset.val_split={v} names a split, and only dataset.source has splits; hold "
                                     "out a fraction (dataset.val_split=0.05) or give dataset.val_path=FILE")
    _check(not (d.streaming and isinstance(v, float)), f"dataset.val_split={v}: a fraction of a stream cannot be held "
           "out; with dataset.streaming=true take a split (dataset.val_split=validation) or dataset.val_path=FILE")


def validate(cfg: DictConfig) -> None:
    """Range checks the schema's types cannot express (its enums check the choices)."""
    if "tasks" in cfg:  # eval
        _check(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be at least 1 (sequences scored at once)")
        _check(cfg.max_length is None or cfg.max_length >= 2, f"max_length={cfg.max_length} must be at least 2")
        _check(cfg.limit is None or cfg.limit > 0, f"limit={cfg.limit} must be positive (a count, or a fraction < 1)")
        _validate_dataset(cfg.dataset)
        return
    if "max_seq_len" not in cfg:  # generate, export: their options are checked where they are used
        return
    _check(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be at least 1 (it is the global batch, in sequences)")
    _check(cfg.max_seq_len >= 2, f"max_seq_len={cfg.max_seq_len} must be at least 2")
    _check(cfg.epochs >= 1, f"epochs={cfg.epochs} must be at least 1")
    _check(cfg.max_steps is None or cfg.max_steps >= 1, f"max_steps={cfg.max_steps} must be at least 1 (or null)")
    _check(cfg.sample_max_new_tokens >= 0, "sample_max_new_tokens must be >= 0")
    _check(cfg.eval_every is None or cfg.eval_every >= 1, f"eval_every={cfg.eval_every} must be at least 1 (or null: "
                                                          "the validation loss at the end only)")
    _validate_dataset(cfg.dataset)
    _check(cfg.checkpoint_every is None or cfg.checkpoint_every >= 1,
           f"checkpoint_every={cfg.checkpoint_every} must be at least 1 (or null: no step checkpoints)")
    _check(cfg.checkpoint_keep >= 1, f"checkpoint_keep={cfg.checkpoint_keep} must be at least 1")
    _check(cfg.skip_nonfinite_steps >= 0, f"skip_nonfinite_steps={cfg.skip_nonfinite_steps} must be >= 0")
    _check(cfg.max_restarts >= 0, f"max_restarts={cfg.max_restarts} must be >= 0")
    o = cfg.optimizer
    _check(o.lr >= 0, f"optimizer.lr={o.lr} must be >= 0")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), f"optimizer.betas={list(o.betas)} must be two numbers in [0, 1)")
    _check(o.warmup_steps >= 0, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    _check(o.max_grad_norm is None or o.max_grad_norm > 0, "optimizer.max_grad_norm must be positive (or null: no clipping)")
    p = cfg.plan
    _check(p.micro_batch_size is None or p.micro_batch_size >= 1, f"plan.micro_batch_size={p.micro_batch_size} must be at least 1")
