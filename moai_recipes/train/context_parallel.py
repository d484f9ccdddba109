"""Context parallelism: each packed row's tokens split over the mesh's `context` devices, so that a sample too long
for one device is trained on several.

The row (train/micro_batches.model_inputs: documents laid end to end, their labels shifted already, so a cut
between two devices needs nothing from the other side) is padded to a multiple of 2C tokens and cut into 2C equal
chunks; device c keeps chunks c and 2C-1-c (head and tail), so that every device's queries see as many earlier
keys under the causal mask: their attention's work is even. Every layer but attention is a function of its own
token, so it runs on the device's share as it would on the whole row; RoPE takes each token's place in its own
document (Documents.positions), cut the same way. Attention is computed one of two ways (plan.context_parallel_way):

- ulysses (DeepSpeed-Ulysses): an all-to-all gives each device the whole row for H/C of the heads; it attends as one
  process would (models/attention.py, document by document), and a second all-to-all sends every device its own
  tokens' outputs of every head back. C must divide the heads (a device's, under tensor parallelism); the keys and
  values arrive expanded to the query heads (torchtune expands them before the attention call), so grouped-query
  models need no rule of their own. Communication: four row-sized exchanges per layer, forward.
- gather: every device all-gathers the keys and values of the whole row (of the model's key/value heads, not
  expanded to the query heads) and its own queries attend to them under the documents' causal mask; the gather's
  backward sums the keys' and values' gradients back to the devices that own them (a reduce-scatter). Any head
  count; the whole row's keys and values are held during attention.

The loss of a device is the sum over its own tokens (models/loss.py), and the step divides by the global batch's
target tokens (train/loop.py): the same loss as one process. FSDP2 shards the model over data x context devices
(World.dim("shard")): each context device's gradients are partial sums of the same samples', and FSDP's mean over
the shard devices times their number is their sum.

Test: `python -m pytest tests/test_context_parallel.py -q`.
"""

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from moai_recipes.models.attention import GATHER_BLOCK, Documents, attend_documents
from moai_recipes.train.collectives import AllGather, AllToAll

WAYS = ("ulysses", "gather")


def share_indices(tokens: int, size: int, rank: int) -> torch.Tensor:
    """The places in a row of `tokens` (a multiple of 2 x size) that context device `rank` of `size` holds: chunks
    rank and 2 x size - 1 - rank of 2 x size."""
    chunk = tokens // (2 * size)
    head, tail = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


