"""Step time of a plan: traced-size FLOPs against the device, FSDP collectives against the links.

compute = FLOPs (forward, backward, recompute) / (peak x efficiency), where efficiency grows with
the tokens in a micro-batch (small matmuls do not fill a GPU); collectives per micro-batch are the
all-gather of the parameters (again in backward when resharded) and the reduce-scatter of the
gradients, mostly overlapped with compute by FSDP's prefetching; offload adds host transfers.
"""

import math
from dataclasses import dataclass

from moai_recipes.flavors import Device
from moai_recipes.models import ModelSpec
from moai_recipes.planner.memory import DTYPE_BYTES, ModelSizes

# Fraction of peak FLOP/s reached by large micro-batches, and the micro-batch size (tokens) at which
# half of that is reached. GPU figures are typical of FSDP training; the CPU's are calibrated here
# (bench/planner_accuracy.py).
EFFICIENCY = {"gpu": (0.55, 1024), "cpu": (1.0, 64)}
OVERLAP = 0.8  # share of collective time FSDP hides behind compute
LATENCY_S = {"gpu": 30e-6, "cpu": 150e-6}  # per collective
PCIE_GBPS = 25


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "total_s": self.total_s}


def step_flops(spec: ModelSpec, sizes: ModelSizes, *, tokens: int, seq_len: int, recompute: str) -> float:
    """FLOPs of one optimizer step's forward, backward and recompute over `tokens` tokens."""
    matmul_params = sizes.total - spec.vocab_size * spec.embed_dim * (0 if spec.tie_word_embeddings else 1)
    attention = 2 * spec.num_layers * seq_len * spec.num_heads * spec.head_dim  # causal: half of QK^T and AV
    forward = tokens * (2 * matmul_params + attention)
    trains_weights = sizes.trainable >= 0.5 * sizes.total
    backward = forward * (2 if trains_weights else 1.05)  # frozen weights: activation gradients only
    redo = {"none": 0.0, "selective": 0.15, "full": 1.0}[recompute] * forward
    return forward + backward + redo


def predict_time(spec: ModelSpec, sizes: ModelSizes, device: Device, *, num_devices: int, batch_size: int,
                 micro_batch_size: int, accumulation_steps: int, seq_len: int, recompute: str,
                 reshard_after_forward: bool, cpu_offload: bool, compute_dtype: str) -> TimeEstimate:
    per_device = math.ceil(batch_size / num_devices)
    flops = step_flops(spec, sizes, tokens=per_device * seq_len, seq_len=seq_len, recompute=recompute)
    peak = (device.bf16_tflops if compute_dtype == "bfloat16" else device.fp32_tflops) * 1e12
    top, half = EFFICIENCY[device.kind]
    mb_tokens = micro_batch_size * seq_len
    compute = flops / (peak * top * mb_tokens / (mb_tokens + half))
    comm = 0.0
    if num_devices > 1:
        c = DTYPE_BYTES[compute_dtype]
        gathers = 2 if reshard_after_forward else 1
        per_micro = (gathers * sizes.total * c + sizes.trainable * 4) * (num_devices - 1) / num_devices
        link = device.intra_node_gbps if num_devices <= device.per_node else device.inter_node_gbps
        collectives = (spec.num_layers + 1) * (gathers + 1)
        comm = accumulation_steps * (per_micro / (link * 1e9) + collectives * LATENCY_S[device.kind])
    exposed = max(comm - OVERLAP * compute, comm * (1 - OVERLAP))
    offload = 0.0
    if cpu_offload:
        moved = accumulation_steps * sizes.total / num_devices * DTYPE_BYTES[compute_dtype] * 2 + sizes.trainable * 4 / num_devices
        offload = moved / (PCIE_GBPS * 1e9) + sizes.trainable * 16 / num_devices / 20e9  # host-side AdamW
    return TimeEstimate(compute_s=compute, comm_s=comm, exposed_comm_s=exposed, offload_s=offload)
