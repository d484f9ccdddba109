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

import functools
import math
from dataclasses import dataclass, field

import torch

from moai_recipes.flavors import Device
from moai_recipes.planner.activations import RowForm, trace_head, trace_images, trace_layer
from moai_recipes.planner.cpu_speed import cpu_speed, process_threads
from moai_recipes.planner.layouts import busiest_share
from moai_recipes.planner.memory import DTYPE_BYTES, STATE_BYTES
from moai_recipes.planner.plan import Plan, Workload
from moai_recipes.planner.rollouts import Speed, rollout_seconds

# Share of the peak FLOP/s that large micro-batches reach, and the micro-batch (tokens) at which half of
# that is reached. GPU figures are typical of FSDP training; the CPU's fitted with bench/planner_accuracy.py.
EFFICIENCY = {"gpu": (0.80, 512), "cpu": (0.92, 16)}
# Share of the memory bandwidth that a training step's elementwise kernels reach (many small ones).
BANDWIDTH_EFFICIENCY = {"gpu": 0.7, "cpu": 0.63}
# Bytes per trainable value and step in fp32: gradient clipping reads the gradients for their norm and scales
# them (12); fused AdamW (train/optim.py, GPUs and the CPU alike) reads parameter, gradient and both moments and
# writes three of them once (28). In other dtypes (optimizer_s) the same passes over their bytes.
OPTIMIZER_TRAFFIC = {"gpu": 12 + 28, "cpu": 12 + 28}
# torchao's 8-bit AdamW on the CPU: a compiled kernel per parameter, dequantising and requantising its moments block
# by block, far from memory speed: 21.5 ns a value (SmolLM2-135M's parameters, 2 threads: 2.92 s a step against 0.16 s
# for torch's fused fp32 step; bench/optimizer_dtypes.py). On GPUs its kernels are priced by their traffic (not
# measured).
INT8_STEP_S_PER_VALUE = {"cpu": 21.5e-9}
# Cost of dispatching one operator, whatever its size: PyTorch's eager dispatch (and on a GPU the kernel
# launch, asynchronous: the device works meanwhile). Selective recompute runs its policy, in Python, on
# every operator of the layer: SELECTIVE_OP_S more each. The CPU's fitted with bench/planner_accuracy.py (1.8 and
# 2.4 us) when the traces also counted FakeTensorMode's device queries as operators (activations._DEVICE_QUERY:
# 3.1x the operators of a layer without recomputation, 2.7x with selective, 2.8x a head, over the ten architectures
# of tests/architectures.py and two native ones): scaled to the operators alone, the same seconds (the GPU's too,
# typical figures until a GPU measures them).
PER_OP_S = {"gpu": 31e-6, "cpu": 5.6e-6}
SELECTIVE_OP_S = {"gpu": 2.8e-6, "cpu": 5.7e-6}
# Share of collective time FSDP hides behind compute: on GPUs its own streams; on the CPU none, gloo's
# collectives take the cores the compute needs. Per collective, a fixed cost: on the CPU FSDP2's hooks
# and gloo's round trip, 2.2 ms (fitted with bench/planner_accuracy.py --processes 2).
OVERLAP = {"gpu": 0.8, "cpu": 0.0}
LATENCY_S = {"gpu": 30e-6, "cpu": 2.2e-3}
# FSDP2 on one device (for its bf16 compute or CPU offload): each "collective" a local copy and FSDP2's hooks.
LOCAL_COLLECTIVE_S = {"gpu": 20e-6, "cpu": 0.4e-3}
# An all-reduce of a few scalars (the step's token counts, its loss, the gradient norm): a round trip.
SCALAR_LATENCY_S = {"gpu": 50e-6, "cpu": 0.3e-3}
# Seconds per trainable tensor and step for the optimizer's and the clipping's Python, beyond the bytes they move
# (the memory term): AdamW's grouping and clipping on the CPU, and more for a DTensor's dispatch (clipping 21
# tensors of the tiny model: 0.45 ms plain, 1.45 ms as DTensors, on this machine); estimates to calibrate.
PARAM_S = {"gpu": 10e-6, "cpu": 15e-6}
DTENSOR_PARAM_S = {"gpu": 30e-6, "cpu": 50e-6}
# The optimizer in the backward (train/optimizer_in_backward.py): an AdamW step per tensor, called from autograd's
# hook, with its norm and finiteness: 83-85 us more a tensor than one AdamW over all (100 layers' 200 tensors on this
# machine: bench/optimizer_dtypes.py --in-backward). Host work: on a GPU it overlaps the device's.
IN_BACKWARD_PARAM_S = {"gpu": 85e-6, "cpu": 85e-6}
PCIE_GBPS = 25
# A compiled layer (plan.compile) fuses its elementwise operators: the share of the eager layer's elementwise
# traffic and of its dispatched operators that remain. GPUs: inductor's fused Triton kernels read each input
# once and launch a few kernels per layer (torchtitan's per-block compile), an estimate not yet measured here.
# The CPU in fp32: measured with `bench/packing_epoch.py --only compile` on this machine, inductor's C++ kernels are
# no faster than eager (1.03x, within the noise), so compiling there is predicted to gain nothing (never chosen).
# The CPU in bf16 (one device, train/mixed_precision.py): compiled steps of SmolLM2-135M took 0.80-0.96x the eager
# ones (full: 0.87/0.91, 0.74/0.92, 0.75/0.81 s; LoRA: 0.61/0.66, 0.54/0.60, 0.475/0.58 s), which half the traffic
# and half the operators predicts (0.91x full, 0.86x LoRA); fused bf16 elementwise operators skip their casts.
COMPILED = {("gpu", "float32"): (0.5, 0.2), ("gpu", "bfloat16"): (0.5, 0.2), ("cpu", "float32"): (1.0, 1.0),
            ("cpu", "bfloat16"): (0.5, 0.5)}
