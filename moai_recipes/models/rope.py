"""Rotary position embeddings as Hugging Face computes them, for every RoPE a supported config.json asks for.

Hugging Face rotates the first half of each head against its second half (`rotate_half`); torchtune's
own RoPE rotates neighbouring pairs, which is why its converters permute the q and k rows of Llama
checkpoints. Rotating halves here keeps every weight (q/k norms and LoRA adapters included) in the
checkpoint's own layout: loading and saving rename tensors and never permute them.

The frequencies follow transformers' rope initialisation for the types we build: `default` (plain),
`linear` (positions divided by a factor) and `llama3` (Llama 3.1 / 3.2: long wavelengths divided by
the factor, short ones kept, a smooth ramp between). spec.py refuses the others by name.
Test: `python -m pytest tests/test_models.py -q`.
"""

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32: the rotation speed of each pair of a head's dimensions."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    assert kind == "llama3", kind
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """torchtune's pos_embeddings interface: (x [batch, tokens, heads, head_dim], input_pos) -> rotated x.

    `input_pos` ([batch, tokens]) gives each token's position: packed documents restart at 0, generation
    continues from the prompt. The cos/sin tables cover `max_seq_len` positions and are not saved in any
    checkpoint; `rope_init` rebuilds them (models.build.init_buffers, after a meta-device build).
    """

    def __init__(self, head_dim: int, *, max_seq_len: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_seq_len, self.base, self.scaling = head_dim, max_seq_len, base, scaling
        self.rope_init()

    def rope_init(self) -> None:
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32),
                             inverse_frequencies(self.head_dim, self.base, self.scaling))
        angles = torch.cat([angles, angles], dim=-1)  # both halves of a head turn by the same angles
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        tokens = x.size(1)
        cos, sin = (self.cos[:tokens], self.sin[:tokens]) if input_pos is None else (self.cos[input_pos], self.sin[input_pos])
        cos, sin = cos.view(-1, tokens, 1, self.head_dim), sin.view(-1, tokens, 1, self.head_dim)
        xf = x.float()  # rotated in float32 whatever the compute dtype, as torchtune's RoPE does
        first, second = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-second, first], dim=-1) * sin).type_as(x)
