"""Step time of a plan: traced FLOPs against the device, FSDP collectives against the links.

compute = FLOPs (forward, backward, recompute) / (peak x efficiency), where efficiency grows with
the tokens in a micro-batch (small matmuls do not fill a GPU); collectives per micro-batch are the
all-gather of the parameters (again in backward when resharded) and the reduce-scatter of the
gradients, mostly overlapped with compute by FSDP's prefetching; offload adds host transfers.
"""

import math
from dataclasses import dataclass

import torch

from moai_recipes.flavors import Device
from moai_recipes.models import ModelSpec
from moai_recipes.planner.activations import trace_layer
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


# Selective recompute redoes the pointwise ops (norms, SiLU, products), which count no matmul FLOPs
# but cost memory traffic: about this share of the forward's time.
SELECTIVE_REDO = 0.15


def step_flops(spec: ModelSpec, sizes: ModelSizes, *, sequences: int, seq_len: int, recompute: str,
               compute_dtype: str, lora: tuple | None = None) -> float:
    """FLOPs of forward, recompute and backward over `sequences` sequences: the layers' as traced
    (FlopCounterMode, with the recompute policy and frozen weights as in training), the output
    projection's from its shape."""
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
    layer = trace_layer(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora).flops
    output_forward = 2 * seq_len * spec.embed_dim * spec.vocab_size
    output_trained = sizes.trainable == sizes.total
    output = output_forward * (3 if output_trained else 2)  # forward, input gradient, weight gradient
    redo = SELECTIVE_REDO * layer / 3 if recompute == "selective" else 0.0  # a forward is a third of the total
    return sequences * (spec.num_layers * (layer + redo) + output)


def predict_time(spec: ModelSpec, sizes: ModelSizes, device: Device, *, num_devices: int, batch_size: int,
                 micro_batch_size: int, accumulation_steps: int, seq_len: int, recompute: str,
                 reshard_after_forward: bool, cpu_offload: bool, compute_dtype: str,
                 lora: tuple | None = None) -> TimeEstimate:
    per_device = math.ceil(batch_size / num_devices)
    flops = step_flops(spec, sizes, sequences=per_device, seq_len=seq_len, recompute=recompute,
                       compute_dtype=compute_dtype, lora=lora)
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
