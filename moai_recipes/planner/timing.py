"""Step time of a plan: traced FLOPs and memory traffic against the device, FSDP collectives against the links.

compute = FLOPs / (peak x efficiency) + bytes moved / memory bandwidth, and the operators' dispatch,
all traced from the real layer and head (activations.py) as the plan runs them: recomputation adds
its operators, a chunked loss its extra projection. Efficiency grows with the tokens in a micro-batch (small matmuls do not
fill a device). The optimizer and the gradient clipping stream every trainable value through memory.
Collectives per micro-batch are the all-gather of the parameters (again in the backward when
resharded after the forward) and the reduce-scatter of the gradients, mostly hidden behind compute
by FSDP's prefetching; CPU offload adds host transfers and a host-side optimizer.

A GPU's peak figures come from its data sheet (flavors.DEVICES), the CPU's are measured on this
machine (cpu_speed.py); bench/planner_accuracy.py compares predictions with measured steps.
"""

import math
from dataclasses import dataclass

import torch

from moai_recipes.flavors import Device
from moai_recipes.planner.activations import trace_head, trace_layer
from moai_recipes.planner.cpu_speed import cpu_speed, process_threads
from moai_recipes.planner.memory import DTYPE_BYTES
from moai_recipes.planner.plan import Plan, Workload

# Share of the peak FLOP/s that large micro-batches reach, and the micro-batch (tokens) at which half of
# that is reached. GPU figures are typical of FSDP training; the CPU's fitted with bench/planner_accuracy.py.
EFFICIENCY = {"gpu": (0.55, 1024), "cpu": (0.92, 16)}
# Share of the memory bandwidth that a training step's elementwise kernels reach (many small ones).
BANDWIDTH_EFFICIENCY = {"gpu": 0.7, "cpu": 0.63}
# Bytes per trainable value and step: gradient clipping reads the gradients for their norm and scales
# them (12); AdamW, counted with activations.OpCounter on torch 2.13: foreach (CPU) 52, fused (GPU)
# reads parameter, gradient and both moments and writes three of them once (28).
OPTIMIZER_TRAFFIC = {"gpu": 12 + 28, "cpu": 12 + 52}
# Cost of dispatching one operator, whatever its size: PyTorch's eager dispatch (and on a GPU the kernel
# launch, asynchronous: the device works meanwhile). Selective recompute runs its policy, in Python, on
# every operator of the layer: SELECTIVE_OP_S more each. The CPU's fitted with bench/planner_accuracy.py.
PER_OP_S = {"gpu": 10e-6, "cpu": 1.8e-6}
SELECTIVE_OP_S = {"gpu": 2.5e-6, "cpu": 2.4e-6}
# Share of collective time FSDP hides behind compute: on GPUs its own streams; on the CPU none, gloo's
# collectives take the cores the compute needs. Per collective, a fixed cost: on the CPU FSDP2's hooks
# and gloo's round trip, 2.2 ms (fitted with bench/planner_accuracy.py --processes 2).
OVERLAP = {"gpu": 0.8, "cpu": 0.0}
LATENCY_S = {"gpu": 30e-6, "cpu": 2.2e-3}
PCIE_GBPS = 25
# A compiled layer (plan.compile) fuses its elementwise operators: the share of the eager layer's elementwise
# traffic and of its dispatched operators that remain. GPUs: inductor's fused Triton kernels read each input
# once and launch a few kernels per layer (torchtitan's per-block compile), an estimate not yet measured here.
# The CPU: measured with `bench/packing_epoch.py --only compile` on this machine, inductor's C++ kernels are no
# faster than eager (1.03x, within the noise), so compiling there is predicted to gain nothing (never chosen).
COMPILED = {"gpu": (0.5, 0.2), "cpu": (1.0, 1.0)}
# Seconds to compile a layer's forward and backward once (one graph serves every layer), a cold cache:
# the CPU's measured (`bench/packing_epoch.py --only compile`: 27-32 s), the GPU's an estimate of inductor's
# Triton autotuning.
COMPILE_S = {"gpu": 60.0, "cpu": 30.0}
# Operators a document adds to a packed row's attention, forward and backward (CPU: per-document SDPA).
DOCUMENT_OPS = 8


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    once_s: float = 0.0  # paid once a run, not every step: compiling the layers

    def run_s(self, steps: int | None) -> float:
        """Seconds of a run of `steps` steps (None: unknown, a long run: the step time alone decides)."""
        return self.total_s if steps is None else self.total_s * steps + self.once_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "total_s": self.total_s}


def device_speed(device: Device, *, compute_dtype: str, num_devices: int) -> tuple[float, float]:
    """(peak FLOP/s, memory bytes/s) of one device; a CPU process's measured at the threads it gets."""
    if device.kind == "cpu":
        speed = cpu_speed(process_threads(num_devices))
        return speed.fp32_flops, speed.bytes_per_s
    tflops = device.bf16_tflops if compute_dtype == "bfloat16" else device.fp32_tflops
    return tflops * 1e12, device.hbm_gbps * 1e9


