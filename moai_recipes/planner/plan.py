"""What is planned (a Workload) and how it runs (a Plan). The planner (search.py) chooses the Plan before
the first step; training follows it: the Plan alone splits a global batch into ranks and micro-batches."""

import math
from dataclasses import asdict, dataclass
from functools import cached_property

from moai_recipes.models.spec import ModelSpec


@dataclass(frozen=True)
class Workload:
    """A model (with its LoRA adapters, if any) trained on global batches of `batch_size` sequences of up to
    `seq_len` tokens, in the compute dtype the user asked for (auto: bf16 on GPUs, fp32 on the CPU)."""

    spec: ModelSpec
    batch_size: int
    seq_len: int
    lora: object = None  # models.lora.LoraOptions
    dtype: str = "auto"

    @cached_property
    def sizes(self):
        from moai_recipes.planner.memory import model_sizes

        return model_sizes(self.spec, self.lora)

    @cached_property
    def lora_key(self) -> tuple | None:
        """The adapters as a hashable key of the layer traces (activations.py caches them by it)."""
        if self.lora is None:
            return None
        items = sorted(self.lora.builder_kwargs().items())
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in items)


@dataclass(frozen=True)
class Plan:
    batch_size: int  # global, in sequences
    num_devices: int
    micro_batch_size: int  # sequences per device per forward/backward
    accumulation_steps: int  # micro-batches per device per optimizer step
    recompute: str  # none | selective | full
    reshard_after_forward: bool
    cpu_offload: bool
    chunked_loss: bool  # the output projection and the loss in chunks of tokens (train/loss.py)
    param_dtype: str  # compute dtype of parameters in forward/backward
    master_dtype: str  # dtype of the sharded parameters, gradients and optimizer state

    @staticmethod
    def device_share(batch_size: int, num_devices: int) -> int:
        """Sequences per device of a global batch of `batch_size` (the last ranks' shares padded to it)."""
        return math.ceil(batch_size / num_devices)

    @property
    def batch_per_device(self) -> int:
        return self.device_share(self.batch_size, self.num_devices)

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 wraps the model: where it shards over several devices, offloads to the CPU or casts to
        a lower compute dtype. One process computing in its master dtype keeps a plain module: there FSDP2's
        all-gathers and reduce-scatters are copies of every layer in and out, a fifth of a CPU step at 24M
        parameters (measured), for nothing."""
        return self.num_devices > 1 or self.cpu_offload or self.param_dtype != self.master_dtype

    def rank_share(self, indices: list[int], rank: int) -> list[int | None]:
        """Rank `rank`'s contiguous share of a step's global batch (dataset indices), padded with None to the
        same length on every rank: FSDP's collectives need the same number of micro-batches everywhere. The
        shares of all ranks, without the padding, are the global batch in order."""
        per_rank = math.ceil(len(indices) / self.num_devices)
        share = indices[rank * per_rank:(rank + 1) * per_rank]
        return share + [None] * (per_rank - len(share))

    def micro_batches(self, share: list) -> list[list]:
        """A rank's share as `accumulation_steps` micro-batches of up to `micro_batch_size` (fewer when the
        last global batch of an epoch is short)."""
        assert len(share) <= self.batch_per_device, (len(share), self.batch_per_device)
        m = self.micro_batch_size
        return [share[i * m:(i + 1) * m] for i in range(self.accumulation_steps) if share[i * m:(i + 1) * m]]

    def as_dict(self) -> dict:
        return {**asdict(self), "batch_per_device": self.batch_per_device, "sharded": self.sharded}

    def describe(self) -> str:
        return (f"batch {self.batch_size} over {self.num_devices} device(s): batch_per_device {self.batch_per_device}, "
                f"micro_batch_size {self.micro_batch_size}, num_micro_batches {self.accumulation_steps}, "
                f"recomputation {self.recompute}, {self._distribution()}, cpu_offload {str(self.cpu_offload).lower()}, "
                f"chunked loss {str(self.chunked_loss).lower()}, {self.param_dtype} compute, {self.master_dtype} master weights")

    def _distribution(self) -> str:
        if not self.sharded:
            return "distribute_param false (one device: a plain module, no FSDP2)"
        return f"distribute_param true (FSDP2, reshard_after_forward {str(self.reshard_after_forward).lower()})"
