"""Global batches read as training goes (dataset.streaming=true), for data larger than memory or disk.

Rows are read in the data's order a block of `shuffle_buffer` rows at a time; each block is tokenised
and its samples shuffled by a seed of (seed, pass, block), and global batches are taken from the
blocks in turn, crossing into the next block and, at the end of the data, into the next pass. Every
rank reads the same stream and forms the same global batch, so the batches are the same whatever the
flavor; the plan then gives each rank its share as for a dataset held whole. A run holds one block,
never the data. Its position (pass, the row its block starts at, the samples taken from the block) goes
into every checkpoint, and a resumed run reads from that row: it continues at the exact sample.
Tested by `python -m pytest tests/test_hf_datasets.py`.
"""

import itertools

import numpy as np
import torch

from moai_recipes.data.datasets import DataSource, sample_from_row
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError


class StreamedBatches:
    def __init__(self, source: DataSource, tokenizer: Tokenizer, *, max_seq_len: int, batch_size: int, seed: int,
                 shuffle_buffer: int, steps: int):
        self.source, self.tokenizer, self.max_seq_len = source, tokenizer, max_seq_len
        self.batch_size, self.seed, self.shuffle_buffer = batch_size, seed, shuffle_buffer
        self.total_steps = steps
        self.steps_per_epoch = None  # unknown until the data has been read through
        self.dropped = 0  # rows read so far without a target token
        self._seek(0, {"pass": 0, "row": 0, "taken": 0})

    @property
    def first_lengths(self) -> tuple[int, ...]:
        """The token counts of the first block's samples: what the planner prices the run's steps with."""
        return tuple(len(tokens) for tokens, _ in self._block)

    def _rows(self, start: int):
        rows, _, _ = self.source.open(streaming=True)
        return itertools.islice(rows, start, None)

    def _seek(self, step: int, position: dict) -> None:
        self._pass, self._block_row = position["pass"], position["row"]
        self._iter = self._rows(self._block_row)
        self._pass_has_samples = self._block_row > 0  # a block before this one had samples
        self._read_block()
        self._taken, self._step = position["taken"], step

    def _read_block(self) -> None:
        """The next block of samples, shuffled; at the end of the data, the first block of the next pass."""
        while True:
            block, read = [], 0
            for where, row in itertools.islice(self._iter, self.shuffle_buffer):
                read += 1
                try:
                    sample = sample_from_row(row, self.source, self.tokenizer, self.max_seq_len)
                except UserError as e:
                    raise UserError(f"{where}: {e}") from None
                if sample is None:
                    self.dropped += 1
                else:
                    # int32 arrays: as lists of Python ints a block of 10,000 chats would take ~100 MB.
                    block.append((np.asarray(sample[0], dtype=np.int32), np.asarray(sample[1], dtype=np.int32)))
            if block:
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + self._pass) * 1_000_033 + self._block_row)
                self._block = [block[i] for i in torch.randperm(len(block), generator=g).tolist()]
                self._rows_in_block, self._taken, self._pass_has_samples = read, 0, True
                return
            if read:  # a block of rows without targets: go on to the next one
                self._block_row += read
                continue
            if not self._pass_has_samples:
                raise UserError(f"{self.source.describe()} holds no row with a token to train on within "
                                f"max_seq_len={self.max_seq_len}; check the data, or raise max_seq_len")
            # The end of the data: the next pass.
            self._pass, self._block_row, self._pass_has_samples = self._pass + 1, 0, False
            self._iter = self._rows(0)

    def samples(self, step: int) -> list[dict]:
        """The global batch of `step`; steps are read in order (a resumed run seeks first)."""
        assert step == self._step, (step, self._step)
        batch = []
        while len(batch) < self.batch_size:
            if self._taken == len(self._block):
                self._block_row += self._rows_in_block
                self._read_block()
            take = min(self.batch_size - len(batch), len(self._block) - self._taken)
            batch += [{"tokens": t.tolist(), "labels": l.tolist()} for t, l in self._block[self._taken:self._taken + take]]
            self._taken += take
        self._step += 1
        return batch

    def position(self, step: int) -> dict:
        """Where the stream stands after `step` steps, for the checkpoint of that step."""
        assert step == self._step, (step, self._step)
        return {"stream": {"pass": self._pass, "row": self._block_row, "taken": self._taken},
                "samples_seen": step * self.batch_size}

    def resume(self, step: int, meta: dict) -> None:
        """Continue after `step` steps from a checkpoint's position (position())."""
        if "stream" not in meta:
            raise UserError("the checkpoint was written by a run that did not stream its data; resume it with "
                            "dataset.streaming=false, or start a new run (resume=never)")
        self._seek(step, meta["stream"])
