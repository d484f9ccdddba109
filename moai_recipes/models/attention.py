"""Attention over packed rows: several documents in one row, each attending only to itself, causally.

A packed micro-batch is one row of documents laid end to end. Its `Documents` (their lengths) reaches
every attention module as torchtune's `mask` argument, and the positions restart at each document
(`Documents.positions`, torchtune's `input_pos`), so a document computes exactly what it would alone.
`use_document_attention` replaces each attention module's call (torchtune's `_attention_call`) with
`_attention`, which computes only each document's own causal triangle:
- on a GPU in bf16/fp16: torch.nn.attention.varlen.varlen_attn (flash attention over the cumulative
  lengths: one kernel for the whole row);
- otherwise (the CPU): causal SDPA document by document. A dense block mask would compute the
  whole square of the row; docs/packing.md has the measurements behind the choice. In bf16 a row of short
  documents is computed in fp32 (CPU_FP32_BELOW).
Without Documents (padded rows, generation, the planner's traces) it is torchtune's own call.
Test: `python -m pytest tests/test_packing.py -q`.
"""

from functools import cached_property, partial

import torch
import torch.nn.functional as F
from torch import nn


class Documents:
    """The documents of one packed row, in order (their lengths add up to the row's).

    A plain class, not a frozen dataclass: a compiled layer (plan.compile) hands it to the attention it leaves eager,
    and torch 2.11's dynamo reads a frozen dataclass's fields into the graph's guards (`len(mask.lengths) == 2`),
    compiling the layer again for each number of documents a row holds (3 graphs in test_compile's packed run, 1 on
    torch 2.13); an ordinary object is passed through unread on both."""

    def __init__(self, lengths: tuple[int, ...]):
        self.lengths = tuple(lengths)

    def __eq__(self, other) -> bool:
        return isinstance(other, Documents) and other.lengths == self.lengths

    def __hash__(self) -> int:
        return hash(self.lengths)

    def __repr__(self) -> str:
        return f"Documents(lengths={self.lengths})"

    @cached_property
    def offsets(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def positions(self, device: torch.device) -> torch.Tensor:
        """[1, row length]: each document's positions from 0, as if it were alone."""
        return torch.cat([torch.arange(n, device=device) for n in self.lengths]).unsqueeze(0)


def use_document_attention(model: nn.Module) -> None:
    """Let every attention module of a torchtune model take `Documents` as its mask."""
    from torchtune.modules.attention import MultiHeadAttention

    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            # Query heads per key/value head: the same after tensor parallelism divides both counts.
            module._attention_call = partial(_attention, torchtune_call=module._attention_call,
                                             kv_groups=module.num_heads // module.num_kv_heads)


def _attention(q, k, v, *, mask, dropout_p: float, is_causal: bool, torchtune_call, kv_groups: int = 1):
    """q, k, v: [batch, heads, tokens, head_dim] (k and v already expanded to q's heads by torchtune: each key/value
    head repeated `kv_groups` times in a row)."""
    if hasattr(mask, "attend"):  # a share of a row cut over context devices (train/context_parallel.ContextShare)
        return mask.attend(q, k, v, dropout_p, kv_groups=kv_groups)
    if not isinstance(mask, Documents):
        return torchtune_call(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    return attend_documents(q, k, v, mask, dropout_p)


def attend_documents(q, k, v, documents: Documents, dropout_p: float):
    """Attention of a packed row [1, heads, tokens, head_dim], each of its documents to itself, causally."""
    varlen = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0
    if torch.compiler.is_compiling():  # left out of compiled layers (plan.compile), see keep_attention_eager
        return _EAGER["varlen" if varlen else "per_document"](q, k, v, documents, dropout_p)
    return (_varlen if varlen else _per_document)(q, k, v, documents, dropout_p)


# Queries per block of context parallelism's gather way (train/context_parallel._gathered): a block's mask against
# the row's keys is what it holds (and the planner prices) at a time.
GATHER_BLOCK = 1024


# The CPU's flash attention sets up its blocks per call, and in bf16 far more than in fp32: below a few hundred
# tokens a document's attention is faster in fp32, the casts included (SDPA forward and backward, 9 heads x 64,
# 2 threads: 32 tokens 0.37 ms in bf16, 0.17 ms cast to fp32; 128: 1.74 / 1.15 ms; 512: 12.2 / 15.6 ms). A row
# whose documents are all shorter than this is computed in fp32 (more exact, not less), its output cast back.
CPU_FP32_BELOW = 256


def _per_document(q, k, v, mask: Documents, dropout_p: float):
    assert q.shape[0] == 1 and q.shape[2] == mask.offsets[-1], (q.shape, mask.offsets[-1])
    dtype = q.dtype
    if q.device.type == "cpu" and dtype == torch.bfloat16 and max(mask.lengths) < CPU_FP32_BELOW:
        q, k, v = q.float(), k.float(), v.float()
    # split, not slicing: its backward is one concatenation, where each slice's would fill a whole row of zeros.
    n = list(mask.lengths)
    return torch.cat([F.scaled_dot_product_attention(qd, kd, vd, dropout_p=dropout_p, is_causal=True)
                      for qd, kd, vd in zip(q.split(n, dim=2), k.split(n, dim=2), v.split(n, dim=2))],
                     dim=2).to(dtype)


def _varlen(q, k, v, docs: Documents, dropout_p: float):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(docs.offsets, dtype=torch.int32, device=q.device)
    longest = max(docs.lengths)
    # varlen_attn takes (tokens, heads, head_dim); window (-1, 0) is causal.
    out = varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, longest, longest,
                      window_size=(-1, 0))
    return out.transpose(0, 1).unsqueeze(0)


# In a compiled layer (plan.compile) attention over documents runs eager: the documents' lengths are Python
# values that differ every step, so a traced graph would be specialised to one row and recompiled for the
# next. Only there: the wrapper costs each call tens of microseconds, which eager layers need not pay, and
# making it imports torch._dynamo (a second and a half), which a process that never compiles need not pay.
_EAGER: dict = {}


def keep_attention_eager() -> None:
    """Before compiling layers (train/parallel.apply_compile): attention over documents stays out of graphs."""
    _EAGER.update(per_document=torch.compiler.disable(_per_document), varlen=torch.compiler.disable(_varlen))
