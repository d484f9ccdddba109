"""Sampling from a torchtune decoder: torchtune's `generate` with temperature, top-k, top-p and a seed.

Test: `python -m pytest tests/test_generate.py -q`. temperature=0 is greedy decoding.
"""

import math
from dataclasses import dataclass

import torch

from moai_recipes.errors import UserError


@dataclass(frozen=True)
class Sampling:
    temperature: float  # 0: greedy
    top_k: int | None
    top_p: float
    max_new_tokens: int
    seed: int


def sampling_options(*, temperature: float, top_k: int | None, top_p: float, max_new_tokens: int,
                     seed: int) -> Sampling:
    """Check the user's sampling settings."""
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"temperature={temperature} must be a number >= 0 (0: greedy decoding)")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k={top_k} must be at least 1 (or null: no top-k filtering)")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p} must be in (0, 1] (1: no nucleus filtering)")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1")
    return Sampling(float(temperature), top_k, float(top_p), max_new_tokens, seed)


def _nucleus(temperature: float, top_k: int | None, top_p: float):
    """A forward hook that drops the next-token candidates outside the top-p nucleus (after top-k, as
    transformers orders them); torchtune's `sample` then applies temperature and top-k and draws."""

    def hook(module, args, logits):
        last = logits[:, -1] / temperature
        if top_k is not None:
            kth = torch.topk(last, min(top_k, last.size(-1))).values[:, -1:]
            last = last.masked_fill(last < kth, -math.inf)
        probs, order = torch.softmax(last, dim=-1).sort(dim=-1, descending=True)
        outside = (probs.cumsum(-1) - probs) >= top_p  # the mass before a token already reaches top_p
        logits[:, -1] = logits[:, -1].masked_fill(outside.scatter(-1, order, outside), -math.inf)
        return logits

    return hook


@torch.no_grad()
def complete(model: torch.nn.Module, prompt: list[int], *, sampling: Sampling, stop_ids: list[int],
             device: torch.device) -> list[int]:
    """The tokens the model adds to `prompt`, up to the first stop token (excluded) or max_new_tokens."""
    from torchtune.generation import generate

    greedy = sampling.temperature == 0
    # torchtune's generate has no top-p, and its first token bypasses a custom next-token function: a hook
    # on the logits covers every step.
    hook = None
    if not greedy and sampling.top_p < 1:
        hook = model.register_forward_hook(_nucleus(sampling.temperature, sampling.top_k, sampling.top_p))
    try:
        tokens, _ = generate(
            model, torch.tensor(prompt, device=device), max_generated_tokens=sampling.max_new_tokens,
            pad_id=-1,  # one prompt has no padding; -1 is no token, so none of the prompt is taken for it
            temperature=1.0 if greedy else sampling.temperature, top_k=1 if greedy else sampling.top_k,
            stop_tokens=stop_ids, rng=torch.Generator(device=device).manual_seed(sampling.seed))
    finally:
        if hook is not None:
            hook.remove()
    new = tokens[0, len(prompt):].tolist()
    return next((new[:i] for i, t in enumerate(new) if t in stop_ids), new)
