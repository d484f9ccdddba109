"""Memory, FLOPs and memory traffic of one transformer layer, counted from the real model, not from a formula.

One layer of the real architecture is built on the meta device, given fake storage (FakeTensorMode:
shapes and dtypes, no memory; a small dense layer real storage, _traced_for_real), frozen as
training freezes it (LoRA), wrapped with the recompute policy the plan would use, and run forward
and backward at the real sequence length while every operator it dispatches is counted: the tensor
storages it creates (alive, and at the peak), the FLOPs of its matmuls and attention (PyTorch's own
formulas), and the bytes the other operators read and write. Llama, Mistral and Qwen have SwiGLU,
grouped-query attention and RMSNorm, so the classic 34·s·b·h formula does not apply; counting what
autograd actually keeps does, and recomputation shows up as the operators it runs again.

PyTorch's FlopCounterMode is not used: it decomposes the operators it has no formula for (the CPU's
flash attention, into the math path that materialises the attention matrix), which changes what
is alive (it inflated the backward's peak by a third in a layer of 256 x 512 tokens).
"""

import contextlib
import functools
import hashlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from moai_recipes.files import cache_dir
from moai_recipes.models.build import build_model
from moai_recipes.models.loss import (
    CHUNK_TOKENS,
    IGNORE_INDEX,
    head_loss_sum,
)
from moai_recipes.models.spec import ModelSpec
from moai_recipes.planner.live_storages import LiveStorages
from moai_recipes.models.recompute import apply_recompute
from moai_recipes.models.tiled_mlp import apply_tiled_mlp

_VERSION = 25  # of what a trace measures: bump to ignore older cached traces


@dataclass(frozen=True)
class LayerTrace:
    retained: int  # bytes a layer keeps from its forward for its backward (its output included), per sequence
    transient: int  # activation bytes beyond that at the peak of the layer's backward, per sequence
    grads_at_peak: int  # weight-gradient bytes alive at that peak (whatever the batch)
    flops: int  # matmul and attention FLOPs of forward, recompute and backward, per sequence
    traffic: int  # bytes read and written by the other operators (norms, activations, RoPE...), per sequence
    ops: int  # operators dispatched (each costs a launch, whatever its size), per micro-batch
    attention_flops: int = 0  # the share of `flops` in attention kernels (the CPU's run at fp32 speed in bf16)
    attention_square: int = 0  # those kernels' formulas over the whole square of scores (a causal one not halved)
    # The forward peak, its input included, of a layer no gradient reaches (LoRA's before the first adapter), per
    # sequence: it holds its temporaries while nothing is kept yet (a Gated DeltaNet's chunks: its step's peak).
    unlearned_forward: int = 0
    # Bytes per micro-batch beyond those per sequence, whatever its rows: LoRA's stacked experts compute with their
    # weights merged with the adapters (models/transformers_model._adapt_experts), a copy kept for the backward
    # and its gradient made there.
    retained_fixed: int = 0
    transient_fixed: int = 0

    def kept(self, rows: float) -> float:
        """What the layer keeps for its backward on a micro-batch of `rows` sequences."""
        return rows * self.retained + self.retained_fixed

    def backward_transient(self, rows: float) -> float:
        return rows * self.transient + self.transient_fixed


@dataclass(frozen=True)
class HeadTrace:
    """The final norm, the output projection and the loss on one micro-batch (not per sequence: a
    chunked loss holds one chunk whatever the batch)."""

    peak: int  # activation bytes at their peak beyond the hidden states, forward to end of backward
    flops: int
    traffic: int
    ops: int


_CACHE: dict[tuple, object] = {}
_ASKED: dict[tuple, object] = {}  # trace_layer and trace_head by their arguments
_HEAD_MODELS: dict[tuple, torch.nn.Module] = {}  # _trace_head's, on meta
_LAYER_MODELS: dict[tuple, torch.nn.Module] = {}  # _trace's of transformers' modules, on meta (_lent_model)


# A tiled MLP's tiles at the fewest (models/tiled_mlp.mlp_tiles).
FEWEST_TILES = 8


@dataclass(frozen=True)
class RowForm:
    """How a row runs through a layer beside its length. `per_document`: the row is packed documents whose attention
    runs one document at a time (the CPU's packed rows, models/attention.py), traced on two: each document's
    attention output is kept, and so is the row they are concatenated into. `tiles`: the MLP computed in that many
    tiles of the sequence (models/tiled_mlp.py; a run's row cut into as many tiles holds its share of the bytes)."""

    per_document: bool = False
    tiles: int = 0

    @staticmethod
    @functools.cache  # a search asks for one per candidate: a frozen dataclass is slow to make
    def of(per_document: bool = False, tiles: int = 0) -> "RowForm":
        return RowForm(per_document=per_document, tiles=tiles)


def trace_layer(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype,
                lora: tuple | None = None, form: RowForm = RowForm()) -> LayerTrace:
    """Bytes and FLOPs per sequence of `seq_len` tokens for one layer under `recompute`, in `dtype`, its row in
    `form`."""
    # A search asks for the same few traces for each of its candidates (70B on 48xlarge: 180,000 times): answered
    # from a dictionary keyed by the arguments as they come, before any key of the disk cache is built.
    asked = (spec.key, seq_len, recompute, dtype, lora, form)
    found = _ASKED.get(asked)
    if found is None:
        found = _ASKED[asked] = _trace_layer(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora,
                                             form=form)
    return found


