"""How fast a SmolLM2-135M bf16 step could be on this CPU: each part of the step timed alone, with torch alone.

    python bench/bf16_floor.py [--tokens 429] [--docs 9] [--lora] [--repeats 15]

The MFU of a training step counts its model FLOPs (the matmuls, attention at the documents' lengths) against the
CPU's bf16 matmul peak (a 1024 x 1024 x 1024 matmul, as planner/cpu_speed.py measures it). No step can beat the sum
of its parts run alone on warm caches, so this sums the parts a step cannot do without and reports the MFU ceiling
that leaves:
- every matmul of the step, at its own shape (forward, input gradient and, for trained weights, weight gradient), in
  bf16 on one row of `--tokens` tokens;
- attention, document by document (`--docs` equal documents), the fastest of fp32 and bf16 SDPA;
- full fine-tuning also: fused AdamW over the 134.5M fp32 master weights and gradients, the bf16 copies cast from
  them, the bf16 gradients widened into fp32 ones, and the gradient norm that clipping needs.
Nothing of moai_recipes is timed here: this measures the machine, not our code (the step's own MFU is on its step
line). What is left out (RMSNorm, RoPE, SiLU, the residual adds, the embedding's backward, the loss's softmax, the
Python that dispatches the ~2,000 operators) is the room a real step has; the report says how much.
Each part is the best of `--repeats` runs (other load only slows a run down).
"""

import argparse
import time

import torch
import torch.nn.functional as F

DIM, LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 576, 30, 9, 3, 1536, 49152  # SmolLM2-135M
HEAD_DIM = DIM // HEADS


def best_seconds(op, repeats: int) -> float:
    op()  # warm up: oneDNN's kernels for this shape, the thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - start)
    return best


def layer_linears() -> list[tuple[int, int, int]]:
    """(in, out, how many) of each linear shape in the model: attention's q/k/v/o, the MLP's gate/up/down, the
    tied output projection."""
    kv = KV_HEADS * HEAD_DIM
    return [(DIM, DIM, 2 * LAYERS), (DIM, kv, 2 * LAYERS), (DIM, HIDDEN, 2 * LAYERS), (HIDDEN, DIM, LAYERS),
            (DIM, VOCAB, 1)]


def matmuls(tokens: int, lora: bool, repeats: int) -> tuple[float, float]:
    """(seconds, FLOPs) of every matmul of a step; a frozen weight (LoRA's base) has no weight gradient."""
    seconds = flops = 0.0
    for k, n, count in layer_linears():
        x = torch.randn(tokens, k).bfloat16()
        w = torch.randn(n, k).bfloat16()
        dy = torch.randn(tokens, n).bfloat16()
        parts = [lambda: F.linear(x, w), lambda: dy @ w] + ([] if lora else [lambda: dy.t() @ x])
        seconds += count * sum(best_seconds(op, repeats) for op in parts)
        flops += count * len(parts) * 2 * tokens * k * n
    return seconds, flops


def attention(tokens: int, docs: int, repeats: int) -> tuple[float, float, str]:
    """(seconds, model FLOPs, which dtype) of one step's causal attention over `docs` documents, forward and
    backward, all layers: the faster of fp32 and bf16."""
    lengths = [tokens // docs + (i < tokens % docs) for i in range(docs)]
    timed = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=dtype, requires_grad=True) for _ in range(3))
        dy = torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=dtype)

        def step():
            out = torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True)
                             for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], 2)
            out.backward(dy)

        timed[str(dtype).removeprefix("torch.")] = LAYERS * best_seconds(step, repeats)
    # Causal QK^T and PV: 2 matmuls of n*n*head_dim per head, half of them masked; the backward twice the forward.
    flops = LAYERS * 3 * sum(2 * 2 * HEADS * n * n * HEAD_DIM / 2 for n in lengths)
    name = min(timed, key=timed.get)
    return timed[name], flops, name


def master_weights(repeats: int) -> dict[str, float]:
    """Full fine-tuning's passes over the fp32 masters, each over the model's parameters shaped as they are."""
    shapes = [(DIM, DIM)] * 2 * LAYERS + [(KV_HEADS * HEAD_DIM, DIM)] * 2 * LAYERS + [(HIDDEN, DIM)] * 3 * LAYERS \
        + [(VOCAB, DIM)] + [(DIM,)] * (2 * LAYERS + 1)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    grads16 = [torch.randn(s).bfloat16() for s in shapes]
    for p, g in zip(params, grads16):
        p.grad = g.float()
    optimizer = torch.optim.AdamW(params, lr=2e-5, fused=True)
    optimizer.step()  # its moments exist from here on, as in a steady step
    copies = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    grads = [p.grad for p in params]
    return {
        "fused AdamW": best_seconds(optimizer.step, repeats),
        "bf16 copies of the masters": best_seconds(lambda: torch._foreach_copy_(copies, params), repeats),
        "bf16 gradients widened to fp32": best_seconds(lambda: torch._foreach_copy_(grads, grads16), repeats),
        "gradient norm": best_seconds(lambda: torch.nn.utils.get_total_norm(grads), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=429, help="a step's tokens, in one row (default: the facts step)")
    parser.add_argument("--docs", type=int, default=9, help="documents in the row (default: the facts step's 8-9)")
    parser.add_argument("--lora", action="store_true", help="a frozen base: no weight gradients, no AdamW over it")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    a, b = torch.randn(1024, 1024).bfloat16(), torch.randn(1024, 1024).bfloat16()
    peak = 2 * 1024**3 / best_seconds(lambda: a @ b, 3 * args.repeats)
    mm_s, mm_flops = matmuls(args.tokens, args.lora, args.repeats)
    att_s, att_flops, att_dtype = attention(args.tokens, args.docs, args.repeats)
    parts = {"matmuls": mm_s, f"attention ({att_dtype}, per document)": att_s}
    if not args.lora:
        parts.update(master_weights(args.repeats))
    model_flops = mm_flops + att_flops
    floor = sum(parts.values())

    print(f"SmolLM2-135M {'LoRA (frozen base)' if args.lora else 'full fine-tuning'}, {args.tokens} tokens in "
          f"{args.docs} documents, {args.threads} threads; bf16 matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"model FLOPs {model_flops / 1e9:.1f} G: {model_flops / peak * 1e3:.0f} ms at the peak")
    for name, s in parts.items():
        print(f"  {name:<36} {s * 1e3:7.1f} ms")
    print(f"  {'sum':<36} {floor * 1e3:7.1f} ms")
    print(f"matmuls alone: {mm_flops / mm_s / 1e9:.0f} GFLOP/s, {mm_flops / mm_s / peak:.0%} of the peak")
    print(f"MFU ceiling (nothing else in the step): {model_flops / floor / peak:.1%}")
    for target in (0.5, 0.6):
        room = model_flops / (target * peak) - floor
        print(f"{target:.0%} MFU is a {model_flops / (target * peak) * 1e3:.0f} ms step: "
              f"{room * 1e3:.0f} ms left for everything else")


if __name__ == "__main__":
    main()
