"""The run plan: how a rank's share of the global batch is split, what is recomputed, how the
model is sharded or offloaded. The planner (moai_recipes/planner/) chooses one before the first step."""

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Plan:
    batch_size: int  # global, in sequences
    num_devices: int
    micro_batch_size: int  # sequences per device per forward/backward
    accumulation_steps: int  # micro-batches per device per optimizer step
    recompute: str  # none | selective | full
    reshard_after_forward: bool
    cpu_offload: bool
    chunked_loss: bool  # the output projection and the loss in chunks of tokens (loss.py)
    param_dtype: str  # compute dtype of parameters in forward/backward
    master_dtype: str  # dtype of the sharded parameters, gradients and optimizer state

    @property
    def batch_per_device(self) -> int:
        return math.ceil(self.batch_size / self.num_devices)

    def as_dict(self) -> dict:
        return {**asdict(self), "batch_per_device": self.batch_per_device}

    def describe(self) -> str:
        return (f"batch {self.batch_size} over {self.num_devices} device(s): batch_per_device {self.batch_per_device}, "
                f"micro_batch_size {self.micro_batch_size}, num_micro_batches {self.accumulation_steps}, "
                f"recomputation {self.recompute}, distribute_param true (FSDP2, reshard_after_forward "
                f"{str(self.reshard_after_forward).lower()}), cpu_offload {str(self.cpu_offload).lower()}, "
                f"chunked loss {str(self.chunked_loss).lower()}, {self.param_dtype} compute, {self.master_dtype} master weights")
