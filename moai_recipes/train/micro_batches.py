"""A step's global batch as this rank's micro-batches, and a micro-batch as the model takes it.

The plan splits the global batch (a list of samples, the same on every rank) into ranks' shares and
the shares into micro-batches; the training step and the validation loss both run what comes out.
"""

import torch

from moai_recipes.data.datasets import collate
from moai_recipes.launch.world import World
from moai_recipes.models.attention import Documents
from moai_recipes.planner.plan import Plan
from moai_recipes.train.loss import IGNORE_INDEX

# An empty micro-batch still runs forward and backward (FSDP's collectives must match on every rank).
_EMPTY = {"tokens": None, "labels": [IGNORE_INDEX]}


def rank_micro_batches(plan: Plan, samples: list[dict], world: World) -> list[list[dict] | None]:
    """This rank's micro-batches of a global batch, as the plan splits it; None for an empty one. Every rank
    computes every rank's split (it is deterministic) and runs as many micro-batches as the busiest: FSDP's
    collectives need the same number of forward and backward passes everywhere."""
    lengths = [len(s["tokens"]) for s in samples]
    positions = list(range(len(samples)))
    shares = [plan.rank_share(positions, lengths, r) for r in range(world.world_size)]
    splits = [plan.micro_batches([lengths[p] for p in share]) for share in shares]
    mine, split = shares[world.rank], splits[world.rank]
    micro = [[samples[mine[p]] for p in group] for group in split]
    return micro + [None] * (max(map(len, splits)) - len(split))


def model_inputs(micro: list[dict] | None, plan: Plan, pad_id: int) -> dict:
    """A micro-batch as the model takes it: padded rows, or one packed row with its documents and positions. An
    empty one (None) is one padding token whose label is ignored: it adds nothing to the loss or the gradients."""
    micro = micro or [_EMPTY | {"tokens": [pad_id]}]
    if not plan.packing:
        return collate(micro, pad_id=pad_id)
    docs = Documents(tuple(len(s["tokens"]) for s in micro))
    return {"tokens": torch.tensor([[t for s in micro for t in s["tokens"]]]),
            "labels": torch.tensor([[t for s in micro for t in s["labels"]]]), "documents": docs}
