"""The flavors this installation ships (configs/flavor/*.yaml) in the MoAI order, and which one is the default.

`moai flavors` prints them, `moai switch` makes one the user's default, `moai smi` shows the default.
Test: `python -m pytest tests/test_cli.py -q`.
"""

import difflib
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from moai_recipes.config.compose import CONFIG_DIR
from moai_recipes.config.schema import FlavorConfig
from moai_recipes.config.user_settings import saved_flavor
from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor, resolve_flavor


@dataclass(frozen=True)
class FlavorOption:
    option: str  # what `flavor=` takes: 4xlarge, cpu-2
    flavor: Flavor  # resolved on this machine (the CPU flavors share its memory)
    config: dict  # its configs/flavor/<option>.yaml

    @property
    def name(self) -> str:
        return self.flavor.name  # 4xLarge.2048GB, cpu-2

    def on(self, device: str) -> Flavor:
        """The same flavor re-expressed on another device type (`flavor.device=h100`)."""
        return resolve_flavor(**{**self.config, "device": device})


def catalog(config_dir: Path = CONFIG_DIR) -> list[FlavorOption]:
    """Every shipped flavor: the MoAI ones by size (Small.64GB first, as moreh-switch-model lists them), then the CPU ones."""
    # Each file sets what makes its flavor; the schema gives the rest (device_memory_gb: the device's).
    configs = {p.stem: OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(FlavorConfig), OmegaConf.load(p)))
               for p in (config_dir / "flavor").glob("*.yaml")}
    options = [FlavorOption(option, resolve_flavor(**c), c) for option, c in configs.items()]
    return sorted(options, key=lambda o: (o.flavor.device.kind == "cpu", o.flavor.total_memory_gb, o.option))


def shipped_default(config_dir: Path = CONFIG_DIR) -> str:
    """The flavor the training configs pick when the user never switched."""
    defaults = OmegaConf.load(config_dir / "full_finetune.yaml").defaults
    return next(d.flavor for d in defaults if OmegaConf.is_dict(d) and "flavor" in d)


def current_option() -> str:
    """The flavor recipes use when the command line names none: the user's switch, else the shipped default."""
    return saved_flavor() or shipped_default()


def current_flavor(options: list[FlavorOption]) -> FlavorOption:
    option = current_option()
    try:
        return find(option, options)
    except UserError:
        raise UserError(f"your default flavor '{option}' (chosen with `moai switch`) is no flavor of this installation; "
                        "choose one with `moai switch`") from None


def find(text: str, options: list[FlavorOption]) -> FlavorOption:
    """The flavor named `text`, as an option (`4xlarge`) or a MoAI name (`4xLarge.2048GB`), in any case."""
    for o in options:
        if text.lower() in (o.option.lower(), o.name.lower()):
            return o
    names = [o.option for o in options]
    near = difflib.get_close_matches(text.lower(), names, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise UserError(f"unknown flavor '{text}'{hint}; valid: {', '.join(names)} (or the full name, such as "
                    f"{options[0].name}); `moai flavors` describes them")


def devices_text(flavor: Flavor) -> str:
    """`32 x MI250 (16 cards)`, `2 x CPU process`."""
    dev, n = flavor.device, flavor.num_devices
    if dev.kind == "cpu":
        return f"{n} x CPU process{'es' if n > 1 else ''}"
    cards = n / dev.per_card  # an MI250 card is two devices: Small.64GB is half a card
    return f"{n} x {dev.name.upper()}" + (f" ({cards:g} card{'' if cards == 1 else 's'})" if dev.per_card > 1 else "")


def flavors_table(options: list[FlavorOption], current: str) -> list[str]:
    """The lines of `moai flavors`: one row per flavor, `*` on the current default."""
    rows = [("", "Flavor", "Devices", "Memory per device", "Total memory", "Pick it with")]
    rows += [("*" if o.option == current else "", o.name, devices_text(o.flavor), f"{o.flavor.device_memory_gb:.4g} GB",
              f"{o.flavor.total_memory_gb:.5g} GB", f"flavor={o.option}") for o in options]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return lines + ["", "* the default of every recipe: `moai switch` changes it, flavor=NAME on a command line overrides it.",
                    "  The CPU flavors run processes on this machine and share its memory."]


def numbered_list(options: list[FlavorOption], current: str) -> list[str]:
    """moreh-switch-model's list: `8. 4xLarge.2048GB  *`."""
    return [f"{i}. {o.name}" + ("  *" if o.option == current else "") for i, o in enumerate(options, 1)]