def step_shape(plan: Plan, work: Workload) -> tuple[float, int, float]:
    """(tokens a device computes in a step, padding included; its micro-batches; samples per micro-batch), from
    the lengths of the data's samples (all max_seq_len long when the data is unknown)."""
    samples = plan.batch_per_device
    if plan.packing:  # rows nearly full, nothing padded
        tokens = samples * work.mean_length
        micro = max(1, math.ceil(tokens / plan.token_budget))
        return tokens, micro, samples / micro
    m = min(plan.micro_batch_size, samples)
    return samples * work.mean_longest(m), plan.accumulation_steps, m


def predict_time(plan: Plan, work: Workload, device: Device) -> TimeEstimate:
    """Seconds of one optimizer step of `plan` on `device`, with the data's real lengths."""
    spec, sizes, seq_len, lora = work.spec, work.sizes, work.seq_len, work.lora_key
    n, L = plan.num_devices, spec.num_layers
    tokens, micro, per_micro_samples = step_shape(plan, work)
    compute_dtype = plan.param_dtype
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
    # Traced per sequence of seq_len tokens: scaled by the tokens the step computes (a short sample's attention
    # is counted as its share of a long one's, a small overestimate that packed and padded plans share).
    layer = trace_layer(spec, seq_len=seq_len, recompute=plan.recompute, dtype=dtype, lora=lora)
    head = trace_head(spec, micro_batch_size=plan.micro_batch_size, seq_len=seq_len, chunked=plan.chunked_loss,
                      dtype=dtype, lora=lora)
    sequences, heads = tokens / seq_len, tokens / plan.token_budget
    fused_traffic, fused_ops = COMPILED[device.kind] if plan.compile else (1.0, 1.0)
    flops = sequences * L * layer.flops + heads * head.flops
    traffic = sequences * L * layer.traffic * fused_traffic + heads * head.traffic
    peak, bandwidth = device_speed(device, compute_dtype=compute_dtype, num_devices=n)
    top, half = EFFICIENCY[device.kind]
    mb_tokens = tokens / micro
    memory_speed = bandwidth * BANDWIDTH_EFFICIENCY[device.kind]
    work = flops / (peak * top * mb_tokens / (mb_tokens + half)) + traffic / memory_speed
    if not plan.cpu_offload:  # offloaded, the optimizer runs on the host (below)
        work += sizes.trainable / plan.shards * OPTIMIZER_TRAFFIC[device.kind] / memory_speed
    ops = micro * (L * layer.ops * fused_ops + head.ops)
    if plan.packing:  # attention document by document (models/attention.py): slices, a kernel, a concatenation
        ops += micro * per_micro_samples * L * DOCUMENT_OPS
    dispatch = ops * PER_OP_S[device.kind]
    if plan.recompute == "selective":
        dispatch += micro * L * layer.ops * SELECTIVE_OP_S[device.kind]
    # A GPU works while the host dispatches ahead of it: the slower of the two. A CPU does one, then the other.
    compute = max(work, dispatch) if device.kind == "gpu" else work + dispatch
    comm = 0.0
    link = device.intra_node_gbps if n <= device.per_node else device.inter_node_gbps
    if plan.replicate:  # one all-reduce of the fp32 gradients a step (ring: twice the data over the link)
        comm = 2 * sizes.trainable * 4 * (n - 1) / n / (link * 1e9) + 2 * LATENCY_S[device.kind]
    elif n > 1:
        c = DTYPE_BYTES[compute_dtype]
        # Layers are gathered for the forward and, when resharded after it, again for the backward; the
        # root once (FSDP2 keeps it until its backward); gradients are reduce-scattered in fp32.
        gathers = 2 if plan.reshard_after_forward else 1
        per_micro = (gathers * (sizes.total - sizes.root) * c + sizes.root * c + sizes.trainable * 4) * (n - 1) / n
        collectives = L * (gathers + 1) + 2
        comm = micro * (per_micro / (link * 1e9) + collectives * LATENCY_S[device.kind])
    overlap = OVERLAP[device.kind]
    exposed = max(comm - overlap * compute, comm * (1 - overlap))
    offload = 0.0
    if plan.cpu_offload:
        moved = micro * sizes.total / n * DTYPE_BYTES[compute_dtype] * 2 + sizes.trainable * 4 / n
        offload = moved / (PCIE_GBPS * 1e9) + sizes.trainable * 16 / n / 20e9  # host-side AdamW
    return TimeEstimate(compute_s=compute, comm_s=comm, exposed_comm_s=exposed, offload_s=offload,
                        once_s=COMPILE_S[device.kind] if plan.compile else 0.0)
