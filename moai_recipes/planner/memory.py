"""Peak memory per device of a plan: sharded state, gathered layers, activations, logits, overhead.

Every term is a count of bytes that a specific buffer holds at the moment of the peak, which is in
the backward pass of the last micro-batch (all activations of a micro-batch are alive, gradients
and optimizer state exist, one layer is gathered and its gradient unsharded).
"""

from dataclasses import dataclass

import torch

from moai_recipes.models.build import nf4_weights
from moai_recipes.models.spec import ModelSpec
from moai_recipes.models.attention import GATHER_BLOCK
from moai_recipes.planner.activations import RowForm, trace_head, trace_images, trace_layer
from moai_recipes.planner.layouts import DeviceShare, device_shares, peak_shares
from moai_recipes.planner.plan import Plan, Workload

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# AdamW's two moments, bytes per trained value (Plan.optimizer_states, train/optim.py): torchao's 8-bit AdamW keeps
# each in int8 with an fp32 scale per block of 256 values.
STATE_BYTES = {"float32": 8, "bfloat16": 4, "int8": 2 * (1 + 4 / 256)}
NF4_BYTES = 0.5 + 1 / 64 * 4 / 4 + 0.01  # 4-bit codes, per-block scales, double-quantized scalers
# torchao dequantizes an NF4 weight whole for each use (forward and backward of its linear), through
# intermediates of about 21 bytes per value whatever the compute dtype (MemTracker, torchao 0.14.1,
# 1024x1024 and 4096x1024 weights, fp32 and bf16). One linear at a time: the largest one counts.
NF4_DEQUANT_BYTES = 21
FIXED_OVERHEAD = {"gpu": 2**30, "cpu": 0}  # CUDA/ROCm context and communication buffers
SLACK = {"gpu": 0.08, "cpu": 0.05}  # allocator fragmentation, as a share of what is allocated
# Bytes of temporaries per trainable value in the optimizer step: train/optim.py's fused AdamW, on GPUs and the
# CPU alike, makes none.
OPTIMIZER_TEMPORARY = {"gpu": 0, "cpu": 0}


@dataclass(frozen=True)
class ModelSizes:
    total: int  # parameters
    per_layer: int
    root: int  # embeddings, final norm, output (the FSDP root group)
    trainable: int
    nf4_per_layer: int = 0  # QLoRA: the frozen layer weights kept in NF4
    nf4_largest: int = 0  # values of the largest of them (its dequantization is the transient peak)
    trainable_tensors: int = 0  # parameter tensors the optimizer steps and the clipping scales (each costs a call)
    nf4_tensors_per_layer: int = 0  # QLoRA: the layer's weights kept in NF4 (each dequantized at every use)
    experts_per_layer: int = 0  # a Mixture-of-Experts model's experts' weights, averaged over the layers