def _trace_layer(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype, lora: tuple | None,
                 form: RowForm) -> LayerTrace:
    def traced(k: int) -> LayerTrace:
        key = ((spec, seq_len, recompute, dtype, lora) + (("per_document",) if form.per_document else ())
               + ((("tiles", k),) if k else ()))
        return _cached(LayerTrace, key, lambda: _trace(spec, seq_len=seq_len, recompute=recompute, dtype=dtype,
                                                       lora=lora, form=replace(form, tiles=k)))

    if form.tiles <= FEWEST_TILES:
        return traced(form.tiles)
    # A long row's hundreds of tiles are not traced each (every micro-batch of a longest-row search has its own
    # count): more tiles than FEWEST_TILES hold no more than that many (attention's share of the peak has taken
    # over there: traced flat to within 1% at 16K to 64K tokens of Llama-3-8B and SmolLM2-135M), and each tile
    # adds its operators (a tile's MLP is a dozen of them), not its traffic (the same tokens).
    whole, tiled = traced(0), traced(FEWEST_TILES)
    return replace(tiled, ops=tiled.ops + (form.tiles - FEWEST_TILES) * max(0, tiled.ops - whole.ops) // FEWEST_TILES)


@dataclass(frozen=True)
class ImageTrace:
    """An image-text model's vision tower and projector on one sample's images (planner/plan.ImageLoad.example)."""

    retained: int  # bytes kept from the forward for the backward (the features handed to the language model too)
    flops: int  # matmul and attention FLOPs of forward and backward
    inputs: int = 0  # bytes of the image inputs themselves (pixel values), alive for the step
    ops: int = 0  # operators dispatched (each costs a launch), per micro-batch
    tokens: int = 0  # the features handed to the language model: the image tokens of the sample's row


def trace_images(spec: ModelSpec, example: tuple, *, dtype: torch.dtype, lora: tuple | None = None) -> ImageTrace:
    """The vision tower and projector, forward and backward, on the image inputs `example` (ImageLoad.example), in
    `dtype`, frozen as LoRA freezes them (then nothing is kept for a backward)."""
    return _cached(ImageTrace, ("images", spec, example, dtype, lora),
                   lambda: _trace_images(spec, example, dtype=dtype, lora=lora))


def _trace_images(spec: ModelSpec, example: tuple, *, dtype: torch.dtype, lora: tuple | None) -> ImageTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moai_recipes.models.lora import freeze_base

    with torch.device("meta"):
        model = build_model(spec, max_seq_len=8, lora=dict(lora) if lora else None)
    model.to(dtype)
    if lora:
        freeze_base(model)
    _transformers_formulas()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        _on_storage(model, dtype=dtype)
        pixels = {name: torch.empty(shape, dtype=dtype) for name, shape, kind, values in example if values is None}
    # Integer inputs (Qwen's grid of patches per image) are real, and so is what the tower computes from them (its
    # positions, its windows): the mode is not entered, the fake weights and pixels bring it to the ops they are in.
    inputs = {name: pixels[name] if values is None else torch.tensor(values, dtype=getattr(torch, kind)).reshape(shape)
              for name, shape, kind, values in example}
    count = OpCounter(existing=[*model.parameters(), *model.buffers(), *inputs.values()])
    trains = any(p.requires_grad for p in model.image_parameters())
    with warnings.catch_warnings(), count, torch.set_grad_enabled(trains):
        warnings.simplefilter("ignore")
        features = model.image_features(inputs)
        retained = count.storages.current if trains else 0
        if trains:
            torch.autograd.backward(features, [torch.empty_like(f) for f in features])
    return ImageTrace(retained=retained, flops=count.flops, inputs=_nbytes(inputs.values()), ops=count.ops,
                      tokens=_image_tokens(features, spec.embed_dim))


def _image_tokens(features: list[torch.Tensor], width: int) -> int:
    """The image tokens of a row: the features as wide as the language model (the projector's output; Qwen3-VL's deep
    stack adds more of the same count, the tower's own are narrower and unmerged)."""
    handed = [f for f in features if f.shape[-1] == width] or features
    return handed[0].numel() // handed[0].shape[-1]


# Rows longer than this are extrapolated by trace_head rather than traced whole (8K: Llama 3's rows are traced).
LONG_ROW = 8 * CHUNK_TOKENS


def trace_head(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, chunked: bool, dtype: torch.dtype,
               lora: tuple | None = None) -> HeadTrace:
    """Bytes, FLOPs and traffic of the final norm, the output projection and the loss (chunked or not),
    forward and backward, on a micro-batch.

    Each is linear in the micro-batch size: the plain loss's from the first sequence, the chunked loss's
    (a chunk's worth whatever the batch, plus the hidden states and their gradient) once two chunks
    run. So larger micro-batches are extrapolated from two traced ones (exactly for the plain loss,
    within a partial chunk's traffic for the chunked one): a chunked trace of 64 x 8K tokens would run
    512 chunks.
    """
    asked = ("head", spec.key, micro_batch_size, seq_len, chunked, dtype, lora)  # as trace_layer's
    found = _ASKED.get(asked)
    if found is None:
        found = _ASKED[asked] = _head_estimate(spec, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                               chunked=chunked, dtype=dtype, lora=lora)
    return found


def _head_estimate(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, chunked: bool, dtype: torch.dtype,
                   lora: tuple | None) -> HeadTrace:
    def traced(sequences: int, length: int = seq_len) -> HeadTrace:
        # The head sees a micro-batch's tokens flattened (the norm, the output projection and the loss, chunked over
        # the flattened tokens): what it holds, computes and moves depends on their number alone (2 x 2048 tokens of
        # Llama-3-70B trace as 1 x 4096, every field, chunked or not). So one row of as many tokens is traced, and
        # a search's micro-batches of the same tokens (1 x 1024 and 2 x 512, ...) share it: 30 head traces -> 19
        # in a cold dry run of Llama-3-70B on 48xlarge.
        tokens = sequences * length
        return _cached(HeadTrace, ("head", spec, tokens, chunked, dtype, lora),
                       lambda: _trace_head(spec, micro_batch_size=1, seq_len=tokens, chunked=chunked, dtype=dtype,
                                           lora=lora))

    if chunked and seq_len > LONG_ROW:
        # A row of more than LONG_ROW tokens would trace thousands of chunks (max_seq_len=10000000 took minutes):
        # the chunked head is linear in tokens, so it is extrapolated from rows of LONG_ROW tokens and of one chunk
        # more, as micro-batches are below.
        lo, hi = traced(1, LONG_ROW), traced(1, LONG_ROW + CHUNK_TOKENS)
        tokens = micro_batch_size * seq_len
        est = _extrapolated(lo, hi, steps=CHUNK_TOKENS, more=tokens - LONG_ROW - CHUNK_TOKENS)
        # The peak's share of a chunk's logits fades as rows grow: past about 2 x LONG_ROW tokens it is the hidden
        # states and their gradient, whole (traced: exactly, at 16K and 32K tokens).
        return replace(est, peak=max(est.peak, 2 * tokens * spec.embed_dim * dtype.itemsize))

    # Two micro-batches to extrapolate from: for the chunked loss, ones that run whole chunks, two of
    # them at least (each chunk also adds the output projection's gradient to its sum, so a partial
    # chunk moves nearly a whole one's bytes; between whole chunks the estimate is a little low).
    a, b = 1, 2
    if chunked and CHUNK_TOKENS % seq_len == 0:
        a, b = 2 * CHUNK_TOKENS // seq_len, 3 * CHUNK_TOKENS // seq_len
    elif chunked and seq_len % CHUNK_TOKENS:
        a = math.ceil(2 * CHUNK_TOKENS / seq_len)
        b = a + 1
    if micro_batch_size <= b:
        return traced(micro_batch_size)
    return _extrapolated(traced(a), traced(b), steps=b - a, more=micro_batch_size - b)


@dataclass(frozen=True)
class TracedFlops:
    """A model's FLOPs as its traces count them (transformers' modules, for which no formula is written): per token
    of its matmuls and per (query, key) pair of its attention's whole square, forward and backward, over the layers
    and the head; and one forward of the layers' (what full recomputation does again)."""

    per_token: float
    per_pair: float
    layer_forward: float
    pair_forward: float


# Rows the FLOPs are traced on: each layer's count is a x n + b x n^2 (matmuls and attention), two rows give a and b;
# whole chunks of the linear attentions that pad rows to 64 tokens (Gated DeltaNet's).
FLOP_ROWS = (64, 128)
# A flash kernel's attention in units of one (query, key) product over a head's dimensions: its forward computes the
# scores and the weighted sum (4), its backward recomputes the scores beside the four products the math takes (10):
# PyTorch's formulas count 14 where the model's work (the math kernel's) is 12, and 4 for a forward.
FLASH_UNITS, MODEL_UNITS, FORWARD_UNITS = 14, 12, 4


def traced_flops(spec: ModelSpec, lora: tuple | None = None) -> TracedFlops:
    """The FLOPs of a model of transformers' modules, counted on its layers of each kind and its head traced on two
    rows (FLOP_ROWS): as FlopCounterMode counts the model computed with the math kernel of attention (its whole
    square of scores, four products forward and eight backward)."""
    def traced() -> TracedFlops:
        terms = {}
        for recompute in ("none", "full"):
            counted = []
            for n in FLOP_ROWS:
                t = trace_layer(spec, seq_len=n, recompute=recompute, dtype=torch.float32, lora=lora)
                flash = t.attention_square
                passes = MODEL_UNITS + (FORWARD_UNITS if recompute == "full" else 0)
                units = flash / (FLASH_UNITS + (FORWARD_UNITS if recompute == "full" else 0))
                counted.append((t.flops - t.attention_flops + units * passes) * spec.num_layers)
            (n1, n2), (f1, f2) = FLOP_ROWS, counted
            b = (f2 / n2 - f1 / n1) / (n2 - n1)
            terms[recompute] = (f1 / n1 - b * n1, b)
        head = trace_head(spec, micro_batch_size=1, seq_len=FLOP_ROWS[0], chunked=False, dtype=torch.float32,
                          lora=lora).flops / FLOP_ROWS[0]
        (a, b), (a_full, b_full) = terms["none"], terms["full"]
        return TracedFlops(per_token=a + head, per_pair=b, layer_forward=a_full - a, pair_forward=b_full - b)

    return _cached(TracedFlops, ("flops", spec, lora, FLOP_ROWS), traced)


def _extrapolated(lo: HeadTrace, hi: HeadTrace, *, steps: int, more: int) -> HeadTrace:
    """`hi` and `more` units beyond it, each unit costing (hi - lo) / steps."""
    per = lambda f: (f(hi) - f(lo)) / steps
    return HeadTrace(peak=int(hi.peak + more * per(lambda t: t.peak)), flops=int(hi.flops + more * per(lambda t: t.flops)),
                     traffic=int(hi.traffic + more * per(lambda t: t.traffic)), ops=int(hi.ops + more * per(lambda t: t.ops)))


def _cached(cls, key_parts: tuple, trace):
    """A trace takes a fraction of a second (thousands of dispatched fake ops) after torchtune's import;
    it is kept in memory and on disk, keyed by everything it depends on, so that planning a model
    again is instant."""
    parts = tuple(k.key if isinstance(k, ModelSpec) else k for k in key_parts)
    found = _CACHE.get(parts)  # in memory by the parts themselves: hashed, never written out (1.3 s of a search)
    if found is None:
        key = repr((_VERSION, *parts, torch.__version__, _torchtune_version()))
        path = _cache_folder() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        try:
            found = cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            found = trace()
            _store(path, asdict(found))
        _CACHE[parts] = found
    return found


def _cache_folder() -> Path:
    return cache_dir() / "layer-traces"


@functools.cache  # importlib.metadata scans the installed distributions: milliseconds, and planning asks often
def _torchtune_version() -> str:
    from importlib.metadata import version

    return version("torchtune")


def _store(path: Path, value: dict) -> None:
    try:  # a cache: a read-only home only costs the trace next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass


def _is_causal(args, kwargs) -> bool:
    return kwargs.get("is_causal", args[1] if len(args) > 1 and isinstance(args[1], bool) else False)


def _causal(flops: int, is_causal: bool, queries: int, keys: int) -> int:
    """A causal kernel computes the blocks on and below the diagonal only (flash attention on GPUs and this CPU alike
    skips the rest): (keys + 1) / 2 of each query's keys where queries and keys are the same row. PyTorch's formulas
    count every pair."""
    return flops * (keys + 1) // (2 * keys) if is_causal and queries == keys else flops


def _query_heads(query, x) -> tuple:
    """`x`'s shape with the query's heads: grouped-query attention computes each query head against its group's key
    and value head, as many products as with them repeated (torch 2.13's formulas count them so; 2.11's refuse
    fewer key/value heads)."""
    return (*x.shape[:-3], query.shape[-3], *x.shape[-2:])


def _sdpa_square(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU's flash attention over the whole square of scores (as PyTorch's formula counts any SDPA)."""
    return sdpa_flop_count(query.shape, _query_heads(query, key), _query_heads(query, value))


def _sdpa_backward_square(grad_out, query, key, value, out, logsumexp, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, _query_heads(query, key), _query_heads(query, value))


def _sdpa_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU's flash attention and the GPUs' (flash, efficient, cuDNN): (query, key, value, ..., is_causal, ...)."""
    return _causal(_sdpa_square(query, key, value), _is_causal(args, kwargs), query.shape[-2], key.shape[-2])


def _sdpa_backward_flops(grad_out, query, key, value, out, logsumexp, *args, out_val=None, **kwargs) -> int:
    flops = _sdpa_backward_square(grad_out, query, key, value, out, logsumexp)
    return _causal(flops, _is_causal(args, kwargs), query.shape[-2], key.shape[-2])


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """A grouped product (models/moe.py's experts): each row of a [rows, k] times its group's [k, n] of b [groups, k,
    n]; or, for the weights' gradient, a [k, rows] times b [rows, n], each group's rows summed into its own [k, n]."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * math.prod(out_val.shape) * a.shape[-1]  # batched: every group's whole product


def _grouped_loop_flops(input, weight, offs, *args, out_val=None, **kwargs) -> int:
    """transformers' loop over the experts (transformers::grouped_mm_fallback): each row of input [rows, in] times its
    expert's [in, out] of weight [experts, in, out]."""
    return 2 * input.shape[0] * input.shape[1] * weight.shape[2]


def _grouped_loop_backward_flops(input, weight, offs, grad_output, *args, out_val=None, **kwargs) -> int:
    return 2 * _grouped_loop_flops(input, weight, offs)  # the input's gradient and the weight's


# PyTorch's formulas, and those it has none for: the CPU's flash attention (counted as the GPU kernels are, a causal
# one's half), the experts' grouped product (ours and transformers' loop).
_FLOP_FORMULAS = {**flop_registry,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
                  torch.ops.aten._grouped_mm: _grouped_mm_flops}


# The attention kernels' formulas over the whole square, where the counted one halves a causal kernel's.
_SQUARE = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_square,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_square}