# Seconds to compile a layer's forward and backward once (one graph serves every layer), a cold cache:
# the CPU's measured (`bench/packing_epoch.py --only compile`: 27-32 s), the GPU's an estimate of inductor's
# Triton autotuning.
COMPILE_S = {"gpu": 60.0, "cpu": 30.0}
# Operators a document adds to a packed row's attention, forward and backward (CPU: per-document SDPA): 8 as the
# traces counted them with FakeTensorMode's device queries (PER_OP_S), 2.6 without, the same seconds.
DOCUMENT_OPS = 2.6
# Fixed seconds of one attention kernel's forward and backward beyond its FLOPs: the CPU's flash attention sets up
# its blocks per call (SDPA of 4 heads x 36 tokens x 32, forward and backward, on this machine: 114 us in fp32, 390
# us in bf16, which is why bf16 rows of short documents are computed in fp32: models/attention.py, the casts
# adding a little); a GPU's is a launch.
ATTENTION_CALL_S = {"cpu": {"float32": 100e-6, "bfloat16": 120e-6}, "gpu": {"float32": 20e-6, "bfloat16": 20e-6}}


# QLoRA's NF4 weights, per micro-batch: the fixed cost of dequantizing one in its forward and backward, and the
# cost per value (a linear_nf4 forward and backward against a plain linear, torchao 0.14.1, 64 tokens, on this
# machine: 1.5 ms more at 256 x 256, 2.4 ms at 1024 x 1024, 22 ms at 4096 x 1024). The GPU's: estimates.
NF4_CALL_S = {"cpu": 1.2e-3, "gpu": 60e-6}
NF4_VALUE_S = {"cpu": 5e-9, "gpu": 2e-11}

# The parts of a step the model adds up, each in seconds under the constants above. A machine's calibration
# (planner/calibration.py, `moai calibrate`) scales each by what its own runs measured.
TERMS = ("matmul", "memory", "dispatch", "parameters", "dequantize", "collectives", "transfer", "offload", "tensor",
         "pipeline", "experts", "context", "activations", "rollout")
