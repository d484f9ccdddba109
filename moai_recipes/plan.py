"""The run plan: how a rank's share of the global batch is split and what is recomputed.

Until the planner lands this is the default plan (the whole per-rank batch at once, nothing
recomputed), with the user's forced fields honoured.
"""

import math
from dataclasses import asdict, dataclass

from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor


@dataclass(frozen=True)
class Plan:
    batch_size: int  # global, in sequences
    num_devices: int
    micro_batch_size: int  # sequences per device per forward/backward
    accumulation_steps: int  # micro-batches per device per optimizer step
    recompute: str  # none | selective | full
    reshard_after_forward: bool
    cpu_offload: bool
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
                f"{self.param_dtype} compute, {self.master_dtype} master weights")


def default_plan(*, flavor: Flavor, batch_size: int, dtype: str, micro_batch_size: int | None,
                 recompute: str | None) -> Plan:
    per_device = math.ceil(batch_size / flavor.num_devices)
    mbs = micro_batch_size or per_device
    if mbs > per_device:
        raise UserError(f"plan.micro_batch_size={mbs} is larger than the batch per device ({per_device} = "
                        f"batch_size {batch_size} over {flavor.num_devices} devices); use at most {per_device}")
    if dtype == "auto":
        dtype = "bf16" if flavor.device.kind == "gpu" else "fp32"
    return Plan(batch_size=batch_size, num_devices=flavor.num_devices, micro_batch_size=mbs,
                accumulation_steps=math.ceil(per_device / mbs), recompute=recompute or "none",
                reshard_after_forward=True, cpu_offload=False,
                param_dtype="bfloat16" if dtype == "bf16" else "float32", master_dtype="float32")
