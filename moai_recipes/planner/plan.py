"""The run plan: how a rank's share of the global batch is split, what is recomputed, how the
model is sharded or offloaded. The planner (moai_recipes/planner/) chooses one before the first step."""

import math
from dataclasses import asdict, dataclass

from moai_recipes.train.parallel import uses_fsdp


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

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 wraps the model: not for one device computing in the master dtype."""
        return uses_fsdp(self.num_devices, cpu_offload=self.cpu_offload, mixed_precision=self.param_dtype != self.master_dtype)

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