# Tensor parallelism's collectives sit on the compute's path (a layer waits for its input's all-gather): never
# hidden. Per collective a fixed cost beside its bytes: on a GPU a launch and NCCL's latency inside a node, on the
# CPU gloo's round trip and DTensor's dispatch (estimates; bench/layouts.py measures them).
# The CPU's: tensor 2 against one process, tiny model on cpu-2 (44 collectives a step: 76 ms more).
TENSOR_COLLECTIVE_S = {"gpu": 20e-6, "cpu": 1.7e-3}
# Collectives a layer adds per micro-batch under tensor parallelism: the forward all-gathers its input for the
# attention (twice: torchtune's attention takes x and y) and for the MLP, and reduce-scatters both outputs; the
# backward does the reverse. Full recomputation runs the forward's again.
TENSOR_COLLECTIVES = {"forward": 5, "backward": 5}
# A pipeline's point-to-point send or receive: a fixed cost beside its bytes. And once a step, the schedule's
# stages are set up for the step's micro-batch shape: their shapes inferred, sent and received between stages
# (the CPU's: pipeline 2 on cpu-2, tiny model, measured against the prediction without it; the GPU's an estimate).
P2P_S = {"gpu": 30e-6, "cpu": 0.3e-3}
PIPELINE_STEP_S = {"gpu": 5e-3, "cpu": 0.02}
# Expert parallelism (train/expert_parallel.py): per sparse layer and micro-batch, the forward exchanges the counts,
# the routed rows and the experts' outputs, the backward the last two again (full recomputation: the forward's
# once more), each all-to-all a fixed cost beside its bytes (the CPU's: gloo's round trip, as its other collectives;
# a GPU's: NCCL's inside a node). The exchanges wait on the compute's path: never hidden.
ALLTOALLS = {"forward": 3, "backward": 2}
ALLTOALL_S = {"gpu": 40e-6, "cpu": 1.0e-3}
# The busiest expert device's share of a sparse layer's routed tokens over the mean: it sets the layer's pace.
# An assumption, not a measurement of a trained model here: routers trained with a balancing loss keep the most
# loaded of many experts within 1.5-2x the mean (each step's `expert_load` metric says it for a run), and a device
# holding E / ep of them averages that out; 1.0 for ep = 1, where every device computes its own tokens' experts.
EXPERT_DEVICE_IMBALANCE = 1.25
# Context parallelism (train/context_parallel.py), per layer and micro-batch: ulysses exchanges q, k, v and the
# output by all-to-all in the forward and their gradients in the backward (full recomputation: the forward's once
# more); gather all-gathers the keys and values in the forward and reduce-scatters their gradients in the backward.
# Each a fixed cost beside its bytes, as expert parallelism's all-to-alls; on the compute's path, never hidden.
CONTEXT_EXCHANGES = {"ulysses": {"forward": 4, "backward": 4}, "gather": {"forward": 1, "backward": 1}}
# The blocked, masked attention's cost over causal attention's FLOPs (predict_time): every pair of a block computed
# under the mask, and the blocks' checkpoint again (measured on cpu-2 as 1.5x the dense count: 3x the causal one).
GATHERED_ATTENTION = 3.0


@dataclass(frozen=True)
class TimeEstimate:
    terms: dict  # seconds of each of TERMS under the default constants
    kind: str  # the device's kind: how the terms combine (a GPU computes while the host dispatches)
    scales: dict = field(default_factory=dict)  # the machine's calibration of each term (absent: 1)
    once_s: float = 0.0  # paid once a run, not every step: compiling the layers

    def run_s(self, steps: int | None) -> float:
        """Seconds of a run of `steps` steps (None: unknown, a long run: the step time alone decides)."""
        return self.total_s if steps is None else self.total_s * steps + self.once_s

    @functools.cached_property  # a search sorts tens of thousands of estimates by their total, again and again
    def parts(self) -> dict:
        return combine(self.terms, self.kind, self.scales)

    @property
    def total_s(self) -> float:
        return self.parts["total_s"]

    def as_dict(self) -> dict:
        return {**self.parts, "terms": self.terms, "scales": self.scales, "once_s": self.once_s}


