"""Weight-only quantization for inference, through torchao: the one boundary to it (`quantize_weights`).

int8: each linear layer's weight in int8 with one scale per output row; the activations stay in the model's dtype.
int4: the weight in int4 in groups of 128 (or 64, 32: the largest that divides every layer's input), one bf16 scale
and zero point per group, computed in bf16: torchao's tinygemm layout on a GPU, its CPU layout on the CPU (both
torch's own int4 matmul kernels). The embedding stays as it is; a tied output projection is the embedding, and stays.
"""

import warnings

import torch
from torch import nn

from moai_recipes.errors import UserError

INT4_GROUPS = (128, 64, 32)


def quantize_weights(model: nn.Module, kind: str, *, device: torch.device) -> str:
    """Quantize `model`'s nn.Linear weights in place to `kind` (int8 | int4); returns how, in words."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if kind == "int8":
        quantize_(model, Int8WeightOnlyConfig())
        return f"{len(linears)} linear layers' weights in int8 (one scale per output row)"
    inputs = {m.in_features for m in linears}
    group = next((g for g in INT4_GROUPS if all(n % g == 0 for n in inputs)), None)
    if group is None:
        raise UserError(f"quantize=int4 needs every linear layer's input size to divide into groups of 32 or more; "
                        f"this model's are {sorted(inputs)}. Use quantize=int8")
    if next(model.parameters()).dtype != torch.bfloat16:
        raise UserError("quantize=int4 computes in bf16: add dtype=bf16 (or leave dtype=auto, which it sets)")
    if device.type == "cpu":
        from torchao.dtypes import Int4CPULayout

        config = Int4WeightOnlyConfig(group_size=group, layout=Int4CPULayout(), version=1)
    else:
        config = Int4WeightOnlyConfig(group_size=group, version=1)
    with warnings.catch_warnings():  # torchao 0.14 (torchtune 0.6's) calls this config, its CPU one, deprecated
        warnings.filterwarnings("ignore", message=".*version 1 of Int4WeightOnlyConfig")
        quantize_(model, config)
    return f"{len(linears)} linear layers' weights in int4 (groups of {group}, bf16 scales)"
