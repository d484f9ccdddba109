"""A dense layer's MLP computed over tiles of the sequence (plan.tiled_mlp), its intermediate never whole.

SwiGLU's backward holds three [tokens, intermediate] tensors of a layer at once (the gate, the up projection, their
SiLU product: about 3 x 3.5 times the layer's input at Llama's widths), the largest transient of a long row's
layer. Each tile runs under its own checkpoint: the forward keeps only the tile's input (a view of the MLP's input,
kept anyway) and the concatenated output; the backward recomputes one tile's intermediate at a time and frees it
before the next (Snowflake's ALST TiledMLP). The price is the MLP's forward once more (planner/timing.py).

Tiles cut the last-but-one dimension, the sequence: every token's MLP is its own, so the result is the same up to
the order of the weight gradients' sums over tiles. A Mixture-of-Experts layer routes its tokens as a whole (its
balancing loss counts them together) and a tensor-parallel MLP already holds 1 / T of the intermediate: neither is
tiled (planner/layouts.why_not_tiled_mlp).
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_tiled_mlp(layers: nn.ModuleList, tiles: int) -> None:
    """Compute each layer's MLP in `tiles` tiles of its rows' tokens (1 or less: whole). Patches `mlp.forward` in
    place, as recomputation patches the layer's (models/recompute.py): parameter names stay the same."""
    if tiles <= 1:
        return
    for layer in layers:
        layer.mlp.forward = _tiled(layer.mlp.forward, tiles)


def _tiled(forward, tiles: int):
    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        parts = x.tensor_split(min(tiles, x.shape[-2]), dim=-2)
        return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in parts], dim=-2)
    tiled_forward.tiles = tiles
    return tiled_forward


def mlp_tiles(row_tokens: int, hidden: int, fewest: int = 8) -> int:
    """How many tiles a device's row of `row_tokens` tokens is cut into: tiles of about the model's hidden size in
    tokens (ALST's rule: a tile's intermediate is then about the size of a weight of the MLP), at least `fewest`
    (past eight, more tiles saved no memory in the planner's traces: attention's transient is the larger there)."""
    return max(fewest, -(-row_tokens // hidden))