def combine(terms: dict, kind: str, scales: dict | None = None, maximum=max) -> dict:
    """A step's seconds from its terms, each scaled by the calibration: compute, communication (what of it is
    not hidden behind compute), offload, and their total. (The calibration fits scales through this same
    arithmetic on columns of tensors, with maximum=torch.maximum.)"""
    t = {k: terms.get(k, 0.0) * (scales or {}).get(k, 1.0) for k in TERMS}
    work, host = t["matmul"] + t["memory"] + t["dequantize"], t["dispatch"] + t["parameters"]
    # A GPU works while the host dispatches ahead of it: the slower of the two. A CPU does one, then the other.
    compute = maximum(work, host) if kind == "gpu" else work + host
    comm = t["collectives"] + t["transfer"]
    overlap = OVERLAP[kind]
    exposed = maximum(comm - overlap * compute, comm * (1 - overlap))
    # Tensor-parallel collectives, the pipeline's bubble and sends, the experts' and the context's exchanges wait on
    # the compute's path: all exposed.
    # recipes.grpo's sampling (planner/rollouts.py) runs before the training phase: in turn.
    blocking = t["tensor"] + t["pipeline"] + t["experts"] + t["context"] + t["rollout"]
    # Offloaded activations travel on their own stream while the layers compute: what takes longer than the compute.
    offload = t["offload"] + maximum(t["activations"] - compute, 0 * compute)
    return {"compute_s": compute, "comm_s": comm, "exposed_comm_s": exposed, "offload_s": offload,
            "blocking_s": blocking, "total_s": compute + exposed + offload + blocking}


def device_speed(device: Device, *, compute_dtype: str, num_devices: int) -> tuple[float, float]:
    """(peak FLOP/s, memory bytes/s) of one device; a CPU process's measured at the threads it gets."""
    if device.kind == "cpu":
        speed = cpu_speed(process_threads(num_devices))
        return (speed.bf16_flops if compute_dtype == "bfloat16" else speed.fp32_flops), speed.bytes_per_s
    tflops = device.bf16_tflops if compute_dtype == "bfloat16" else device.fp32_tflops
    return tflops * 1e12, device.hbm_gbps * 1e9


def step_shape(plan: Plan, work: Workload) -> tuple[float, int, float]:
    """(tokens a device computes in a step, padding included; its micro-batches; samples per micro-batch), from
    the lengths of the data's samples (all max_seq_len long when the data is unknown)."""
    samples = plan.batch_per_device
    # Rows padded to one of row_sizes sizes per doubling (Plan.padded_row) gain about 3/8 of a size step on average.
    padded = 1 + 0.375 / plan.row_sizes if plan.row_sizes else 1.0
    if plan.packing:  # rows nearly full, nothing padded
        tokens = samples * work.mean_length
        micro = max(1, math.ceil(tokens / plan.token_budget))
        return tokens * padded, micro, samples / micro
    m = min(plan.micro_batch_size, samples)
    return samples * work.mean_longest(m) * padded, plan.accumulation_steps, m


def _routed_flops(spec, plan: Plan, work: Workload, tokens: float, layers: int) -> float:
    """The FLOPs of a step's expert products on a device's `layers` (forward, backward, full recomputation's second
    forward): per routed row, 2 per expert weight forward, 2 for its input's gradient, 2 for its own when trained."""
    if not spec.is_moe:
        return 0.0
    passes = (3 if work.lora is None else 2) + (1 if plan.recompute == "full" else 0)
    sparse = layers * len(spec.moe_layers) / spec.num_layers
    return 2 * passes * tokens * spec.experts_per_token * 3 * spec.embed_dim * spec.expert_dim * sparse