def model_sizes(spec: ModelSpec, lora=None) -> ModelSizes:
    """Parameter counts; with LoRA options, only the adapters are trainable (and with QLoRA some frozen
    weights are NF4: models.build.nf4_weights)."""
    total = spec.num_params()
    if not spec.native:  # transformers' modules: counted on the model built on meta (models/transformers_model.py)
        from moai_recipes.models.transformers_model import adapter_sizes

        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in lora.builder_kwargs().items())) \
            if lora else None
        trainable, tensors, nf4 = adapter_sizes(spec, key, bool(lora and lora.quantize_base))
        layers = spec.num_layers
        return ModelSizes(total=total, per_layer=sum(spec.parts.layers) // layers, root=spec.parts.root,
                          trainable=trainable, nf4_per_layer=sum(nf4) // layers, nf4_largest=max(nf4, default=0),
                          trainable_tensors=tensors, nf4_tensors_per_layer=len(nf4) // layers,
                          experts_per_layer=sum(spec.parts.routed) // layers)
    root = spec.vocab_size * spec.embed_dim * (1 if spec.tie_word_embeddings else 2) + spec.embed_dim
    per_layer = (total - root) // spec.num_layers
    trainable = lora_params(spec, lora) if lora else total
    nf4 = [r * c for (r, c), _ in nf4_weights(spec, lora).values()] if lora and lora.quantize_base else []
    experts = len(spec.moe_layers) * spec.num_experts * 3 * spec.embed_dim * spec.expert_dim
    return ModelSizes(total=total, per_layer=per_layer, root=root, trainable=trainable, nf4_per_layer=sum(nf4),
                      nf4_largest=max(nf4, default=0), trainable_tensors=_trainable_tensors(spec, lora),
                      nf4_tensors_per_layer=len(nf4), experts_per_layer=experts // spec.num_layers)


def _trainable_tensors(spec: ModelSpec, lora=None) -> int:
    """How many parameter tensors are trained: every weight, bias and norm; with LoRA two per adapter."""
    if lora:
        dense = spec.num_layers - len(spec.moe_layers)
        adapters = (spec.num_layers * len(lora.attn_modules) + (3 * dense if lora.apply_to_mlp else 0)
                    + (3 * len(spec.moe_layers) if lora.apply_to_experts else 0))  # an expert adapter is stacked
        return 2 * (adapters + (1 if lora.apply_to_output else 0))
    layer = 4 + 3 + 2 + (3 if spec.attention_bias else 0) + (1 if spec.output_bias else 0) + (2 if spec.qk_norm else 0)
    # A sparse layer holds a router beside its three (stacked) projections.
    return spec.num_layers * layer + len(spec.moe_layers) + 2 + (0 if spec.tie_word_embeddings else 1)


def lora_params(spec: ModelSpec, lora) -> int:
    """Exact adapter count: each adapted projection of shape in x out adds rank x (in + out)."""
    d, q, kv, h = spec.embed_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "output_proj": (q, d)}
    per_layer = sum(sum(shapes[m]) for m in lora.attn_modules)
    dense = spec.num_layers - len(spec.moe_layers)  # a sparse layer's MLP is its experts
    mlp = 3 * (d + h) * dense if lora.apply_to_mlp else 0  # gate, up and down projections
    experts = 3 * (d + spec.expert_dim) * spec.num_experts * len(spec.moe_layers) if lora.apply_to_experts else 0
    output = (d + spec.vocab_size) if lora.apply_to_output else 0
    return lora.rank * (spec.num_layers * per_layer + mlp + experts + output)


@dataclass(frozen=True)
class MemoryBreakdown:
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    logits: int
    overhead: int
    phase: str = ""  # when the peak happens (see predict_memory)

    @property
    def total(self) -> int:
        return self.allocated + self.overhead

    @property
    def allocated(self) -> int:
        """What the tensors hold at the peak, without the overhead of the allocator and the runtime."""
        return self.params + self.grads + self.optimizer + self.gathered + self.activations + self.logits

    def as_dict(self) -> dict:
        return {**self.__dict__, "total": self.total}


def param_dtype(plan: Plan) -> torch.dtype:
    """The dtype the plan's weights are traced in."""
    return torch.bfloat16 if plan.param_dtype == "bfloat16" else torch.float32


def _image_tokens(plan: Plan, work: Workload, rows: int, row_tokens: int) -> float:
    """The most image tokens a micro-batch of `rows` rows of `row_tokens` holds: padded, a sample a row, each with the
    most of any sample; packed, a row's tokens filled with samples as dense in image tokens as the densest (a packed
    row of DPO pairs carries each pair's pictures twice: 4 pairs, 8 sets of pictures, where one sample's were priced:
    measured +34% over the prediction before)."""
    images = work.images
    if not plan.packing:
        return rows * images.most
    if not images.shortest:  # the samples' lengths not known: every sample a row's length with the most image tokens
        return rows * max(1, row_tokens // max(work.seq_len, 1)) * images.most
    # The fewer of: the row filled at the densest sample's share of image tokens, and as many of the shortest samples
    # as the row holds, each with the most image tokens.
    fitting = max(1, row_tokens // images.shortest) * images.most
    return rows * max(images.most, min(min(1.0, images.densest) * row_tokens, fitting))


def predict_memory(plan: Plan, work: Workload, device_kind: str, traced_scale: float = 1.0) -> MemoryBreakdown:
    """Peak bytes on one device for one plan: the largest of four moments of the step.

    The sharded parameters and optimizer state live throughout. In the backward pass of the last
    micro-batch the peak is at one of its three turning points: the loss's backward (every layer's
    retained activations, the logits and their gradients, or a chunk of them), the last layer's backward (the logits
    freed, the layer's backward transient added), or the first layer's backward (the activations
    gone, every sharded gradient made); between them memory moves monotonically, layer by layer.
    Under LoRA, a layer before the first adapter runs its forward with nothing kept yet: its temporaries alone (a
    hybrid model's Gated DeltaNet layers, whose chunks outweigh the rest of the step at short rows).
    Weight gradients of earlier micro-batches are alive throughout when accumulating (freed after
    each step otherwise). Then the optimizer step: the sharded state and the optimizer's own
    temporaries (OPTIMIZER_TEMPORARY bytes per trainable value: fused AdamW makes none). `traced_scale`: the
    machine's calibration of the traced activations and logits (planner/calibration.py).

    Under pipeline parallelism, the busiest of the pipeline's devices (layouts.device_shares): each holds its
    stages' layers and micro-batches in flight as the schedule keeps them.
    """
    shares = peak_shares(plan, work.spec)
    return max((_device_memory(plan, work, device_kind, traced_scale, share) for share in shares),
               key=lambda m: m.total)


def _device_memory(plan: Plan, work: Workload, device_kind: str, traced_scale: float,
                   share: DeviceShare) -> MemoryBreakdown:
    """predict_memory on one pipeline device: its layers, its part of the root, its micro-batches in flight, all
    cut by the tensor-parallel degree T (sequence parallelism cuts the activations too)."""
    spec, sizes, seq_len, lora = work.spec, work.sizes, work.seq_len, work.lora_key
    micro_batch_size, recompute, cpu_offload = plan.micro_batch_size, plan.recompute, plan.cpu_offload
    c = DTYPE_BYTES[plan.param_dtype]
    T, ep = plan.tensor_parallel, plan.expert_parallel
    n, L = plan.shards, share.layers  # n: what the state is cut into (1 in a replica: whole on every process)
    full = sizes.trainable == sizes.total
    embedding = spec.vocab_size * spec.embed_dim
    # A tied embedding is the head's weight too: the last stage holds a copy of it (train/pipeline.py).
    holds_embedding = share.embedding or (share.head and spec.tie_word_embeddings)
    root = (embedding if holds_embedding else 0) + (sizes.root - embedding if share.head else 0)
    # Parameters on this device, before FSDP2 shards them (the whole model's count exactly, without a pipeline). A
    # sparse layer's experts are not cut by tensor parallelism (each device routes its own tokens to them whole);
    # FSDP2 shards them over the data-parallel devices as it shards the rest, split over the expert dimension or not.
    experts = sizes.experts_per_layer * L
    held = ((sizes.total if L == spec.num_layers else L * sizes.per_layer + root) - experts) / T + experts
    nf4 = sizes.nf4_per_layer * L
    trainable = held if full else sizes.trainable * L / spec.num_layers / T
    m = DTYPE_BYTES[plan.master_dtype]  # a trained weight's and its gradient's bytes
    master = stored_weights(plan, trained=trainable, frozen=held - nf4 - trainable, nf4=nf4)
    # And RoPE's cos and sin tables (one for all layers, fp32 buffers, whole on every device, on it even under CPU
    # offload): a position per token of the longest row.
    params = (0 if cpu_offload else master / n) + 2 * plan.row_length * spec.head_dim * 4
    if work.reference == "copy" and full:  # recipes.dpo's frozen reference: a second copy in the compute dtype
        params += stored_weights(plan, trained=0, frozen=held - nf4, nf4=nf4) / n
    sharded_grads = 0 if cpu_offload else trainable * m / n
    optimizer = 0 if cpu_offload else trainable * STATE_BYTES[plan.optimizer_states] / n  # AdamW's two moments

    # FSDP2 keeps the root group (embeddings, norm, output) gathered for the whole step, and a layer
    # plus the next one (prefetch) in the backward; without resharding after forward every layer
    # stays gathered until its backward. NF4 weights are gathered as NF4 (torchao's FSDP2 hooks), and
    # not at all in one process (FSDP leaves them alone there, see parallel.shard_model). One process
    # computing in fp32 keeps a plain module (Plan.sharded): it uses its parameters as they are.
    # A plain module computing below its master dtype holds a copy of every weight in the compute dtype for the
    # whole step (train/mixed_precision.py), as FSDP2 does without resharding.
    fsdp, copies = plan.sharded, plan.casts_copies
    # A layer gathered: its dense weights cut by tensor parallelism and, of its experts, this device's 1 / ep.
    gathered_layer = (sizes.per_layer - sizes.experts_per_layer) / T + sizes.experts_per_layer / ep
    # A layer's trained values (all of them in full fine-tuning, its adapters in LoRA), cut by tensor parallelism.
    layer_trainable = (sizes.trainable - (sizes.root if full else 0)) / spec.num_layers / T
    layer_c = ((gathered_layer - sizes.nf4_per_layer) * c + (sizes.nf4_per_layer * NF4_BYTES if n > 1 else 0)) if fsdp else 0
    root_gathered = root / T * c if fsdp else 0
    if copies:  # a plain module's compute copies: of its trained weights only (the frozen ones compute as stored)
        layer_c = layer_trainable * c
        root_gathered = root / T * c if full else 0
    layers_gathered = (lambda k: k * layer_c) if plan.reshard_after_forward and not copies else (lambda k: L * layer_c)
    # The root's weight gradients (in the compute dtype, before their reduce-scatter, which comes last):
    # the output projection's from the loss's backward on, the embeddings' only after the first layer's.
    # At the end of a layer's backward FSDP2 copies its gradients into one flat fp32 buffer for the
    # reduce-scatter (whatever the world size) while they are still alive (measured: +1 layer of grads).
    output_grad = (sizes.root - embedding * (not spec.tie_word_embeddings)) / T * c if full and share.head else 0
    reduce_copy = gathered_layer * 4 * sizes.trainable / sizes.total if fsdp else 0
    # Sharded gradients of all layers but the first (and not yet the root's) while the first runs its backward; with
    # the optimizer in the backward (train/optimizer_in_backward.py) each layer's are applied and freed as they come:
    # one layer's at a time.
    later_grads = 0 if cpu_offload else (L - 1) * layer_trainable * m / n
    if plan.optimizer_in_backward:
        later_grads = layer_trainable * m / n

    dtype = param_dtype(plan)
    # Packed rows attend document by document except in a GPU's varlen kernel (models/attention.py).
    per_document = plan.packing and not (device_kind == "gpu" and plan.param_dtype == "bfloat16")
    act = trace_layer(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora,
                      form=RowForm.of(per_document, plan.tiled_mlp))
    # Context parallelism: a device holds 1 / C of each row's tokens, and their activations (ulysses: the whole row
    # of 1 / C of the heads inside attention, as many values). Gathering instead, a layer's attention holds the
    # whole row's keys and values, expanded to the query heads (torchtune expands them before attention), and the
    # mask of a block of local queries against the keys as SDPA takes it: a boolean and the float it becomes (5
    # bytes a pair).
    C = plan.context_parallel
    row = micro_batch_size * seq_len
    # In the backward the whole row's keys and values have a gradient as large, summed back to the devices that own
    # them (the gather's reduce-scatter): measured +11.8% peak without it (a 2-layer SmolLM2-wide model, one
    # 18,432-token row over cpu-4).
    # The mask is one block's of GATHER_BLOCK queries at a time (train/context_parallel.py), against at most the row.
    gathered_kv = (2 * 2 * row * spec.num_kv_heads * spec.head_dim * c / T + min(row / C, GATHER_BLOCK) * row * 5
                   if plan.context_parallel_way == "gather" else 0)
    retained = L * act.kept(micro_batch_size) * share.in_flight / T / C
    # An image-text model's vision tower and projector (beside the embeddings): what they keep from the forward for
    # the backward, for the most image tokens a micro-batch can hold, until the backward reaches them (after the
    # first layer's), and the images' pixels. Traced on one sample's images, counted per image token.
    images_kept = 0
    if work.images is not None and work.images.example_tokens and share.embedding:
        seen = trace_images(spec, work.images.example, dtype=dtype, lora=lora)
        images_kept = ((seen.retained + seen.inputs) * _image_tokens(plan, work, micro_batch_size, seq_len)
                       / work.images.example_tokens * share.in_flight)
    retained += images_kept
    if plan.offload_activations:  # on the device: the layer whose input is on its way out, or back in (prefetched)
        retained = min(2, L * share.in_flight) * act.kept(micro_batch_size) / T / C
    layer_backward = (act.backward_transient(micro_batch_size) / C + act.grads_at_peak) / T + gathered_kv + reduce_copy
    earlier_grads = sharded_grads if plan.accumulation_steps > 1 else 0
    # The final norm, the output projection and the loss as traced: the logits in the compute dtype and in
    # fp32, the log-softmax and the gradients over them (about 12 bytes per token and vocabulary entry),
    # or one chunk's worth of them with the chunked loss. A context device computes the loss of its own share of
    # each row: traced at that length (a chunk is a chunk whatever C: dividing the whole row's by C under-counted
    # it, +45% peak measured on cpu-2 with SmolLM2's 49,152-token vocabulary).
    logits = trace_head(spec, micro_batch_size=micro_batch_size, seq_len=-(-seq_len // C), chunked=plan.chunked_loss,
                        dtype=dtype, lora=lora).peak / T if share.head else 0
    # The last layer stays gathered from its forward (parallel.shard_model); in the backward each layer
    # is gathered with the next one (prefetch), but the first has no next.
    from moai_recipes.planner.rollouts import rollout_bytes  # it counts in DTYPE_BYTES, from here

    rollout = rollout_bytes(plan, work) if work.rollout is not None and plan.generation_batch else None
    # The moments the peak can be at: (name, gathered, grads, activations, logits). Tuples, not dictionaries: a
    # search of 70B on 48xlarge makes 40,000 of each.
    phases = []
    if act.unlearned_forward:  # LoRA's layers before the first adapter run forward alone, nothing kept yet
        phases.append(("unadapted layer forward", root_gathered + layers_gathered(2), earlier_grads,
                       micro_batch_size * act.unlearned_forward / T / C, 0))
    phases += [
        ("loss backward", root_gathered + layers_gathered(1) + output_grad, earlier_grads, retained, logits),
        ("last layer backward", root_gathered + layers_gathered(2) + output_grad, earlier_grads,
         retained + layer_backward, 0),
        ("first layer backward", root_gathered + layers_gathered(1) + output_grad, max(earlier_grads, later_grads),
         act.kept(micro_batch_size) / T / C + layer_backward + images_kept, 0),
        # (In the backward, nothing is left to it: a parameter at a time, its temporaries a parameter's.)
        ("optimizer step", 0, sharded_grads, 0 if cpu_offload else trainable * OPTIMIZER_TEMPORARY[device_kind] / n, 0)
        if not plan.optimizer_in_backward else ("optimizer step", 0, 0, 0, 0)]
    if rollout:
        # recipes.grpo's sampling (planner/rollouts.py): the chunk's KV cache and logits, the layers gathered as in a
        # forward (or all of them, kept for the round: plan.gather_for_generation), no gradient yet.
        gathered = root_gathered + (L * layer_c if plan.gather_for_generation else layers_gathered(2))
        phases.append(("generation", gathered, 0, rollout[0], rollout[1]))
    # A replica sums its gradients over the processes through one flat copy of them (train/parallel.py).
    phases.append(("gradients all-reduced", 0, sharded_grads * 2 if plan.replicate else 0, 0, 0))
    if traced_scale != 1.0:  # the traced bytes as this machine's calibration scales them
        phases = [(name, gathered, grads, activations * traced_scale, logits * traced_scale)
                  if name not in ("optimizer step", "generation") else (name, gathered, grads, activations, logits)
                  for name, gathered, grads, activations, logits in phases]  # (those two are counted, not traced)
    phase, gathered, grads, activations, logits = max(phases, key=lambda p: p[1] + p[2] + p[3] + p[4])
    if phase not in ("optimizer step", "gradients all-reduced"):
        gathered += sizes.nf4_largest * NF4_DEQUANT_BYTES
    subtotal = params + optimizer + (gathered + grads + activations + logits)
    return MemoryBreakdown(params=int(params), grads=int(grads), optimizer=int(optimizer), gathered=int(gathered),
                           activations=int(activations), logits=int(logits),
                           overhead=int(FIXED_OVERHEAD[device_kind] + SLACK[device_kind] * subtotal), phase=phase)


# Host memory of a GPU process beside what the plan puts there: the CUDA/ROCm runtime, NCCL, torch and the
# libraries (about 3 GiB resident per process on a GPU node).
HOST_PROCESS_BYTES = 3 * 2**30
# The largest safetensors file an export holds whole on its writing rank (models/hf_format.save_weights):
# Hugging Face's usual shard size. The checkpoint's own files are larger only when it is one single file.
EXPORT_FILE_BYTES = 5 * 10**9


@dataclass(frozen=True)
class HostMemory:
    """Peak host (CPU) bytes of one node of a GPU flavor, for one plan."""

    processes: int  # on the node
    runtime: int  # per process: HOST_PROCESS_BYTES
    offloaded: int  # per process: parameters, gradients and optimizer state under CPU offload
    loading: int  # per process: the largest whole weight, read in fp32 while loading and exporting
    export_file: int  # on the writing rank's node: one input file held whole while the model is written
    activations: int = 0  # per process: the layer inputs plan.offload_activations keeps on the host

    @property
    def total(self) -> int:
        return self.processes * (self.runtime + self.offloaded + self.loading + self.activations) + self.export_file

    def as_dict(self) -> dict:
        return {**self.__dict__, "total": self.total}


def stored_weights(plan: Plan, *, trained: float, frozen: float, nf4: float) -> float:
    """Bytes of weights as the plan stores them (train/mixed_precision.stored_as_planned): a trained one in the master
    dtype (fp32, or bf16 with precision=bf16), a frozen one (LoRA's base, DPO's reference) in the compute dtype,
    QLoRA's NF4 ones in NF4."""
    return trained * DTYPE_BYTES[plan.master_dtype] + frozen * DTYPE_BYTES[plan.param_dtype] + nf4 * NF4_BYTES


def predict_host_memory(plan: Plan, work: Workload, processes_per_node: int) -> HostMemory:
    """Host bytes of the busiest node: each process's runtime, its share of what CPU offload keeps on the host
    (master weights of what trains, frozen weights in the compute dtype or NF4, gradients and AdamW's two moments,
    each in the plan's dtype), the largest weight whole in fp32 (loading reads and exporting gathers one at a time),
    and on rank 0's node one file of the export."""
    spec, sizes = work.spec, work.sizes
    nf4 = sizes.nf4_per_layer * spec.num_layers
    offloaded = 0
    if plan.cpu_offload:
        weights = stored_weights(plan, trained=sizes.trainable, frozen=sizes.total - nf4 - sizes.trainable, nf4=nf4)
        grads = sizes.trainable * DTYPE_BYTES[plan.master_dtype]
        offloaded = (weights + grads + sizes.trainable * STATE_BYTES[plan.optimizer_states]) / plan.shards
    # A sparse layer's experts are loaded and exported stacked, one projection of all of them at a time.
    largest = max(spec.vocab_size * spec.embed_dim, spec.intermediate_dim * spec.embed_dim,
                  spec.num_heads * spec.head_dim * spec.embed_dim,
                  spec.num_experts * spec.expert_dim * spec.embed_dim) * 4
    return HostMemory(processes=processes_per_node, runtime=HOST_PROCESS_BYTES, offloaded=int(offloaded),
                      loading=largest, export_file=EXPORT_FILE_BYTES, activations=int(offloaded_activations(plan, work)))


def offloaded_activations(plan: Plan, work: Workload) -> float:
    """Host bytes per process of the layer inputs plan.offload_activations keeps there: every layer's of every
    micro-batch in flight on the busiest pipeline device (models/activation_offload.py)."""
    if not plan.offload_activations:
        return 0.0
    dtype = param_dtype(plan)
    # Full recomputation keeps the layer's input alone, however its attention runs.
    act = trace_layer(work.spec, seq_len=work.seq_len, recompute=plan.recompute, dtype=dtype, lora=work.lora_key,
                      form=RowForm.of(tiles=plan.tiled_mlp))
    held = max(s.layers * s.in_flight for s in device_shares(plan, work.spec))
    return held * act.kept(plan.micro_batch_size) / plan.tensor_parallel / plan.context_parallel
