"""Attention over a packed row on the CPU: which way of keeping documents apart is fastest, forward and backward.

    python bench/packed_attention.py                 # rows of 1024 and 4096 tokens, 3 rounds
    python bench/packed_attention.py --rounds 5 --heads 8 --head-dim 64

Each way computes the same thing (checked against the first): causal attention within each document of a
row whose documents have the lengths of a long-tailed text file (median ~130 tokens).
  per-document  causal SDPA on each document's slice (what models/attention.py does on the CPU)
  dense-mask    one SDPA over the whole row with a boolean block-causal mask (torchtune's CPU path)
  flex          flex_attention with a document BlockMask (torchtune's GPU path): torch 2.13 has no backward
                for it on the CPU, which the table says
docs/packing.md records a run. Median of --rounds timings of --repeats forward+backward passes each.
"""

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F


def doc_lengths(total: int, seed: int) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(max(8, min(1024, int(rng.lognormvariate(4.9, 0.8)))))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def per_document(q, k, v, lengths):
    return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True)
                      for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], dim=2)


def dense_mask(q, k, v, lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(doc))
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def flex(q, k, v, lengths):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    block = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, len(doc), len(doc),
                              device="cpu")
    return flex_attention(q, k, v, block_mask=block)


def timed(fn, q, k, v, lengths, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn(q, k, v, lengths).sum().backward()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ways = {"per-document": per_document, "dense-mask": dense_mask, "flex": flex}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.heads} heads of {args.head_dim}, fp32")
    print("| row tokens | documents | " + " | ".join(f"{w} ms" for w in ways) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in ways) + " |")
    for tokens in args.rows:
        lengths = doc_lengths(tokens, seed=tokens)
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, tokens, args.head_dim, requires_grad=True) for _ in range(3))
        reference = per_document(q, k, v, lengths)
        times = {}
        for name, fn in ways.items():
            try:
                torch.testing.assert_close(fn(q, k, v, lengths), reference, rtol=1e-4, atol=1e-4)
                runs = [timed(fn, q, k, v, lengths, args.repeats) for _ in range(args.rounds)]
            except NotImplementedError as e:  # flex: "FlexAttention does not support backward on CPU"
                times[name] = str(e).split(".")[0]
                continue
            times[name] = f"{statistics.median(runs) * 1e3:.1f}"
        print(f"| {tokens} | {len(lengths)} | " + " | ".join(times[w] for w in ways) + " |", flush=True)


if __name__ == "__main__":
    main()
