"""A checkpoint (an adapter merged, quantized if asked) built for inference on this machine's devices.

What recipes.generate and recipes.eval share: build on meta, place whole blocks on the GPUs as Accelerate's
device_map does (the KV caches counted), give them memory, load the weights, merge the adapter, quantize, and
set up the caches. On the CPU everything runs on the CPU. Test: `python -m pytest tests/test_generate.py -q`.
"""

import contextlib
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from moai_recipes.inference.device_map import (
    block_sizes,
    describe,
    dispatch,
    free_memory,
    kv_cache_bytes,
    place_blocks,
    setup_caches,
)
from moai_recipes.errors import UserError
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.hf_format import HFFolder, load_weights
from moai_recipes.models.peft_adapter import PeftAdapter, merge_adapter
from moai_recipes.models.quantize import quantize_weights


@dataclass
class Loaded:
    model: torch.nn.Module  # in eval mode, its KV caches set up for one sequence of max_seq_len tokens
    device: torch.device  # where the tokens go in and the logits come out
    dtype: torch.dtype
    summary: str  # what was loaded and where, for a person


def load_for_inference(cfg: DictConfig, hf: HFFolder, adapter: PeftAdapter | None, *, max_seq_len: int) -> Loaded:
    """`hf` with `adapter` merged, as `cfg` (dtype, quantize, device_map, max_memory_gb) asks."""
    spec = hf.spec
    gpu = torch.cuda.is_available()
    # int4's kernels compute in bf16: dtype=auto becomes bf16 for it (an explicit fp32 is refused by quantize_weights).
    auto = torch.bfloat16 if gpu or cfg.quantize == "int4" else torch.float32
    dtype = {"auto": auto, "fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    main = torch.device("cuda:0" if gpu else "cpu")  # where the prompt, the logits and the sampling live
    with torch.device("meta"):
        model = build_model(spec, max_seq_len=max_seq_len).to(dtype)
    cache = kv_cache_bytes(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_seq_len=max_seq_len, dtype=dtype)
    cap = int(cfg.max_memory_gb * 2**30) if cfg.max_memory_gb is not None else None
    placement = place_blocks(block_sizes(model, dtype=dtype, per_layer_extra=cache), free_memory(cap_bytes=cap),
                             cfg.device_map)
    if spec.native:
        dispatch(model, placement, main=main)
    else:  # transformers' modules: their rotary tables and masks are made once for every layer, on one device
        if len(set(placement.values())) > 1:
            raise UserError(f"this {spec.family} model (transformers' modules) does not fit on {main} alone "
                            f"({describe(placement)}), and it is not spread over several devices here yet; "
                            "quantize=int8 or int4, or dtype=bf16, makes it smaller")
        model.to_empty(device=main)
        init_buffers(model, device=main)
    load_weights(model, hf)
    if adapter:
        merge_adapter(model, adapter, spec)
    quantized = quantize_weights(model, cfg.quantize, device=main) if cfg.quantize != "none" else None
    model.eval()
    if spec.native:
        setup_caches(model, placement, dtype=dtype, max_seq_len=max_seq_len)
    else:
        model.setup_caches(1, dtype, decoder_max_seq_len=max_seq_len)
    summary = (f"Model {hf.folder}: {spec.family}, {spec.num_params() / 1e6:.1f}M parameters in {str(dtype)[6:]}"
               + (f"; adapter {adapter.folder} merged (r={adapter.rank}, alpha={adapter.alpha:g})" if adapter else "")
               + (f"; {quantized}" if quantized else "") + f"\nDevice map ({cfg.device_map}): {describe(placement)}")
    return Loaded(model=model, device=main, dtype=dtype, summary=summary)


def whole_sequence_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's logits of `tokens` [rows, width], the model's KV caches (if set up) out of the way: with
    caches set up, torchtune's attention is causal only through an explicit mask, so one is always given."""
    from torchtune.modules.common_utils import disable_kv_cache

    rows, width = tokens.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril().expand(rows, width, width)
    with disable_kv_cache(model) if model.caches_are_setup() else contextlib.nullcontext():
        logits = model(tokens, mask=causal)
    return torch.cat(logits, dim=1) if isinstance(logits, list) else logits  # a chunked output layer
