"""Activation memory of one transformer layer, counted from the real model, not from a formula.

One layer of the real architecture is built on the meta device, given fake storage
(FakeTensorMode: shapes and dtypes, no memory), wrapped with the recompute policy the plan would
use, and run forward and backward under PyTorch's MemTracker at the real sequence length. Llama,
Mistral and Qwen have SwiGLU, grouped-query attention and RMSNorm, so the classic 34·s·b·h
formula does not apply; counting what autograd actually keeps does.
"""

import warnings
from dataclasses import dataclass, replace

import torch

from moai_recipes.models import ModelSpec, build_model
from moai_recipes.parallel import apply_recompute


@dataclass(frozen=True)
class LayerActivations:
    retained: int  # bytes a layer keeps from its forward for its backward, per sequence
    transient: int  # extra bytes live while one layer runs its backward (and its recompute), per sequence


_CACHE: dict[str, LayerActivations] = {}


def trace_layer(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype,
                lora: tuple | None = None) -> LayerActivations:
    """Bytes per sequence of `seq_len` tokens for one layer under `recompute`, in compute `dtype`."""
    key = repr((spec, seq_len, recompute, dtype, lora))
    if key not in _CACHE:
        _CACHE[key] = _trace(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora)
    return _CACHE[key]


def _trace(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype, lora: tuple | None) -> LayerActivations:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with torch.device("meta"):
        model = build_model(replace(spec, num_layers=1), max_seq_len=seq_len, lora=dict(lora) if lora else None)
    layer = model.layers[0]
    layer.to(dtype)
    apply_recompute(model.layers, recompute)
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dtype-mix notices of fused kernels: irrelevant to sizes
        layer.to_empty(device="cpu")
        for m in layer.modules():
            if hasattr(m, "is_cache_built"):  # RoPE: a cache of the right shape; its values do not matter here
                m.register_buffer("cache", torch.empty(m.max_seq_len, m.dim // 2, 2, dtype=dtype), persistent=False)
                m.is_cache_built = True
        x = torch.empty(1, seq_len, spec.embed_dim, dtype=dtype, requires_grad=True)
        tracker = MemTracker()
        tracker.track_external(layer, x)
        with tracker:
            start = _total(tracker.get_tracker_snapshot("current"))
            y = layer(x)
            # Includes the layer's output: the next layer keeps it as its input.
            retained = _total(tracker.get_tracker_snapshot("current")) - start
            y.backward(torch.empty_like(y))
        peak = _total(tracker.get_tracker_snapshot("peak"))
    params = sum(p.numel() * p.element_size() for p in layer.parameters())
    grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    # What the backward needs beyond the weights, their gradients, the input and what forward kept.
    transient = max(0, peak - start - params - grads - retained)
    return LayerActivations(retained=max(0, retained), transient=transient)


def _total(snapshot: dict) -> int:
    return sum(v.get("Total", 0) for v in snapshot.values())
