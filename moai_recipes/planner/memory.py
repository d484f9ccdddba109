"""Peak memory per device of a plan: sharded state, gathered layers, activations, logits, overhead.

Every term is a count of bytes that a specific buffer holds at the moment of the peak, which is in
the backward pass of the last micro-batch (all activations of a micro-batch are alive, gradients
and optimizer state exist, one layer is gathered and its gradient unsharded).
"""

from dataclasses import dataclass

import torch

from moai_recipes.models import ModelSpec, nf4_weights
from moai_recipes.planner.activations import trace_layer

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
NF4_BYTES = 0.5 + 1 / 64 * 4 / 4 + 0.01  # 4-bit codes, per-block scales, double-quantized scalers
# torchao dequantizes an NF4 weight whole for each use (forward and backward of its linear), through
# intermediates of about 21 bytes per value whatever the compute dtype (MemTracker, torchao 0.14.1,
# 1024x1024 and 4096x1024 weights, fp32 and bf16). One linear at a time: the largest one counts.
NF4_DEQUANT_BYTES = 21


@dataclass(frozen=True)
class ModelSizes:
    total: int  # parameters
    per_layer: int
    root: int  # embeddings, final norm, output (the FSDP root group)
    trainable: int
    nf4_per_layer: int = 0  # QLoRA: the frozen layer weights kept in NF4
    nf4_largest: int = 0  # values of the largest of them (its dequantization is the transient peak)


def model_sizes(spec: ModelSpec, lora=None) -> ModelSizes:
    """Parameter counts; with LoRA options, only the adapters are trainable (and with QLoRA some frozen
    weights are NF4: those torchtune's QLoRA builders quantize)."""
    total = spec.num_params()
    root = spec.vocab_size * spec.embed_dim * (1 if spec.tie_word_embeddings else 2) + spec.embed_dim
    per_layer = (total - root) // spec.num_layers
    trainable = lora_params(spec, lora) if lora else total
    nf4 = [r * c for (r, c), _ in nf4_weights(spec, lora).values()] if lora and lora.quantize_base else []
    return ModelSizes(total=total, per_layer=per_layer, root=root, trainable=trainable, nf4_per_layer=sum(nf4),
                      nf4_largest=max(nf4, default=0))


def lora_params(spec: ModelSpec, lora) -> int:
    """Exact adapter count: each adapted projection of shape in x out adds rank x (in + out)."""
    d, q, kv, h = spec.embed_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "output_proj": (q, d)}
    per_layer = sum(sum(shapes[m]) for m in lora.attn_modules)
    if lora.apply_to_mlp:
        per_layer += 3 * (d + h)  # gate, up and down projections
    output = (d + spec.vocab_size) if lora.apply_to_output else 0
    return lora.rank * (spec.num_layers * per_layer + output)


@dataclass(frozen=True)
class MemoryBreakdown:
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations + self.logits + self.overhead

    def as_dict(self) -> dict:
        return {**self.__dict__, "total": self.total}


def predict_memory(spec: ModelSpec, sizes: ModelSizes, *, num_devices: int, micro_batch_size: int, seq_len: int,
                   recompute: str, reshard_after_forward: bool, cpu_offload: bool, compute_dtype: str,
                   fixed_overhead: int, slack: float, lora: tuple | None = None,
                   accumulation_steps: int = 1) -> MemoryBreakdown:
    """Peak bytes on one device for one plan.

    The peak is in the backward pass of the last micro-batch, at one of its two ends. At its start
    every layer's activations and the loss's gradients over the logits are alive, and the weight
    gradients are those of the earlier micro-batches (none without accumulation: they are freed
    after each step). At its end the activations are gone but every sharded gradient exists, and
    the first layer runs its backward (recomputing its forward when asked). In between, memory
    moves linearly from one to the other, layer by layer.
    """
    c = DTYPE_BYTES[compute_dtype]
    n, L = num_devices, spec.num_layers
    full = sizes.trainable == sizes.total
    nf4 = sizes.nf4_per_layer * L
    master = (sizes.total - nf4) * 4 + nf4 * NF4_BYTES
    params = 0 if cpu_offload else master / n
    sharded_grads = 0 if cpu_offload else sizes.trainable * 4 / n
    optimizer = 0 if cpu_offload else sizes.trainable * 8 / n  # AdamW: two fp32 moments

    # FSDP2 keeps the root group (embeddings, norm, output) gathered for the whole step, and a layer
    # plus the next one (prefetch) in the backward; without resharding after forward every layer
    # stays gathered until its backward. NF4 weights are gathered as NF4 (torchao's FSDP2 hooks), and
    # not at all in one process (FSDP leaves them alone there, see parallel.shard_model).
    layer_c = (sizes.per_layer - sizes.nf4_per_layer) * c + (sizes.nf4_per_layer * NF4_BYTES if n > 1 else 0)
    layers_gathered = (lambda k: k * layer_c) if reshard_after_forward else (lambda k: L * layer_c)
    # Unsharded weight gradients in the compute dtype before their reduce-scatter: the root's live
    # through the whole backward (the output projection's from its start), a layer's during its own.
    layer_grad = sizes.per_layer * c * sizes.trainable / sizes.total
    output_grad = spec.vocab_size * spec.embed_dim * c if full else 0
    root_grad = sizes.root * c if full else 0

    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
    act = trace_layer(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora)
    # The loss's log-softmax (fp32), its gradient, and the gradient over the logits.
    logits = micro_batch_size * seq_len * spec.vocab_size * 12
    earlier_grads = sharded_grads if accumulation_steps > 1 else 0
    start = dict(gathered=sizes.root * c + layers_gathered(1) + output_grad, grads=earlier_grads,
                 activations=micro_batch_size * L * act.retained, logits=logits)
    end = dict(gathered=sizes.root * c + layers_gathered(2) + root_grad + layer_grad, grads=sharded_grads,
               activations=micro_batch_size * (act.retained + act.transient), logits=0)
    peak = max(start, end, key=lambda phase: sum(phase.values()))
    dequantized = sizes.nf4_largest * NF4_DEQUANT_BYTES
    peak["gathered"] += dequantized
    subtotal = params + optimizer + sum(peak.values())
    return MemoryBreakdown(params=int(params), grads=int(peak["grads"]), optimizer=int(optimizer),
                           gathered=int(peak["gathered"]), activations=int(peak["activations"]),
                           logits=int(peak["logits"]), overhead=int(fixed_overhead + slack * subtotal))