def _transformers_formulas() -> None:
    """transformers' operators, once it is imported (a model of its modules is being traced)."""
    ops = getattr(torch.ops, "transformers", None)
    # Each where the installed transformers has it (5.17 has the loop, not yet its backward as an operator).
    for name, formula in (("grouped_mm_fallback", _grouped_loop_flops),
                          ("grouped_mm_fallback_backward", _grouped_loop_backward_flops)):
        if ops is not None and hasattr(ops, name):
            _FLOP_FORMULAS[getattr(ops, name)] = formula


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _tensors_in(value, found: list) -> list:
    """The tensors in an operator's arguments or result (tensors, lists, tuples and dicts of them, other values): what
    torch's pytree gives for these. A trace flattens each of its thousands of operators, and pytree took a quarter of
    a tiny layer's real trace: 36 such traces took 0.63 s instead of 1.15 s without it, 125 traces of five models
    (most fake) 38 s instead of 43 s, every number the same (2026-11-29)."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, found)
    return found


# A fake tensor's device is asked through the dispatcher (autograd's and the kernels' own queries): 497 of the 715
# operators a tiny Llama layer dispatched under FakeTensorMode, 2.5-3.3x the operators of every architecture traced,
# and none of them a kernel a run launches (on real tensors they are never dispatched). Not counted.
_DEVICE_QUERY = torch.ops.prim.device.default


class OpCounter(TorchDispatchMode):
    """What the operators dispatched under it cost.

    Memory (`storages`, the ledger a run's measurement keeps too: planner/live_storages.py): bytes of the
    tensor storages they create that are still alive, the peak, and what was alive at the peak (views
    share their base's storage, so each storage counts once, and views of `existing` tensors, weights
    and inputs, count not at all). Compute: FLOPs of matmuls and attention. Traffic: bytes read and written by every other operator that moves data (views
    move none); on any device those run at memory speed.
    """

    def __init__(self, existing=()):
        super().__init__()
        self.flops = self.attention_flops = self.attention_square = self.traffic = self.ops = 0
        self.storages = LiveStorages(ignore=[t.untyped_storage() for t in existing], remember_peak=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _DEVICE_QUERY:
            return out
        self.ops += 1
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        outputs = _tensors_in(out, [])
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.flops += flops
            if "attention" in func._overloadpacket.__name__:
                self.attention_flops += flops
                self.attention_square += _SQUARE.get(func._overloadpacket, formula)(*args, **kwargs, out_val=out)
        elif self._moves_data(func, inputs := _tensors_in(kwargs, _tensors_in(args, [])), outputs):
            self.traffic += _nbytes(inputs) + _nbytes(outputs)
        for t in outputs:
            self.storages.add(t.untyped_storage())
        return out

    @staticmethod
    def _moves_data(func, inputs: list, outputs: list) -> bool:
        """Writes memory: an in-place op, or one whose output is new storage (not a view, a reshape of
        its input, or a metadata query that returns no tensor)."""
        if func._schema.is_mutable:
            return True
        if func.is_view:
            return False
        read = {id(t.untyped_storage()) for t in inputs}
        return any(id(t.untyped_storage()) not in read for t in outputs)

    def bytes_at_peak(self, tensors) -> int:
        """How many of the peak's bytes belonged to `tensors` (say, the weight gradients)."""
        alive = self.storages.alive_at_peak()
        sizes = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
        return sum(n for key, n in sizes.items() if key in alive)


def _meta_model(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype, lora: tuple | None,
                tiles: int = 0):
    """A one-layer model as training runs it, on the meta device: in `dtype`, frozen as LoRA freezes it,
    its MLP tiled and its layer recomputed as planned. A model of transformers' modules is built whole (on meta:
    nothing allocated), its layers of every kind there to be traced with what its forward gives them."""
    from moai_recipes.models.lora import freeze_base

    # The layer traced is of the kind most of the model's are: dense, or a Mixture-of-Experts layer.
    sparse = (0,) if 2 * len(spec.moe_layers) >= spec.num_layers else ()
    with torch.device("meta"):
        model = build_model(replace(spec, num_layers=1, moe_layers=sparse) if spec.native else spec,
                            max_seq_len=seq_len, lora=dict(lora) if lora else None)
    model.to(dtype)
    if lora:
        freeze_base(model)  # frozen weights get no gradient, and autograd saves less for them
    apply_tiled_mlp(model.layers, tiles)
    apply_recompute(model.layers, recompute)
    return model


def _on_storage(module, *, dtype: torch.dtype, layers: bool = True) -> None:
    """Give a meta module storage: fake under FakeTensorMode, real (uninitialised) outside it (a small layer traced
    for real, _traced_for_real). `layers=False`: all but its layers, which stay on meta (a head trace never runs
    them: a model of transformers' modules is built whole, and its layers' storage was 30% of such a trace's time)."""
    from moai_recipes.models.build import init_buffers

    if layers:
        _to_empty(module)
    else:
        for m in _parts(module).outside:
            _to_empty(m, recurse=False)
    if hasattr(module, "_initial_buffers"):  # transformers' modules: their rotary tables (real), the output tied
        init_buffers(module, device="cpu")
    for m in _parts(module).ropes:
        if hasattr(m, "is_cache_built"):  # RoPE: a cache of the right shape; its values do not matter here
            m.register_buffer("cache", torch.empty(m.max_seq_len, m.dim // 2, 2, dtype=dtype), persistent=False)
            m.is_cache_built = True


@dataclass(frozen=True)
class _Parts:
    """What a trace gives storage to in a model, found once a model: a whole model of transformers' modules has
    thousands (DeepSeek-V3's 61 layers), and walking them for each of a dry run's 73 head traces was a third of their
    time. `outside`: the modules outside its layers; `ropes`: the RoPE modules (torchtune's; a cache each);
    `touched`: every module whose parameters or buffers a head trace replaces (those, and the owners of the buffers
    transformers' modules get back: models/build.init_buffers); `every`: all of them (a layer trace's, _lent_model)."""

    outside: tuple
    ropes: tuple
    touched: tuple
    every: tuple


def _parts(model) -> _Parts:
    found = model.__dict__.get("_trace_parts")
    if found is None:
        inside = {id(m) for m in model.layers.modules()} if hasattr(model, "layers") else set()
        outside = tuple(m for m in model.modules() if id(m) not in inside)
        ropes = tuple(m for m in model.modules() if hasattr(m, "is_cache_built") or hasattr(m, "rope_init"))
        owners = tuple(model.get_submodule(name.rpartition(".")[0]) for name in getattr(model, "_initial_buffers", {}))
        touched = tuple({id(m): m for m in (*outside, *ropes, *owners)}.values())
        found = model.__dict__["_trace_parts"] = _Parts(outside=outside, ropes=ropes, touched=touched,
                                                        every=tuple(model.modules()))
    return found


def _to_empty(module, *, recurse: bool = True) -> None:
    """What nn.Module.to_empty(device="cpu") does, whatever the module's class says: torchtune's LoRALinear.to_empty
    gives storage to its adapters alone, not to its own weight."""
    module._apply(lambda t: torch.empty_like(t, device="cpu"), recurse=recurse)


# A small dense layer is traced on real tensors (uninitialised memory): FakeTensorMode dispatches each operator in
# Python at about half a millisecond, more than the CPU takes to compute a layer of a few million FLOPs (a tiny Llama
# layer, warm: 70 ms a trace fake, 18 ms real; 1,296 traces of nine dense test models of transformers' modules, four
# of them image-text: 412 s fake, 99 s real). What it keeps, its peaks and FLOPs are the same; on our layers the
# operators and traffic too (tests/test_planner.py; 1,512 traces of six models, 2 to 512 tokens), on transformers'
# modules within 2% and 3.5% (tests/test_architectures.py; 2,025 traces, 2 to 512 tokens): for fake tensors
# transformers builds a sliding window's mask by another path (masking_utils.is_tracing), and the real one is what
# training runs. Not a layer of our own Mixture-of-Experts (on fake tensors one product of the same shapes stands in
# for its grouped product, models/moe._grouped, where the CPU's real one keeps other bytes), nor a row of one token (a
# matmul the real kernel folds into one mm is two bmm on fake strides). transformers' experts are: its experts
# interface sorts a layer's tokens by expert and hands them to one grouped operator, and Llama 4's multiplies every
# expert's rows in one bmm, shapes fixed by the token count whatever the routing, so a trace on uninitialised weights
# keeps and computes what the fake one does (tests/test_architectures.py: Qwen3.5-MoE, gpt-oss, DeepSeek-V3, GLM-4.5
# and Llama 4, 5.6x faster: 14.5 s fake against 2.6 s real for 20 traces, 2026-11-29). The budget, in FLOPs of a
# trace's forward and backward, is sized for the slowest CPU we meet: fp32 at about 50 GFLOP/s a thread on an
# AVX2-only one (1e9: 20 ms; the demo's tiny model at 512 tokens is 0.97e9), bf16 emulated there at about 1 GFLOP/s
# (5e7). Another dtype is traced fake.
REAL_TRACE_FLOPS = {torch.float32: 1e9, torch.bfloat16: 5e7}


def _traced_for_real(spec: ModelSpec, seq_len: int, dtype: torch.dtype) -> bool:
    # Our own model is traced on one layer, dense unless most are experts (_meta_model: then fake); transformers'
    # modules on a layer of each kind.
    ours_sparse = spec.native and 2 * len(spec.moe_layers) >= spec.num_layers
    sizes = (spec.embed_dim, spec.num_heads, spec.head_dim, spec.num_kv_heads, spec.intermediate_dim)
    if ours_sparse or seq_len < 2 or not all(sizes):  # a config that names no width of its own: by no formula
        return False
    d, q, kv = spec.embed_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    # A token's routed experts beside the dense MLP (Llama 4 runs its rows through every expert: a bound of tiny size).
    experts = spec.num_experts if spec.moe_layers else 0
    weights = 2 * d * q + 2 * d * kv + 3 * d * (spec.intermediate_dim + experts * spec.expert_dim)
    return _within_budget(6 * seq_len * weights + 12 * seq_len * seq_len * q, dtype)


def _within_budget(flops: float, dtype: torch.dtype) -> bool:
    """Whether a trace of `flops` (forward and backward) in `dtype` runs on real tensors (REAL_TRACE_FLOPS)."""
    return flops <= REAL_TRACE_FLOPS.get(dtype, -1)


@contextlib.contextmanager
def _tensors(real: bool):
    """Where a trace runs: on real tensors, or on fake ones (FakeTensorMode) unless `real`; the dtype-mix notices of
    fused kernels silenced (irrelevant to sizes). Yields its ExitStack, for what a trace enters besides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not real:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield stack


def _trace(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype, lora: tuple | None,
           form: RowForm) -> LayerTrace:
    from moai_recipes.models.attention import Documents, use_document_attention

    docs = Documents((seq_len // 2, seq_len - seq_len // 2)) if form.per_document and seq_len > 1 else None
    if spec.native:  # one layer: built for each trace (milliseconds)
        model = _meta_model(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora, tiles=form.tiles)
        if docs:
            use_document_attention(model.layers[0])
        return _trace_model(model, spec, seq_len=seq_len, dtype=dtype, lora=lora, docs=docs)
    with _lent_model(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora, tiles=form.tiles) as model:
        return _trace_model(model, spec, seq_len=seq_len, dtype=dtype, lora=lora, docs=docs)


@contextlib.contextmanager
def _lent_model(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype, lora: tuple | None, tiles: int):
    """_meta_model's whole model of transformers' modules, built once for a model, dtype and adapters and lent to one
    trace at a time: recomputed and tiled as the trace asks, and every table of tensors and patched forward a trace
    changes put back after it (building DeepSeek-V3's 61 layers on meta took 0.2 s, and a dry run traces its layers
    14 times). The length shapes only a native layer's rotary table, as _trace_head's models."""
    key = (spec.key, dtype, lora)
    model = _LAYER_MODELS.get(key)
    if model is None:
        model = _LAYER_MODELS[key] = _meta_model(spec, seq_len=seq_len, recompute="none", dtype=dtype, lora=lora)
    try:
        with _put_back(_parts(model).every):
            apply_tiled_mlp(model.layers, tiles)
            apply_recompute(model.layers, recompute)
            yield model
    finally:
        model.__dict__.pop("_layers_stored", None)  # _with_storage's: the layers are on meta again


@contextlib.contextmanager
def _put_back(modules):
    """Each of `modules` as it was before the block: its parameters and buffers (a trace gives them storage) and its
    forward (recomputation and tiling patch it), whatever the block did to them."""
    kept = [(m, dict(m._parameters), dict(m._buffers), m.__dict__.get("forward")) for m in modules]
    try:
        yield
    finally:
        for m, parameters, buffers, forward in kept:
            m.__dict__["_parameters"], m.__dict__["_buffers"] = parameters, buffers
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = forward


def _trace_model(model, spec: ModelSpec, *, seq_len: int, dtype: torch.dtype, lora: tuple | None,
                 docs) -> LayerTrace:
    """_trace's layer (native: the one layer of `model`) or mean layer of every kind (transformers' modules), traced
    on rows of `seq_len` tokens (`docs`: packed documents)."""
    if spec.native:
        layer = model.layers[0]
    with _tensors(_traced_for_real(spec, seq_len, dtype)) as stack:
        if spec.native:
            _on_storage(layer, dtype=dtype)
            position = docs.positions(torch.device("cpu")) if docs else None
            return _trace_call(layer, (), dict(mask=docs, input_pos=position) if docs else {},
                               seq_len=seq_len, embed_dim=spec.embed_dim, dtype=dtype)
        # transformers' modules: each kind of layer traced with what the model's forward gives it, the model's
        # mean layer made of them (its peak: the kind whose backward holds the most).
        from moai_recipes.models.transformers_model import masks_as_asked

        _transformers_formulas()
        stack.enter_context(masks_as_asked())
        _on_storage(model, dtype=dtype, layers=False)  # each layer once a call runs it (_layer_call)
        kinds = spec.parts.kinds
        # Under LoRA (the embeddings frozen) the gradient starts at the first adapter: the layers before it run
        # forward alone and keep nothing (a hybrid model's Gated DeltaNet layers, adapters on its attention only),
        # and that layer keeps nothing of what comes before its own first adapter.
        first = next((i for i, layer in enumerate(model.layers)
                      if any(p.requires_grad for p in layer.parameters())), len(kinds)) if lora else -1
        reach = ["none" if i < first else "within" if i == first else "through" for i in range(len(kinds))]
        traces = []
        for kind, gradient in dict.fromkeys(zip(kinds, reach)):
            index = first if gradient == "within" else spec.parts.representative(kind)
            args, kwargs = _layer_call(model, spec, index, seq_len=seq_len, documents=docs, dtype=dtype, lora=lora)
            layer = model.layers[index]
            trace = _trace_call(layer, args[1:], kwargs, seq_len=seq_len, embed_dim=spec.embed_dim, dtype=dtype,
                                gradient=gradient)
            if lora and gradient != "none" and any(p.requires_grad and p.dim() > 2 for p in layer.parameters()):
                trace = _per_micro_batch(model, spec, index, trace, seq_len=seq_len, dtype=dtype, lora=lora,
                                         gradient=gradient)
            if gradient == "within" and first < len(kinds) - 1:
                # Its backward comes last, the later layers' activations gone: not the transient the peak's phases
                # add to every layer's (planner/memory.py). Traced, it is larger than theirs: 3.6x the same Qwen3.5-MoE
                # layer's reached through its input, with adapters on its experts.
                trace = replace(trace, transient=0, transient_fixed=0)
            traces.append((list(zip(kinds, reach)).count((kind, gradient)), trace))
    return _mean_layer(traces)


def _per_micro_batch(model, spec: ModelSpec, index: int, trace: LayerTrace, *, seq_len: int, dtype: torch.dtype,
                     lora: tuple, gradient: str) -> LayerTrace:
    """`trace` (of one sequence) with the bytes a layer holds once per micro-batch whatever its rows told apart
    (adapted stacked experts: their merged weights), from the layer traced again on one row and on two."""
    embed_dim = spec.embed_dim
    one, two = ((_layer_call(model, spec, index, seq_len=seq_len, documents=None, dtype=dtype, lora=lora,
                            rows=rows), rows)
                for rows in (1, 2))
    one, two = (_trace_call(model.layers[index], args[1:], kwargs, seq_len=seq_len, embed_dim=embed_dim,
                            dtype=dtype, rows=rows, gradient=gradient) for (args, kwargs), rows in (one, two))
    retained = max(0, 2 * one.retained - two.retained)
    transient = max(0, 2 * one.transient - two.transient)
    return replace(trace, retained=max(0, trace.retained - retained), transient=max(0, trace.transient - transient),
                   retained_fixed=retained, transient_fixed=transient)


# transformers_model.layer_call's (args, kwargs), by what they depend on: captured once for every recomputation and
# tiling of a layer on the same rows (they change neither), then given to each later trace as new tensors of the same
# shapes (fake ones in its own FakeTensorMode). The model's forward up to the layer was a third of such a trace's time.
_CALLS: dict[tuple, tuple] = {}


def _layer_call(model, spec: ModelSpec, index: int, *, seq_len: int, documents, dtype: torch.dtype,
                lora: tuple | None, rows: int = 1) -> tuple:
    """What layer `index` of a model of transformers' modules (in `dtype`) is called with on `rows` rows of `seq_len`
    tokens (one of packed `documents`, if given); call under the trace's FakeTensorMode."""
    from moai_recipes.models.transformers_model import layer_call

    key = (spec.key, dtype, lora, index, seq_len, documents is not None, rows)
    kept = _CALLS.get(key)
    if kept is not None:
        _with_storage(model, [index])
        return _restaged(kept)
    _with_storage(model, range(index + 1))  # the forward up to the layer runs those before it
    args, kwargs = layer_call(model, index, tokens=seq_len, documents=documents, rows=rows)
    _CALLS[key] = _restaged((args, kwargs))  # a copy: the layer may write into what it is given (Gemma 4's shared KV)
    return args, kwargs


def _with_storage(model, indices) -> None:
    """Fake storage for these layers of a model of transformers' modules whose others stay on meta: a trace runs the
    layers before the one it traces only to capture what that one is called with, and never those after it (a real
    model's 40 to 90 layers given storage were most of a trace's set-up)."""
    from moai_recipes.models.build import init_buffers

    stored = model.__dict__.setdefault("_layers_stored", set())
    new = [i for i in indices if i not in stored]
    for i in new:
        _to_empty(model.layers[i])
    if new:
        init_buffers(model, device="cpu")  # their buffers as built (to_empty left them empty)
        stored.update(new)


def _restaged(value):
    """`value` with each fake tensor in it, and each real one that needs a gradient, a new one of the same shape,
    strides, dtype and need of a gradient (fake in the active FakeTensorMode, else real and uninitialised: a leaf given
    to two traces would gather a .grad the second counts as an addition); other real tensors (positions, masks) and
    anything else as they are."""
    from torch._subclasses.fake_tensor import FakeTensor

    from moai_recipes.models.transformers_model import map_tensors

    def restaged(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, FakeTensor) and not t.requires_grad:
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)

    return map_tensors(value, restaged)


def _trace_call(layer, args: tuple, kwargs: dict, *, seq_len: int, embed_dim: int, dtype: torch.dtype,
                gradient: str = "through", rows: int = 1) -> LayerTrace:
    """One layer's forward and backward on `rows` rows of `seq_len` tokens (under FakeTensorMode, or on real
    tensors), `args` and `kwargs` after its hidden states. `gradient`: "through" the layer to its input, starting
    "within" it (its input needs none), or "none" reaching it (its forward alone)."""
    backward = gradient != "none"
    x = torch.empty(rows, seq_len, embed_dim, dtype=dtype, requires_grad=gradient == "through")
    grad_out = torch.empty_like(x)  # the gradient the next layer hands back: not this layer's memory
    given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    count = OpCounter(existing=[*layer.parameters(), *layer.buffers(), x, grad_out, *given])
    with count, torch.set_grad_enabled(backward):
        y = layer(x, *args, **kwargs)
        y = y[0] if isinstance(y, tuple) else y
        retained = count.storages.current
        if backward:
            y.backward(grad_out)
    if not backward:  # it keeps nothing, and no backward of it adds to the step's peak
        return LayerTrace(retained=0, transient=0, grads_at_peak=0, flops=count.flops, traffic=count.traffic,
                          ops=count.ops, attention_flops=count.attention_flops,
                          attention_square=count.attention_square,
                          unlearned_forward=count.storages.peak + x.untyped_storage().nbytes())
    grads_at_peak = count.bytes_at_peak([p.grad for p in layer.parameters() if p.grad is not None])
    return LayerTrace(retained=retained, transient=max(0, count.storages.peak - retained - grads_at_peak),
                      grads_at_peak=grads_at_peak, flops=count.flops, traffic=count.traffic, ops=count.ops,
                      attention_flops=count.attention_flops, attention_square=count.attention_square)


def _mean_layer(traces: list[tuple[int, LayerTrace]]) -> LayerTrace:
    """The mean of layers of several kinds (`count` of each): what they keep, compute and move on average; the
    transient peak of the kind whose backward reaches highest."""
    layers = sum(n for n, _ in traces)
    mean = lambda f: round(sum(n * f(t) for n, t in traces) / layers)  # noqa: E731
    peak = max((t for _, t in traces), key=lambda t: t.transient + t.grads_at_peak)
    return LayerTrace(retained=mean(lambda t: t.retained), transient=peak.transient, grads_at_peak=peak.grads_at_peak,
                      flops=mean(lambda t: t.flops), traffic=mean(lambda t: t.traffic), ops=mean(lambda t: t.ops),
                      attention_flops=mean(lambda t: t.attention_flops),
                      attention_square=mean(lambda t: t.attention_square),
                      unlearned_forward=max(t.unlearned_forward for _, t in traces),
                      retained_fixed=mean(lambda t: t.retained_fixed), transient_fixed=peak.transient_fixed)


def _trace_head(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, chunked: bool, dtype: torch.dtype,
                lora: tuple | None) -> HeadTrace:
    """The decoder's last steps as loss.token_loss_sum runs them: torchtune's unembed (norm, output,
    float) and the loss, or the chunked norm, output and loss."""
    # One meta model for every head trace of the same model, dtype and adapters (a search traces the head at each
    # micro-batch and length: 135 times in a dry run of DeepSeek-V3, whose whole model of transformers' modules took
    # 0.13 s to build each time); the length shapes only a native layer's rotary table.
    key = (spec.key, seq_len if spec.native else None, dtype, lora)
    model = _HEAD_MODELS.get(key)
    if model is None:
        model = _HEAD_MODELS[key] = _meta_model(spec, seq_len=seq_len, recompute="none", dtype=dtype, lora=lora)
    # The tensors that get storage below, put back after: the model stays on meta for the next trace.
    touched = _parts(model).touched
    # A small head on real tensors, as a small layer (_traced_for_real): its output projection's forward and backward
    # within the same budget (468 heads of eight test models compared, every field equal: 11.9 s fake, 4.2 s real).
    real = _within_budget(6 * micro_batch_size * seq_len * spec.vocab_size * spec.embed_dim, dtype)
    with _put_back(touched), _tensors(real):
        _on_storage(model, dtype=dtype, layers=False)
        h = torch.empty(micro_batch_size, seq_len, spec.embed_dim, dtype=dtype, requires_grad=True)
        labels = torch.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
        # The layers' weights stay on meta, out of the trace: those of the modules given storage are all there is.
        weights = {id(t): t for m in touched for t in (*m._parameters.values(), *m._buffers.values())
                   if t is not None}
        params = [t for t in weights.values() if isinstance(t, torch.nn.Parameter)]
        count = OpCounter(existing=[*weights.values(), h, labels])
        with count:
            loss = head_loss_sum(model, h, labels, chunked=chunked)
            loss.backward()
        # The weights' gradients are the memory model's (the output projection's lives on with the root's).
        grads = count.bytes_at_peak([p.grad for p in params if p.grad is not None])
    return HeadTrace(peak=count.storages.peak - grads, flops=count.flops, traffic=count.traffic, ops=count.ops)
