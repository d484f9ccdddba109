"""Reward functions of recipes.grpo: Python functions named by dotted path (`rewards=[mypkg.rewards.exact, ...]`),
called as TRL 1.16's GRPOTrainer calls them, so that a TRL user's functions work unchanged:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], <each other dataset column>=[...],
       trainer_state=..., log_extra=..., log_metric=...) -> list[float | None]

one value per completion (None: this function does not score it). `prompts` are the dataset's prompt values as given
(strings or conversations), repeated for each of a prompt's completions; `completions` the decoded texts (or, for
conversational prompts, [{"role": "assistant", "content": text}]). A function that raises, or returns the wrong
number of values, is named with the first prompt of the batch it failed on (a UserError, exit code 2).
"""

import importlib
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from moai_recipes.errors import UserError


@dataclass(frozen=True)
class Rewards:
    functions: tuple[Callable, ...]
    names: tuple[str, ...]  # the logged names: rewards/<name>/mean, as TRL's (the function's __name__)
    weights: torch.Tensor  # [functions], float32

    @classmethod
    def named(cls, paths: list[str], weights: list[float] | None) -> "Rewards":
        if not paths:
            raise UserError("recipes.grpo needs at least one reward function: rewards=[package.module.function, ...] "
                            "(e.g. rewards=[moai_recipes.rewards.exact_answer])")
        functions = tuple(_resolve(p) for p in paths)
        if weights is not None and len(weights) != len(functions):
            raise UserError(f"reward_weights has {len(weights)} value(s) for {len(functions)} reward function(s): "
                            "give one weight per function, or none (all 1)")
        w = torch.tensor(list(weights) if weights is not None else [1.0] * len(functions), dtype=torch.float32)
        return cls(functions, tuple(getattr(f, "__name__", str(f)) for f in functions), w)

    def score(self, *, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              step: int) -> torch.Tensor:
        """[completions, functions] float32, NaN where a function returned None."""
        out = torch.full((len(completions), len(self.functions)), torch.nan, dtype=torch.float32)
        state = SimpleNamespace(global_step=step)  # what of TRL's TrainerState a reward may read
        for j, (fn, name) in enumerate(zip(self.functions, self.names)):
            where = f"reward function {name} on the batch starting with prompt {_short(prompts[0])}"
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                            trainer_state=state, log_extra=_ignore, log_metric=_ignore)
            except Exception as e:  # a user's function: its failure is theirs to fix, said with where it happened
                raise UserError(f"{where} raised {type(e).__name__}: {e}") from None
            values = list(values) if values is not None else None
            if values is None or len(values) != len(completions):
                raise UserError(f"{where} returned {'None' if values is None else f'{len(values)} values'} for "
                                f"{len(completions)} completions: return one number (or None) per completion")
            for i, v in enumerate(values):
                if v is None:
                    continue
                try:
                    out[i, j] = float(v)
                except (TypeError, ValueError):
                    raise UserError(f"{where} returned {v!r} for completion {i}: a number or None") from None
                if math.isinf(out[i, j]):
                    raise UserError(f"{where} returned {v} for completion {i}: rewards must be finite")
        return out


def _ignore(*args, **kwargs) -> None:
    """TRL's log_extra / log_metric: accepted, not logged here."""


def _short(prompt) -> str:
    text = prompt if isinstance(prompt, str) else " / ".join(str(m.get("content", "")) for m in prompt)
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


def _resolve(path: str) -> Callable:
    module, _, name = str(path).rpartition(".")
    if not module:
        raise UserError(f"rewards: {path!r} is not a dotted path to a function (package.module.function)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        raise UserError(f"rewards: cannot import {module!r} for {path!r} ({e}); the module must be importable from "
                        "the current directory or the installed packages") from None
    except AttributeError:
        raise UserError(f"rewards: {module!r} has no function {name!r}") from None
    if not callable(fn):
        raise UserError(f"rewards: {path!r} is not a function")
    return fn
