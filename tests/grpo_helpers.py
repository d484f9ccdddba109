"""What tests/test_grpo.py gives both TRL's GRPOTrainer and recipes.grpo: the same completions of each prompt (in place
of sampling: MOAI_TEST_COMPLETIONS for ours, TRL's _generate_single_turn for theirs) and reward functions with TRL's
signature. Importable by a recipe's worker processes (their MOAI_TEST_COMPLETIONS names `fixed`)."""

import torch

GROUP = 4  # num_generations of the tests
LONGEST = 6  # max_completion_length of the tests
EOS = 1  # the test checkpoint's eos_token_id (tests/test_grpo.py checks it; 2 is its pad)


def fixed(prompt_ids: list[list[int]], seeds=None) -> list[list[int]]:
    """Each row's completion, a function of its prompt's tokens and its place in its group alone (row r is
    completion r % GROUP of its prompt in both TRL's batch and ours): lengths 1 to LONGEST, most ending in EOS, some
    cut at LONGEST (truncated)."""
    out = []
    for r, p in enumerate(prompt_ids):
        g = torch.Generator().manual_seed(1000 * sum(p) + r % GROUP)
        n = int(torch.randint(1, LONGEST + 1, (1,), generator=g))
        c = torch.randint(10, 380, (n,), generator=g).tolist()  # within the test vocabulary of 384
        if n < LONGEST or r % 2 == 0:
            c[-1] = EOS
        out.append(c)
    return out


def length_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    return [float(len(c)) for c in completion_ids]


def column_reward(prompts, completions, completion_ids, target, **kwargs) -> list[float | None]:
    """Reads a dataset column, as TRL passes them; None (not scored by this function) for about one in five, by the
    completion's tokens (not its place in the batch, which TRL orders otherwise)."""
    return [None if sum(c) % 5 == 4 else float(sum(c) % int(t)) for c, t in zip(completion_ids, target)]


def broken_reward(prompts, completions, **kwargs) -> list[float]:
    """Returns one value too few: recipes.grpo names it and the prompt."""
    return [0.0] * (len(completions) - 1)


def raising_reward(prompts, completions, **kwargs) -> list[float]:
    """Fails as a user's function may: recipes.grpo names it, the prompt and the error."""
    raise KeyError("answer")


def picture_reward(prompts, completions, completion_ids, images, answer, **kwargs) -> list[float]:
    """Reads the pictures' column as TRL passes it (a list of a prompt's images: paths here, PIL images in TRL's
    dataset) and the answers' column."""
    return [float(len(pictures)) + (sum(c) % 7) / 7 + len(a) % 3 for c, pictures, a in zip(completion_ids, images, answer)]


def trl_logs_on_fixed_completions(trainer) -> list[dict]:
    """Train TRL's GRPOTrainer `trainer` on `fixed` completions (in place of its sampling), its generation batch kept
    in its order (TRL shuffles it with the global RNG: the micro-batch is the whole batch in the tests, so only
    summation order would change); the log of each step that trained."""
    import trl.trainer.grpo_trainer as grpo_trainer

    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (fixed(prompt_ids), None)
    original, grpo_trainer.shuffle_sequence_dict = grpo_trainer.shuffle_sequence_dict, lambda d: d
    try:
        trainer.train()
    finally:
        grpo_trainer.shuffle_sequence_dict = original
    return [h for h in trainer.state.log_history if "loss" in h and "reward" in h or "entropy" in h]
