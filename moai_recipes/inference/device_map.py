"""Spread a decoder over several devices by whole blocks, as Accelerate's `device_map` does, and run it there.

Test: `python -m pytest tests/test_generate.py -q -k device_map`. `place_blocks` is pure (block sizes and
free memory per device in, a device per block out), so every strategy is tested on the CPU with made-up
sizes. `dispatch` gives each block of a torchtune decoder (on the meta device) memory on its device and
moves the activations at the block boundaries; on a machine without GPUs every block is on "cpu".
"""

import copy
from collections.abc import Mapping

import torch
from torch import nn

from moai_recipes.errors import UserError
from moai_recipes.models.build import init_buffers

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
OVERFLOW = "cpu"  # what fits on no GPU runs on the CPU, as Accelerate offloads it


def check_device_map(strategy: str, max_memory_gb: float | None) -> None:
    """UserError unless `strategy` is one of STRATEGIES and the per-GPU cap (None: none) is positive."""
    if strategy not in STRATEGIES:
        raise UserError(f"device_map={strategy}: valid values are {', '.join(STRATEGIES)}")
    if max_memory_gb is not None and max_memory_gb <= 0:
        raise UserError(f"max_memory_gb={max_memory_gb} must be positive (or null: 90% of each GPU's free memory)")


def device_budgets(sizes: Mapping[str, int], free: Mapping[str, int], strategy: str) -> dict[str, int]:
    """Bytes each device may take: Accelerate's `get_balanced_memory` for auto, balanced and balanced_low_0.

    Balanced caps every device but the last at an even share of the model plus a buffer of 1.25 layers
    (so the blocks do not spill onto the last device); balanced_low_0 shares the model among the other
    devices and leaves device 0 only what they cannot hold; sequential caps nothing.
    """
    check_device_map(strategy, None)
    budgets = {d: max(0, int(b)) for d, b in free.items()}
    usable = [d for d, b in budgets.items() if b > 0]
    if strategy == "sequential" or len(usable) < 2:
        return budgets
    low_zero = strategy == "balanced_low_0"
    total = sum(sizes.values())
    layers = [b for name, b in sizes.items() if name.startswith("layers.")] or list(sizes.values())
    share = total // (len(usable) - low_zero) + int(1.25 * max(layers))
    for d in usable[:-1]:  # the last device keeps all it has, in case the buffer is short
        if not (low_zero and d == usable[0]):
            budgets[d] = min(share, budgets[d])
    if low_zero:
        budgets[usable[0]] = min(max(0, total - sum(budgets[d] for d in usable[1:])), budgets[usable[0]])
    return budgets


def place_blocks(sizes: Mapping[str, int], free: Mapping[str, int], strategy: str = "auto") -> dict[str, str]:
    """The device of each block, in execution order: fill the devices in order within their budgets.

    `sizes`: bytes per block in the order the forward runs them (`tok_embeddings`, `layers.0`, ...,
    `norm`, `output`); `free`: usable bytes per device, in device order. A block never goes back to an
    earlier device; what fits on none goes to the CPU.
    """
    budgets = device_budgets(sizes, free, strategy)
    devices, used, placement, i = list(budgets), 0, {}, 0
    for name, size in sizes.items():
        while i < len(devices) and used + size > budgets[devices[i]]:
            i, used = i + 1, 0
        if i == len(devices):
            placement[name] = OVERFLOW
        else:
            placement[name], used = devices[i], used + size
    return placement


