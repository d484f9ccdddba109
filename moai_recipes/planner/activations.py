"""Activation memory of one transformer layer, counted from the real model, not from a formula.

One layer of the real architecture is built on the meta device, given fake storage
(FakeTensorMode: shapes and dtypes, no memory), wrapped with the recompute policy the plan would
use, and run forward and backward under PyTorch's MemTracker at the real sequence length. Llama,
Mistral and Qwen have SwiGLU, grouped-query attention and RMSNorm, so the classic 34·s·b·h
formula does not apply; counting what autograd actually keeps does.
"""

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moai_recipes.models import ModelSpec, build_model
from moai_recipes.parallel import apply_recompute


@dataclass(frozen=True)
class LayerTrace:
    retained: int  # bytes a layer keeps from its forward for its backward (its output included), per sequence
    transient: int  # bytes beyond that while the layer runs its backward (recompute, activation grads), per sequence
    flops: int  # forward, recompute and backward FLOPs, per sequence


_CACHE: dict[str, LayerTrace] = {}


def trace_layer(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype,
                lora: tuple | None = None) -> LayerTrace:
    """Bytes and FLOPs per sequence of `seq_len` tokens for one layer under `recompute`, in `dtype`.

    A trace takes seconds (thousands of dispatched fake ops); it is kept in memory and on disk,
    keyed by everything it depends on, so that planning a model again is instant.
    """
    key = repr((spec, seq_len, recompute, dtype, lora, torch.__version__, _torchtune_version()))
    if key not in _CACHE:
        path = _cache_folder() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        try:
            _CACHE[key] = LayerTrace(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            _CACHE[key] = _trace(spec, seq_len=seq_len, recompute=recompute, dtype=dtype, lora=lora)
            _store(path, asdict(_CACHE[key]))
    return _CACHE[key]


def _cache_folder() -> Path:
    return Path(os.environ.get("MOAI_CACHE") or Path.home() / ".cache" / "moai-recipes") / "layer-traces"


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


def _trace(spec: ModelSpec, *, seq_len: int, recompute: str, dtype: torch.dtype, lora: tuple | None) -> LayerTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

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
        counter = FlopCounterMode(display=False)
        with tracker, counter:
            start = _total(tracker.get_tracker_snapshot("current"))
            y = layer(x)
            after_forward = _total(tracker.get_tracker_snapshot("current"))
            y.backward(torch.empty_like(y))
        peak = _total(tracker.get_tracker_snapshot("peak"))
        flops = counter.get_total_flops()
        if lora:
            # Frozen base weights get no gradient: count the FLOPs again as training runs them.
            # (MemTracker cannot follow frozen parameters; the memory above includes their
            # gradients' transient, a small over-estimate.)
            from moai_recipes.lora import freeze_base

            freeze_base(layer)
            with FlopCounterMode(display=False) as counter:
                layer(x).backward(torch.empty_like(y))
            flops = counter.get_total_flops()
    # The layer's own weight gradients are counted by the memory model (one layer's unsharded grads).
    grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    return LayerTrace(retained=max(0, after_forward - start), transient=max(0, peak - after_forward - grads),
                      flops=flops)


def _total(snapshot: dict) -> int:
    return sum(v.get("Total", 0) for v in snapshot.values())