def whole_row(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The row put back together from every context device's share, stacked on dim 0 in rank order (`dim`: the token
    dimension of a share, counted without the stacking one)."""
    size = parts.shape[0]
    halves = [p.chunk(2, dim=dim) for p in parts.unbind(0)]
    return torch.cat([halves[c][0] for c in range(size)] + [halves[c][1] for c in reversed(range(size))], dim=dim)


def whole_row_keys_and_values(key: torch.Tensor, value: torch.Tensor, mesh: DeviceMesh):
    """The whole row's keys and values [1, heads, row, d_k] and [1, heads, row, d_v] from every context device's share
    of them, in one all-gather (its backward a reduce-scatter): side by side along each head's features, whose number
    need not be the same for both (multi-head latent attention's keys carry their rotary part: DeepSeek-V3's 192
    against 128)."""
    kv = AllGather.apply(torch.cat([key[0], value[0]], dim=-1), mesh.get_group())  # [size, heads, share, d_k + d_v]
    keys, values = whole_row(kv, dim=1).unsqueeze(0).split([key.shape[-1], value.shape[-1]], dim=-1)
    return keys, values


@dataclass(frozen=True)
class ContextShare:
    """This device's share of a packed row, as attention gets it in place of the row's Documents (torchtune's `mask`
    argument): it computes attention over the whole row with the other context devices (`attend`)."""

    documents: Documents  # the whole row's
    mesh: DeviceMesh  # the context dimension, 1-D
    way: str
    # What every layer's attention of this micro-batch uses alike, made by the first: the places of each device's
    # tokens, on the compute device, and (gather) the document of each place.
    _made: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @cached_property
    def indices(self) -> torch.Tensor:
        return share_indices(self.documents.offsets[-1], self.size, self.rank)

    def shares(self, device: torch.device) -> list[torch.Tensor]:
        """Every context device's places in the row, in rank order, on `device`."""
        if "shares" not in self._made:
            row = self.documents.offsets[-1]
            self._made["shares"] = [share_indices(row, self.size, c).to(device) for c in range(self.size)]
        return self._made["shares"]

    def documents_at(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([row] the document of each place of the row, [documents] the place each document starts at)."""
        if "documents" not in self._made:
            docs = self.documents
            self._made["documents"] = (
                torch.repeat_interleave(torch.arange(len(docs.lengths), device=device),
                                        torch.tensor(docs.lengths, device=device)),
                torch.tensor(docs.offsets[:-1], device=device))
        return self._made["documents"]

    def positions(self, device: torch.device) -> torch.Tensor:
        """[1, share]: RoPE's position of each of this device's tokens (its place in its own document)."""
        return self.documents.positions(device)[:, self.indices.to(device)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, *,
               kv_groups: int = 1) -> torch.Tensor:
        """q, k, v [1, heads, share, head_dim] of this device's tokens: their attention over the whole row. k and v
        come expanded to the query heads, each key/value head repeated `kv_groups` times in a row (torchtune's
        attention): ulysses splits them as they are, the gather way takes one head of each group, gathers those and
        attends with the group's queries (SDPA's grouped-query attention), kv_groups times less to move and hold."""
        if self.way == "ulysses":
            return _ulysses(q, k, v, self, dropout_p)
        return _gathered(q, k[:, ::kv_groups], v[:, ::kv_groups], self, dropout_p)

    @property
    def row_masks(self) -> dict | None:
        """Each layer's mask of the whole row, as a model of transformers' modules makes it (its _row_masks)."""
        return self._made.get("row_masks")

    def keep_row_masks(self, masks: dict) -> None:
        self._made["row_masks"] = masks

    def attend_blocks(self, query, key, value, block, attention) -> torch.Tensor:
        """The gather way for attention of any kind (transformers' modules): this device's queries [1, heads, share,
        d] (its head and tail chunks of the row) against the whole row's keys and values, all-gathered as they are
        (unexpanded; their backward a reduce-scatter), document by document, each block of queries against its
        document's keys up to its last under `block(q_start, q_length, k_start, k_length)`, the model's own mask of
        those places, by `attention(q, k, v, mask)` (the model's own attention): [1, share, heads, d]."""
        keys, values = whole_row_keys_and_values(key, value, self.mesh)
        mine = self.shares(query.device)[self.rank].tolist()  # ascending: the head chunk, then the tail chunk
        row, half, outs = self.documents, len(mine) // 2, []
        for a, b in ((0, half), (half, len(mine))):
            first, last = mine[a], mine[b - 1] + 1  # a chunk is consecutive places of the row
            for start, end in zip(row.offsets[:-1], row.offsets[1:]):
                lo, hi = max(first, start), min(last, end)
                if lo < hi:
                    q = query[:, :, a + lo - first:a + hi - first]
                    outs.append(attention(q, keys[:, :, start:hi], values[:, :, start:hi],
                                          block(lo, hi - lo, start, hi - start)))
        return torch.cat(outs, dim=1)


def share_batch(batch: dict, mesh: DeviceMesh, way: str) -> dict:
    """A packed micro-batch (model_inputs) cut to this context device's share: its tokens and labels, and the row's
    documents as a ContextShare."""
    share = ContextShare(documents=batch["documents"], mesh=mesh, way=way)
    picked = {k: batch[k][:, share.indices] for k in ("tokens", "labels", "samples")}
    return {**batch, **picked, "documents": share}


def _ulysses(q, k, v, share: ContextShare, dropout_p: float) -> torch.Tensor:
    size, group = share.size, share.mesh.get_group()
    _, heads, tokens, dim = q.shape
    ones = [1] * size

    def whole_row_some_heads(x):  # [1, heads, share, d] -> [1, heads / size, row, d]
        got = AllToAll.apply(x[0].reshape(size, heads // size, tokens, dim), ones, ones, group)
        return whole_row(got, dim=1).unsqueeze(0)

    out = attend_documents(*map(whole_row_some_heads, (q, k, v)), share.documents, dropout_p)
    # Back: each device's tokens of this device's heads, to that device; heads come back in rank order.
    mine = torch.stack([out[0][:, places] for places in share.shares(out.device)])
    back = AllToAll.apply(mine, ones, ones, group)  # [size (head groups), heads / size, share, d]
    return back.reshape(1, heads, tokens, dim)


def _gathered(q, k, v, share: ContextShare, dropout_p: float) -> torch.Tensor:
    """This device's queries [1, heads, share, d] against the whole row's keys and values (gathered from every device's
    k and v [1, key/value heads, share, d], as few heads as the model has: grouped-query attention), in blocks of GATHER_BLOCK queries: each block
    against the keys from its first query's document start to its last query, under the mask of their documents and
    places, made inside the block's own checkpoint. A mask of every local query against every key (5 bytes a pair as
    SDPA takes it) grew with the square of the row and capped the rows this way splits; a block's is at most
    GATHER_BLOCK x the row, one at a time, made again for its backward."""
    keys, values = whole_row_keys_and_values(k, v, share.mesh)
    document, starts = share.documents_at(q.device)
    mine = share.shares(q.device)[share.rank]  # ascending: the head chunk, then the tail chunk
    half = q.shape[2] // 2
    out = []
    for first in range(0, q.shape[2], GATHER_BLOCK):
        for a, b in ((first, min(first + GATHER_BLOCK, half)), (half + first, min(half + first + GATHER_BLOCK, 2 * half))):
            if a >= b:
                continue
            places = mine[a:b]
            lo, hi = int(starts[document[places[0]]]), int(places[-1]) + 1
            out.append((a, checkpoint(_block, q[:, :, a:b], keys[:, :, lo:hi], values[:, :, lo:hi], places, document,
                                      lo, dropout_p, use_reentrant=False)))
    return torch.cat([o for _, o in sorted(out, key=lambda x: x[0])], dim=2)


def _block(q, k, v, places: torch.Tensor, document: torch.Tensor, first: int, dropout_p: float) -> torch.Tensor:
    """Queries at `places` of the row against keys and values from place `first` on: each attends to the keys of its
    own document up to its own place."""
    keys_at = torch.arange(first, first + k.shape[2], device=q.device)
    mask = (document[places, None] == document[None, keys_at]) & (keys_at[None, :] <= places[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])
