"""Preference losses over pairs of completions: DPO (sigmoid, with conservative label smoothing), IPO, hinge, and
the reference-free SimPO and ORPO; and the rewards a run logs.

The inputs are each completion's summed log-probability under the policy (and, for the losses that have one,
under the reference) and its number of tokens. Each loss returns one value per pair; the recipe sums them over
its share and divides by the global number of pairs, so a step's loss and gradients are the same on any flavor.
Formulas as TRL 1.16's DPOTrainer (sigmoid, ipo, hinge), CPOTrainer (simpo) and ORPOTrainer (orpo) compute them.
Test: `python -m pytest tests/test_dpo.py -q`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # no reference model at all


@dataclass(frozen=True)
class PreferenceLoss:
    type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid: the share of pairs taken as mislabelled (conservative DPO)
    simpo_gamma: float = 0.5  # simpo: the target margin, gamma / beta in the logits as in CPOTrainer
    orpo_alpha: float = 1.0  # orpo: the weight of the chosen completion's NLL beside the odds-ratio term

    @property
    def uses_reference(self) -> bool:
        return self.type not in REFERENCE_FREE


@dataclass
class PairScores:
    """Per pair (tensors of one value a pair): summed log-probabilities and completion lengths."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None  # None for the reference-free losses
    ref_rejected: torch.Tensor | None = None


def pair_losses(s: PairScores, loss: PreferenceLoss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss of each pair, the rewards of each pair: chosen, rejected, accuracies, margins; detached)."""
    b = loss.beta
    if loss.type in ("sigmoid", "ipo", "hinge"):
        chosen_ratio, rejected_ratio = s.chosen - s.ref_chosen, s.rejected - s.ref_rejected
        delta = chosen_ratio - rejected_ratio
        if loss.type == "sigmoid":
            eps = loss.label_smoothing
            value = -F.logsigmoid(b * delta) * (1 - eps) - F.logsigmoid(-b * delta) * eps
        elif loss.type == "hinge":
            value = torch.relu(1 - b * delta)
        else:  # ipo: per-token averages, as TRL normalises it
            avg = chosen_ratio / s.chosen_tokens.clamp(min=1) - rejected_ratio / s.rejected_tokens.clamp(min=1)
            value = (avg - 1 / (2 * b)) ** 2
        chosen_reward, rejected_reward = b * chosen_ratio.detach(), b * rejected_ratio.detach()
    elif loss.type == "simpo":
        chosen_avg, rejected_avg = s.chosen / s.chosen_tokens.clamp(min=1), s.rejected / s.rejected_tokens.clamp(min=1)
        logits = chosen_avg - rejected_avg - loss.simpo_gamma / b
        eps = loss.label_smoothing
        value = -F.logsigmoid(b * logits) * (1 - eps) - F.logsigmoid(-b * logits) * eps
        chosen_reward, rejected_reward = b * chosen_avg.detach(), b * rejected_avg.detach()
    elif loss.type == "orpo":
        chosen_avg, rejected_avg = s.chosen / s.chosen_tokens.clamp(min=1), s.rejected / s.rejected_tokens.clamp(min=1)
        # log odds(y) = log p - log(1 - p), with p the mean per-token probability
        log_odds = (chosen_avg - rejected_avg) - (torch.log1p(-torch.exp(chosen_avg)) -
                                                 torch.log1p(-torch.exp(rejected_avg)))
        value = loss.orpo_alpha * -chosen_avg - b * F.logsigmoid(log_odds)
        chosen_reward, rejected_reward = b * chosen_avg.detach(), b * rejected_avg.detach()
    else:
        raise ValueError(loss.type)
    return value, {"chosen": chosen_reward, "rejected": rejected_reward,
                   "accuracies": (chosen_reward > rejected_reward).float(), "margins": chosen_reward - rejected_reward}
