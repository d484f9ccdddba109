"""Reward functions shipped for recipes.grpo, with TRL's signature (any TRL reward function works the same way):
`fn(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`, one value per completion.

    python -m recipes.grpo rewards=[moai_recipes.rewards.exact_answer,moai_recipes.rewards.number_only]

A completion is a string, or (conversational prompts) [{"role": "assistant", "content": text}].
"""

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1 where the completion's last number is the row's `answer` column (GSM8K's convention: "7 + 5 = 12" answers
    12), else 0: an arithmetic check you can read by eye."""
    out = []
    for completion, expected in zip(completions, answer):
        found = _NUMBER.findall(_text(completion))
        out.append(1.0 if found and _same_number(found[-1], str(expected)) else 0.0)
    return out


def contains_answer(completions, answer, **kwargs) -> list[float]:
    """1 where the completion holds the row's `answer` column, case and spacing aside ("It is red." holds "red"; an
    invoice's "Total: 1,234.50" holds "1,234.50"), else 0: a check for questions about documents and pictures."""
    def folded(text) -> str:
        return " ".join(str(text).lower().split())

    return [1.0 if folded(expected) and folded(expected) in folded(_text(c)) else 0.0
            for c, expected in zip(completions, answer)]


def number_only(completions, **kwargs) -> list[float]:
    """A format reward: 1 where the completion is one number and nothing else (a final period and spaces allowed),
    else 0."""
    return [1.0 if _NUMBER.fullmatch(_text(c).strip().rstrip(".").strip()) else 0.0 for c in completions]


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b.replace(",", "").strip())
    except ValueError:
        return a == b.strip()