def optimizer_s(plan: Plan, kind: str, values: float, memory_speed: float) -> float:
    """Seconds of clipping and the optimizer's step over `values` trained values in the plan's dtypes: OPTIMIZER_TRAFFIC
    scaled by the bytes they move (3 passes over the gradients and 2 over the weights in the master dtype, 2 over
    both moments; fp32's 3 x 4 + 2 x 4 + 2 x 8 = 36), at `memory_speed`; torchao's int8 step on the CPU as measured."""
    if plan.optimizer_states == "int8" and kind in INT8_STEP_S_PER_VALUE:
        return values * INT8_STEP_S_PER_VALUE[kind]
    m = DTYPE_BYTES[plan.master_dtype]
    return values * OPTIMIZER_TRAFFIC[kind] * (5 * m + 2 * STATE_BYTES[plan.optimizer_states]) / 36 / memory_speed


def predict_time(plan: Plan, work: Workload, device: Device, scales: dict | None = None) -> TimeEstimate:
    """Seconds of one optimizer step of `plan` on `device`, with the data's real lengths; `scales`: the
    machine's calibration of each term (planner/calibration.py)."""
    spec, sizes, seq_len, lora = work.spec, work.sizes, work.seq_len, work.lora_key
    n, kind = plan.num_devices, device.kind
    # The busiest pipeline device sets the pace (without a pipeline: the one device, the whole model).
    share = busiest_share(plan, spec)
    L, T, has_head = share.layers, plan.tensor_parallel, share.head
    tokens, micro, per_micro_samples = step_shape(plan, work)
    C = plan.context_parallel  # each of a row's context devices computes 1 / C of its tokens, attention included
    tokens /= C
    compute_dtype = plan.param_dtype
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
    # Traced per sequence of seq_len tokens: scaled by the tokens the step computes (a short sample's attention
    # is counted as its share of a long one's, a small overestimate that packed and padded plans share).
    layer = trace_layer(spec, seq_len=seq_len, recompute=plan.recompute, dtype=dtype, lora=lora,
                        form=RowForm.of(tiles=plan.tiled_mlp))
    head = trace_head(spec, micro_batch_size=plan.micro_batch_size, seq_len=seq_len, chunked=plan.chunked_loss,
                      dtype=dtype, lora=lora)
    sequences, heads = tokens / seq_len, tokens / plan.token_budget
    fused_traffic, fused_ops = COMPILED[kind, compute_dtype] if plan.compile else (1.0, 1.0)
    attention_flops = sequences * L * layer.attention_flops / T
    flops = (sequences * L * layer.flops + has_head * heads * head.flops) / T - attention_flops
    images, seen = work.images, None
    if images is not None and images.example_tokens:  # an image-text model's vision tower, on its samples' images
        seen = trace_images(spec, images.example, dtype=dtype, lora=lora)
        flops += seen.flops * plan.batch_per_device * images.mean / images.example_tokens
    if plan.context_parallel_way == "gather":
        # Each block of local queries against the keys from its document's start to its last query, under a mask,
        # once more in the backward (the block's checkpoint): more than causal attention's kernel (GATHERED_ATTENTION).
        attention_flops *= GATHERED_ATTENTION
    traffic = (sequences * L * layer.traffic * fused_traffic + has_head * heads * head.traffic) / T
    peak, bandwidth = device_speed(device, compute_dtype=compute_dtype, num_devices=n)
    # The CPU's flash attention computes in fp32 whatever its inputs (bf16 gains it nothing); a GPU's in the dtype.
    attention_peak = device_speed(device, compute_dtype="float32", num_devices=n)[0] if kind == "cpu" else peak
    top, half = EFFICIENCY[kind]
    mb_tokens = tokens / micro
    memory_speed = bandwidth * BANDWIDTH_EFFICIENCY[kind]
    terms = dict.fromkeys(TERMS, 0.0)
    efficiency = top * mb_tokens / (mb_tokens + half)
    # A sparse layer's experts each multiply only the rows routed to them (under expert parallelism, from all the
    # expert dimension's devices): their grouped products run at the efficiency of those rows, and the busiest
    # expert device sets the pace.
    routed = _routed_flops(spec, plan, work, tokens, L) / T
    ep, sparse = plan.expert_parallel, len(spec.moe_layers) / spec.num_layers
    expert_rows = mb_tokens * spec.experts_per_token * ep / max(spec.num_experts, 1)
    expert_efficiency = top * expert_rows / (expert_rows + half)
    imbalance = EXPERT_DEVICE_IMBALANCE if ep > 1 else 1.0
    terms["matmul"] = (flops - routed) / (peak * efficiency) + attention_flops / (attention_peak * efficiency)
    if routed:
        terms["matmul"] += routed * imbalance / (peak * expert_efficiency)
    terms["memory"] = traffic / memory_speed
    # The device's part of the parameters: its layers and root, cut by the tensor degree.
    embedding = spec.vocab_size * spec.embed_dim
    part = (1.0 if L == spec.num_layers else (L * sizes.per_layer + has_head * (sizes.root - embedding)
                                                + (share.embedding or has_head and spec.tie_word_embeddings)
                                                * embedding) / sizes.total) / T
    trainable, total = sizes.trainable * part, sizes.total * part
    if not plan.cpu_offload:  # offloaded, the optimizer runs on the host (below)
        terms["memory"] += optimizer_s(plan, kind, trainable / plan.shards, memory_speed)
    if plan.casts_copies:  # train/mixed_precision.py: each trained weight cast once a step (a frozen one once a run),
        c = DTYPE_BYTES[compute_dtype]  # each gradient once a micro-batch
        terms["memory"] += (trainable * (4 + c) + micro * trainable * (c + 8)) / memory_speed
    ops = micro * (L * layer.ops * fused_ops + has_head * head.ops + (seen.ops if seen is not None else 0))
    # Attention kernel calls, forward and backward: one per layer and micro-batch, or per document of a packed row
    # where attention runs document by document (models/attention.py: slices, a kernel, a concatenation each).
    calls = micro * L
    if plan.packing and not (kind == "gpu" and compute_dtype == "bfloat16"):
        calls *= per_micro_samples
        ops += calls * DOCUMENT_OPS
    terms["dispatch"] = ops * PER_OP_S[kind] + calls * ATTENTION_CALL_S[kind][compute_dtype]
    if plan.recompute == "selective":
        terms["dispatch"] += micro * L * layer.ops * SELECTIVE_OP_S[kind]
    # QLoRA: torchao dequantizes each NF4 weight whole at every use, forward and backward, in a dozen operators.
    nf4 = sizes.nf4_tensors_per_layer * L
    terms["dequantize"] = micro * (nf4 * NF4_CALL_S[kind] + sizes.nf4_per_layer * L * NF4_VALUE_S[kind])
    # The optimizer and the clipping handle each trainable tensor in Python, a DTensor's through its dispatch.
    dtensors = plan.sharded or T > 1
    terms["parameters"] = (sizes.trainable_tensors * L / spec.num_layers
                           * (PARAM_S[kind] + (DTENSOR_PARAM_S[kind] if dtensors else 0)
                              + (IN_BACKWARD_PARAM_S[kind] if plan.optimizer_in_backward else 0)))
    # FSDP2's copies of the model span data x context x tensor devices: inside a node while they fit one. It shards
    # over the data x context ones.
    D = plan.data_parallel * C
    link = device.intra_node_gbps if D * T <= device.per_node or kind == "cpu" else device.inter_node_gbps
    forward_gather_s = 0.0  # a plain module holds its weights whole
    if plan.replicate:  # one all-reduce of the fp32 gradients a step (ring: twice the data over the link)
        terms["transfer"] = 2 * trainable * 4 * (n - 1) / n / (link * 1e9)
        terms["collectives"] = 2 * LATENCY_S[kind]
    elif plan.sharded:
        c = DTYPE_BYTES[compute_dtype]
        # Layers are gathered for the forward and, when resharded after it, again for the backward; the
        # root once (FSDP2 keeps it until its backward); gradients are reduce-scattered in fp32. On one
        # device (FSDP2 for its bf16 compute or offload) each is a copy and a hook, without a peer. Experts split
        # over the expert dimension are gathered, and their gradients reduced, over the R = D / ep devices left,
        # each of its own E / ep experts: a group of their own.
        gathers = 2 if plan.reshard_after_forward else 1
        root = sizes.root * part if L == spec.num_layers else (total - L * sizes.per_layer / T)
        experts = sizes.experts_per_layer * L * (trainable / total if total else 1)
        R = D // ep
        dense = total - root - sizes.experts_per_layer * L / T
        per_micro = (gathers * dense * c + root * c + (trainable - experts / T) * 4) * (D - 1) / D
        if ep > 1:
            per_micro += (gathers * sizes.experts_per_layer * L * c + experts * 4) / ep * (R - 1) / R
        else:  # whole on each tensor device (not cut by it), sharded over the data devices with the rest
            per_micro += (gathers * sizes.experts_per_layer * L * c + experts * 4) * (D - 1) / D
        collectives = L * (gathers + 1) * (2 if ep > 1 else 1) + 2
        terms["transfer"] = micro * per_micro / (link * 1e9)
        latency = LATENCY_S[kind] if D > 1 else LOCAL_COLLECTIVE_S[kind]
        terms["collectives"] = micro * collectives * latency
        if D == 1 and not plan.cpu_offload:  # one device: each gather casts a layer into a new buffer, each
            cast = gathers * (total - root) + root  # reduce-scatter copies the gradients out in fp32
            terms["memory"] += micro * (cast * (4 + c) + trainable * (c + 4 + 8)) / memory_speed
        # One forward's gathers, every layer's and the root's: what recipes.grpo's sampling pays for each forward
        # (a decode step's), or once a round of completions where it keeps them (plan.gather_for_generation).
        experts_bytes = sizes.experts_per_layer * L * c * ((R - 1) / R / ep if ep > 1 else (D - 1) / D)
        forward_gather_s = (((dense + root) * c * (D - 1) / D + experts_bytes) / (link * 1e9)
                            + (L * (2 if ep > 1 else 1) + 1) * latency
                            + (total * (4 + c) / memory_speed if D == 1 and not plan.cpu_offload else 0.0)
                            + (sizes.total / n * c / (PCIE_GBPS * 1e9) if plan.cpu_offload else 0.0))
    if n > 1:  # the step's scalars summed over the processes: its tokens, its loss, the gradient norm
        terms["collectives"] += 3 * SCALAR_LATENCY_S[kind]
    mb_bytes = tokens / micro * spec.embed_dim * DTYPE_BYTES[compute_dtype]  # a micro-batch's hidden states
    if T > 1:  # inside a node (layouts.layouts): each collective moves (T - 1) / T of a micro-batch's hidden states
        count = L * (TENSOR_COLLECTIVES["forward"] * (2 if plan.recompute == "full" else 1)
                     + TENSOR_COLLECTIVES["backward"]) + 4  # the embedding's and the output projection's
        terms["tensor"] = micro * count * (TENSOR_COLLECTIVE_S[kind] + mb_bytes * (T - 1) / T / (device.intra_node_gbps * 1e9))
    if ep > 1:  # each all-to-all sends (ep - 1) / ep of a micro-batch's routed rows (k per token) and gets as many
        link_a2a = device.intra_node_gbps if ep * T <= device.per_node or kind == "cpu" else device.inter_node_gbps
        count = ALLTOALLS["forward"] * (2 if plan.recompute == "full" else 1) + ALLTOALLS["backward"]
        rows = mb_bytes / T * spec.experts_per_token * imbalance
        terms["experts"] = micro * L * sparse * (count * ALLTOALL_S[kind]
                                                + (count - 1) * rows * (ep - 1) / ep / (link_a2a * 1e9))
    if C > 1:  # ulysses: each exchange moves (C - 1) / C of the local tokens' q (k and v: expanded to the query
        # heads); gather: the local k and v of the key/value heads (unexpanded) to each of the C - 1 others
        link_cp = device.intra_node_gbps if C * T <= device.per_node or kind == "cpu" else device.inter_node_gbps
        exchanges = CONTEXT_EXCHANGES[plan.context_parallel_way]
        count = exchanges["forward"] * (2 if plan.recompute == "full" else 1) + exchanges["backward"]
        per_head = tokens / micro * spec.head_dim * DTYPE_BYTES[compute_dtype] / T
        moved = (per_head * spec.num_kv_heads * 2 * (C - 1) if plan.context_parallel_way == "gather"
                 else per_head * spec.num_heads * (C - 1) / C)
        terms["context"] = micro * L * count * (ALLTOALL_S[kind] + moved / (link_cp * 1e9))
    if plan.pipeline_stages > 1:
        P, v = plan.pipeline_stages, plan.stages_per_device
        # Each of the device's stages receives a micro-batch's hidden states (its share of them under sequence
        # parallelism) and sends them on, and the same for their gradients; stages are D x T devices apart.
        p2p_link = device.intra_node_gbps if n <= device.per_node or kind == "cpu" else device.inter_node_gbps
        terms["pipeline"] = micro * 4 * v * (P2P_S[kind] + mb_bytes / T / (p2p_link * 1e9)) + PIPELINE_STEP_S[kind]
        # The bubble: the device idles (P - 1) / v micro-batches' time as the pipeline fills and drains.
        busy = terms["matmul"] + terms["memory"] + terms["dispatch"] + terms["tensor"]
        terms["pipeline"] += busy * (P - 1) / (v * micro)
    if plan.offload_activations:
        # Each layer's input out to the host in the forward and back in the backward: over PCIe, hidden behind the
        # compute (combine); on the CPU, where the host is the device, a copy in memory.
        kept = sequences * L * layer.retained / T
        if kind == "gpu":
            terms["activations"] = 2 * kept / (PCIE_GBPS * 1e9)
        else:
            terms["memory"] += 2 * kept / memory_speed
    if plan.cpu_offload:
        # the weights in for the forward and the backward, the gradients out in their stored dtype
        moved = (micro * sizes.total / n * DTYPE_BYTES[compute_dtype] * 2
                 + sizes.trainable * DTYPE_BYTES[plan.master_dtype] / n)
        # and the host-side AdamW over the master weights, gradients and moments as stored
        state = 2 * DTYPE_BYTES[plan.master_dtype] + STATE_BYTES[plan.optimizer_states]
        terms["offload"] = moved / (PCIE_GBPS * 1e9) + sizes.trainable * state / n / 20e9
    once_s = COMPILE_S[kind] if plan.compile else 0.0
    if work.reference != "none":
        # recipes.dpo's reference: a forward of the step's pairs, a third of the layers' forward and backward (and,
        # sharded, a gather of each layer), each step ("copy") or once per pair before step 1 ("cached").
        forward = {k: terms[k] / 3 for k in ("matmul", "memory", "dispatch")}
        forward["transfer"] = terms["transfer"] / 3 if plan.sharded else 0.0
        if work.reference == "copy":
            for k, v in forward.items():
                terms[k] += v
        else:
            once_s += combine(forward, kind, scales)["total_s"] * len(work.lengths or (0,)) / work.batch_size
    if work.rollout is not None and plan.generation_batch:
        # recipes.grpo: each round's sampling, and its forwards over the completions (the sampling policy's and the
        # reference's log-probabilities: a third of a training step's compute each), spread over num_iterations.
        speed = Speed(kind, peak, memory_speed, lambda m: top * m / (m + half), PER_OP_S[kind], forward_gather_s)
        terms["rollout"] = rollout_seconds(plan, work, speed)
        passes = work.rollout.extra_passes / work.rollout.num_iterations
        terms["rollout"] += passes * ((terms["matmul"] + terms["memory"] + terms["dispatch"]) / 3
                                      + micro * forward_gather_s)
    return TimeEstimate(terms=terms, kind=kind, scales=dict(scales or {}), once_s=once_s)
