"""Global batches: the same samples in every step whatever the flavor, split across ranks and micro-batches.

A step's global batch is a pure function of (seed, epoch, position), never of the number of
ranks: the sample order is one seeded permutation per epoch. Each rank takes a contiguous share of
the global batch, padded with empty slots (None) so that every rank runs the same number of
micro-batches, which FSDP's collectives require.
"""

import math

import torch


class GlobalBatches:
    def __init__(self, *, num_samples: int, batch_size: int, epochs: int, seed: int):
        assert num_samples > 0 and batch_size > 0
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed
        self.steps_per_epoch = math.ceil(num_samples / batch_size)
        self._order: tuple[int, list[int]] | None = None

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_samples, generator=g).tolist())
        return self._order[1]

    def samples_before(self, step: int) -> int:
        """The global data position after `step` steps: how many samples the run has consumed."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        return epoch * self.num_samples + min(pos * self.batch_size, self.num_samples)

    def global_indices(self, step: int) -> list[int]:
        """Dataset indices of the global batch of `step` (0-based, counting across epochs)."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        start = pos * self.batch_size
        return self._permutation(epoch)[start:start + self.batch_size]

    def rank_slots(self, step: int, *, rank: int, world_size: int) -> list[int | None]:
        """This rank's share of the global batch, padded with None to the same length on every rank."""
        indices = self.global_indices(step)
        per_rank = math.ceil(len(indices) / world_size)
        share = indices[rank * per_rank:(rank + 1) * per_rank]
        return share + [None] * (per_rank - len(share))


def split_micro_batches(slots: list, micro_batch_size: int) -> list[list]:
    return [slots[i:i + micro_batch_size] for i in range(0, len(slots), micro_batch_size)]