def decoder_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The blocks of a torchtune decoder in execution order; a tied output has no block (it is the embedding)."""
    blocks = {"tok_embeddings": model.tok_embeddings}
    blocks.update({f"layers.{i}": layer for i, layer in enumerate(model.layers)})
    blocks["norm"] = model.norm
    if isinstance(model.output, nn.Module):
        blocks["output"] = model.output
    return blocks


def block_sizes(model: nn.Module, *, dtype: torch.dtype, per_layer_extra: int = 0) -> dict[str, int]:
    """Bytes of each block's parameters in `dtype` (the model may be on meta), plus `per_layer_extra` per layer
    (its KV cache)."""
    sizes = {}
    for name, block in decoder_blocks(model).items():
        extra = per_layer_extra if name.startswith("layers.") else 0
        sizes[name] = sum(p.numel() for p in block.parameters()) * dtype.itemsize + extra
    return sizes


def _move(tree, device: torch.device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_move(t, device) for t in tree)
    if isinstance(tree, dict):
        return {k: _move(v, device) for k, v in tree.items()}
    return tree


def _inputs_to(device: torch.device):
    def hook(module, args, kwargs):
        return _move(args, device), _move(kwargs, device)

    return hook


def dispatch(model: nn.Module, placement: Mapping[str, str], *, main: torch.device) -> None:
    """Give the meta-device `model` memory block by block where `placement` says, and move activations.

    Each block's inputs (hidden states, mask, positions) move to its device before it runs, and the
    logits come back to `main`, where the prompt and the sampling live. Weights are loaded afterwards.
    """
    blocks = decoder_blocks(model)
    assert set(blocks) == set(placement), (sorted(blocks), sorted(placement))
    assert sum(p.numel() for b in blocks.values() for p in b.parameters()) == sum(p.numel() for p in model.parameters())
    # torchtune shares one RoPE module among the layers; each device needs its own copy of its cache.
    ropes: dict[str, nn.Module] = {}
    for i, layer in enumerate(model.layers):
        device = placement[f"layers.{i}"]
        if layer.attn.pos_embeddings is not None:
            if device not in ropes:
                ropes[device] = copy.deepcopy(layer.attn.pos_embeddings)
            layer.attn.pos_embeddings = ropes[device]
    for name, block in blocks.items():
        block.to_empty(device=placement[name])
        block.register_forward_pre_hook(_inputs_to(torch.device(placement[name])), with_kwargs=True)
    for device, rope in ropes.items():
        init_buffers(rope, device=device)
    if "output" not in blocks:  # tied: the output projection runs where the embedding weight is
        embedding = torch.device(placement["tok_embeddings"])
        model.norm.register_forward_hook(lambda module, args, out: out.to(embedding))
    model.register_forward_hook(lambda module, args, out: _move(out, main))


def setup_caches(model: nn.Module, placement: Mapping[str, str], *, dtype: torch.dtype, max_seq_len: int) -> None:
    """KV caches for one sequence of `max_seq_len` tokens, each layer's on its own device."""
    model.decoder_max_cache_seq_len = max_seq_len  # what TransformerDecoder.setup_caches records; generate reads it
    for i, layer in enumerate(model.layers):
        with torch.device(placement[f"layers.{i}"]):
            layer.setup_caches(1, dtype, encoder_max_seq_len=None, decoder_max_seq_len=max_seq_len)


def kv_cache_bytes(*, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """One layer's KV cache for one sequence."""
    return 2 * num_kv_heads * head_dim * max_seq_len * dtype.itemsize


def free_memory(*, fraction: float = 0.9, cap_bytes: int | None = None) -> dict[str, int]:
    """Usable bytes on each visible GPU: `fraction` of what is free (the rest for activations), at most `cap_bytes`."""
    free = {}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        available = int(torch.cuda.mem_get_info(i)[0] * fraction)
        free[f"cuda:{i}"] = min(available, cap_bytes) if cap_bytes is not None else available
    return free


def describe(placement: Mapping[str, str]) -> str:
    """One line: what went where, e.g. `cuda:0: tok_embeddings, layers 0-13; cuda:1: layers 14-31, norm, output`."""
    groups: dict[str, list[str]] = {}
    for name, device in placement.items():
        items = groups.setdefault(device, [])
        if name.startswith("layers."):
            index = name.split(".")[1]
            if items and items[-1].startswith("layers "):  # extend the run of consecutive layers
                items[-1] = f"{items[-1].split('-')[0]}-{index}"
                continue
            name = f"layers {index}"
        items.append(name)
    return "; ".join(f"{device}: {', '.join(items)}" for device, items in groups.items())
