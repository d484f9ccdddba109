"""GRPO's numbers as TRL 1.16's GRPOTrainer computes them: advantages from rewards, the clipped objective per token,
the k3 KL to the reference, and each loss type's normalisation (recipes.grpo; tests/test_grpo.py checks them against
TRL number for number).

Everything here works on the completion tokens of a step flattened into one dimension, with `rows` saying which
completion each token belongs to: padded and packed micro-batches give the same tokens, and a rank's share of a step
is a sum that, divided by the step's global count (`Normaliser`), is the same whatever the flavor. Where TRL
normalises per micro-batch (`grpo`'s and `dr_grpo`'s means are the same either way with equal micro-batches; `bnpo`'s
token mean is not), ours is the step's: equal to TRL's where TRL runs a step as one micro-batch.
"""

import math
from dataclasses import dataclass

import torch

from moai_recipes.errors import UserError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages divided by (std + 1e-4)


@dataclass(frozen=True)
class GRPOLoss:
    """TRL's names and defaults (GRPOConfig)."""

    loss_type: str = "dapo"
    beta: float = 0.0  # the KL term's weight (0: no reference model)
    epsilon: float = 0.2  # the ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None: epsilon (DAPO's "clip higher": larger)
    delta: float | None = None  # two-sided clipping: the ratio also capped at delta (None: not)
    max_completion_length: int = 512  # dr_grpo's divisor
    use_bias_correction_kl: bool = True  # the KL term weighted by the importance ratio, as TRL does by default

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise UserError(f"loss_type={self.loss_type} is not one of {', '.join(LOSS_TYPES)}")
        if self.beta < 0 or not math.isfinite(self.beta):
            raise UserError(f"beta={self.beta} must be a number >= 0 (0: no KL term, no reference model)")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise UserError(f"epsilon={self.epsilon} must be in [0, 1) and epsilon_high={self.epsilon_high} >= 0")
        if self.delta is not None and self.delta <= 1:
            raise UserError(f"delta={self.delta} must be above 1 (the ratio's cap; null: none)")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """TRL's nanstd: the unbiased standard deviation of the values that are not NaN (NaN with fewer than two)."""
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    var = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return var.sqrt()


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor  # [completions]: each completion's advantage (0 where no reward scored it)
    rewards: torch.Tensor  # [completions]: the weighted sum of its rewards (NaN where none scored it)
    zero_std: torch.Tensor  # [completions]: whether its group's (or the batch's) std is 0: it teaches nothing


def advantages(per_function: torch.Tensor, weights: torch.Tensor, *, group: int, scale: str) -> Advantages:
    """Advantages of a step's completions, `group` consecutive ones per prompt, from `per_function` [completions,
    functions] (NaN: the function returned None): TRL's sum_then_normalize, each group's mean subtracted, divided by
    the group's std (scale=group), the batch's (batch) or nothing (none), plus 1e-4."""
    if scale not in SCALES:
        raise UserError(f"scale_rewards={scale} is not one of {', '.join(SCALES)}")
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    values = rewards - mean
    if scale != "none":
        values = values / (std + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(values=torch.nan_to_num(values, nan=0.0), rewards=rewards, zero_std=zero_std)


@dataclass
class TokenTerms:
    """The objective of each completion token (flattened), and what is logged of it."""

    loss: torch.Tensor  # per token: -min(ratio A, clip(ratio) A) + beta kl
    kl: torch.Tensor | None  # per token: k3, times the ratio (use_bias_correction_kl); None without a reference
    low_clipped: torch.Tensor  # per token: ratio below 1 - epsilon where A < 0
    high_clipped: torch.Tensor  # per token: ratio above 1 + epsilon_high where A > 0


def token_terms(logps: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None, advantage: torch.Tensor,
                loss: GRPOLoss) -> TokenTerms:
    """TRL's per-token loss, written as TRL writes it (the gradient of min and clamp at a tie is theirs too).
    `old`: the log-probabilities the completions were sampled with (None: on-policy, this pass's, detached);
    `advantage`: each token's completion's."""
    old = logps.detach() if old is None else old
    coef_1 = torch.exp(logps - old)
    kl = None
    if loss.beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if loss.use_bias_correction_kl:
            kl = kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - loss.epsilon, 1 + loss.high)
    if loss.delta is not None:
        coef_1 = torch.clamp(coef_1, max=loss.delta)
    per_token = -torch.min(coef_1 * advantage, coef_2 * advantage)
    if kl is not None:
        per_token = per_token + loss.beta * kl
    return TokenTerms(loss=per_token, kl=kl, low_clipped=(coef_1 < 1 - loss.epsilon) & (advantage < 0),
                      high_clipped=(coef_1 > 1 + loss.high) & (advantage > 0))


def loss_sum(per_token: torch.Tensor, rows: torch.Tensor, row_tokens: torch.Tensor, loss: GRPOLoss) -> torch.Tensor:
    """This share's part of the step's loss before the global division (Normaliser): grpo, each completion's token
    mean summed; the others, the tokens' sum. `rows`: each token's completion (0..n-1), `row_tokens` [n]: its
    completion's loss tokens (0 where masked)."""
    if loss.loss_type == "grpo":
        return (per_token / row_tokens.clamp(min=1)[rows]).sum()
    return per_token.sum()


def normaliser(loss: GRPOLoss, *, completions: int, tokens: int) -> float:
    """What the step's summed loss is divided by: grpo, the step's completions (a mean of their means); bnpo and
    dapo, its loss tokens; dr_grpo, completions x max_completion_length (TRL's constant)."""
    if loss.loss_type == "grpo":
        return max(completions, 1)
    if loss.loss_type == "dr_grpo":
        return completions * loss.max_completion_length
    return max(tokens, 1)
