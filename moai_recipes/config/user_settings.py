"""The user's own settings, kept between commands: the default flavor that `moai switch` sets.

They live in `settings.json` under `moai_home()`: `$MOAI_HOME` if set, else
`$XDG_CONFIG_HOME/moai-recipes` (`~/.config/moai-recipes`). Test: `python -m pytest tests/test_cli.py -q`.
"""

import json

from moai_recipes.env import moai_home
from moai_recipes.errors import UserError
from moai_recipes.files import write_json

SETTINGS = "settings.json"


def _read() -> dict:
    path = moai_home() / SETTINGS
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as e:
        raise UserError(f"cannot read {path} ({e}); remove it, or choose the flavor again with `moai switch NAME`") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; remove it, or choose the flavor again with `moai switch NAME`")
    return data


def saved_flavor() -> str | None:
    """The flavor option (`4xlarge`, `cpu-2`) chosen with `moai switch`; None if the user never switched."""
    return _read().get("flavor") or None


def save_flavor(option: str) -> None:
    """Persist `option`, a flavor of configs/flavor/ (the caller checks that it exists)."""
    try:
        settings = _read()
    except UserError:  # a damaged file: the user's choice now replaces it
        settings = {}
    path = moai_home() / SETTINGS
    try:
        write_json(path, {**settings, "flavor": option})
    except OSError as e:  # nothing was replaced: the earlier choice (if any) still holds
        raise UserError(f"cannot save the default flavor in {path} ({e.strerror or e}); set MOAI_HOME to a folder "
                        "you can write, or name the flavor on each command line (flavor=NAME)") from None


def switched_flavor(overrides: list[str]) -> list[str]:
    """`["flavor=<saved>"]` when the user switched and the command line picks no flavor itself, else `[]`."""
    if any(o.lstrip("+~").partition("=")[0] == "flavor" for o in overrides):
        return []
    option = saved_flavor()
    return [f"flavor={option}"] if option else []
