"""Global batches: the same samples in every step whatever the flavor.

A step's global batch is a pure function of (seed, epoch, position), never of the number of
ranks: the sample order is one seeded permutation per epoch. How it splits into ranks and
micro-batches is the Plan's (planner/plan.py).
"""

import math

import torch

from moai_recipes.errors import UserError


class GlobalBatches:
    def __init__(self, *, num_samples: int, batch_size: int, epochs: int, seed: int, dataset=None):
        assert num_samples > 0 and batch_size > 0
        self.dataset = dataset  # where samples() takes the samples from
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

    def samples(self, step: int) -> list[dict]:
        """The samples of `step`'s global batch, from the dataset."""
        return [self.dataset[i] for i in self.global_indices(step)]

    def position(self, step: int) -> dict:
        """What a checkpoint after `step` steps records of the data's position."""
        return {"samples_seen": self.samples_before(step)}

    def resume(self, step: int, meta: dict) -> None:
        # The order is a pure function of the step: nothing to seek. Of the same data and global batch, the checkpoint's
        # position (samples_seen) is this order's; of others, resumed only with resume_force=true (inputs.py checks),
        # the run goes on at the step after the checkpoint's, with that step's samples in this order.
        if "stream" in meta:
            raise UserError("the checkpoint was written by a run that streamed its data; resume it with "
                            "dataset.streaming=true, or start a new run (resume=never)")


class RepeatedBatches:
    """Each global batch of `base` for `times` consecutive steps (recipes.grpo's num_iterations: a generation's
    completions trained on that many times)."""

    def __init__(self, base: GlobalBatches, times: int):
        if times < 1:
            raise UserError(f"num_iterations={times} must be at least 1")
        self.base, self.times = base, times
        self.dataset, self.batch_size, self.steps_per_epoch = base.dataset, base.batch_size, base.steps_per_epoch * times

    @property
    def total_steps(self) -> int:
        return self.base.total_steps * self.times

    def samples(self, step: int) -> list[dict]:
        return self.base.samples(step // self.times)

    def position(self, step: int) -> dict:
        return {**self.base.position(-(-step // self.times)), "round_step": step % self.times}

    def resume(self, step: int, meta: dict) -> None:
        self.base.resume(step // self.times, meta)
