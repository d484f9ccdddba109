"""A step's global batch as this rank's micro-batches, and a micro-batch as the model takes it.

The plan splits the global batch (a list of samples, the same on every rank) into ranks' shares and
the shares into micro-batches; the training step and the validation loss both run what comes out.
"""

import torch

from moai_recipes.data.datasets import collate
from moai_recipes.data.images import collate_images
from moai_recipes.train.world import World
from moai_recipes.models.attention import Documents
from moai_recipes.planner.plan import Plan
from moai_recipes.models.loss import IGNORE_INDEX

# An empty micro-batch still runs forward and backward (FSDP's collectives must match on every rank): a row of two
# padding tokens, not one. Dynamo specialises a length of 1 (and 0), so a one-token row made every compiled layer
# compile again for it (plan.compile, packed rows on cpu-2, whose ranks form unequal numbers of rows: a cold 4-step
# LoRA run took 70 CPU-seconds, 52 without); two tokens run in the graph the real rows' lengths already made dynamic.
EMPTY_TOKENS = 2


def _splits(plan: Plan, samples: list[dict], data_size: int) -> list[list[list[dict]]]:
    """Every data rank's micro-batches of a global batch, as the plan splits it (deterministic: each rank computes
    all)."""
    lengths = [len(s["tokens"]) for s in samples]
    positions = list(range(len(samples)))
    shares = [plan.rank_share(positions, lengths, r) for r in range(data_size)]
    return [[[samples[share[p]] for p in group] for group in plan.micro_batches([lengths[p] for p in share])]
            for share in shares]


def rank_micro_batches(plan: Plan, samples: list[dict], world: World) -> list[list[dict] | None]:
    """This rank's micro-batches of a global batch, as the plan splits it; None for an empty one. Every rank
    runs as many micro-batches as the busiest: FSDP's collectives need the same number of forward and backward
    passes everywhere."""
    splits = _splits(plan, samples, plan.data_parallel)
    mine = splits[world.data_rank]
    return mine + [None] * (max(map(len, splits)) - len(mine))


def micro_batch_shapes(plan: Plan, samples: list[dict]) -> list[tuple[int, int, int]]:
    """(place in its rank's step, rows, tokens per row) of every micro-batch any rank forms from a global batch:
    what peak memory is predicted at (padded rows: the longest sample's length; a packed row: its samples' sum)."""
    return [(i, 1, sum(len(s["tokens"]) for s in micro)) if plan.packing else
            (i, len(micro), max(len(s["tokens"]) for s in micro))
            for split in _splits(plan, samples, plan.data_parallel) for i, micro in enumerate(split)]


def model_inputs(micro: list[dict] | None, plan: Plan, pad_id: int) -> dict:
    """A micro-batch as the model takes it: padded rows, or one packed row with its documents and positions. An
    empty one (None) is two padding tokens whose labels are ignored: it adds nothing to the loss or the gradients.
    `samples` says which of its `sample_count` samples each token belongs to (-1: padding): a Mixture-of-Experts
    model's balancing loss is a sample's (models/moe.py)."""
    real = [len(s["tokens"]) for s in micro or []]
    micro = micro or [{"tokens": [pad_id] * EMPTY_TOKENS, "labels": [IGNORE_INDEX] * EMPTY_TOKENS}]
    # Tensor parallelism cuts a row's tokens into equal shares (sequence parallelism), and the CPU's bf16 matmuls
    # reuse their kernels only for a row count they have seen (Plan.row_sizes): padding at the end gives the row
    # its planned length, and changes nothing before it (causal attention, ignored labels).
    micro = _padded_row(micro, plan, pad_id)
    if not plan.packing:
        batch = collate(micro, pad_id=pad_id)
        samples = torch.full_like(batch["tokens"], -1)
        for row, n in enumerate(real):
            samples[row, :n] = row
    else:
        docs = Documents(tuple(len(s["tokens"]) for s in micro))
        batch = {"tokens": torch.tensor([[t for s in micro for t in s["tokens"]]]),
                 "labels": torch.tensor([[t for s in micro for t in s["labels"]]]), "documents": docs}
        if any("images" in s for s in micro):  # an image-text model's samples, end to end (data/images.py)
            batch["images"] = collate_images(micro, None)
        samples = torch.full_like(batch["tokens"], -1)
        samples[0, :sum(real)] = torch.repeat_interleave(torch.arange(len(real)), torch.tensor(real, dtype=torch.long))
    return {**batch, "samples": samples, "sample_count": len(real)}


def _padded_row(micro: list[dict], plan: Plan, pad_id: int) -> list[dict]:
    """Rows of Plan.padded_row tokens: padded rows padded further (their longest sample grows), a packed row given
    one more document, of padding."""
    row = sum(len(s["tokens"]) for s in micro) if plan.packing else max(len(s["tokens"]) for s in micro)
    missing = plan.padded_row(row) - row
    if not missing:
        return micro
    padding = {"tokens": [pad_id] * missing, "labels": [IGNORE_INDEX] * missing}
    if plan.packing:
        return [*micro, padding]
    longest = max(range(len(micro)), key=lambda i: len(micro[i]["tokens"]))
    grown = {**micro[longest], "tokens": list(micro[longest]["tokens"]) + padding["tokens"],
             "labels": list(micro[longest]["labels"]) + padding["labels"]}
    return [grown if i == longest else s for i, s in enumerate(micro)]
