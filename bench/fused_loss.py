"""The output projection and the loss, three ways, on a micro-batch's hidden states: peak memory and time.

    python bench/fused_loss.py [--tokens 2048] [--rounds 3]

- whole: torchtune's unembed then the loss (all logits, in the compute dtype and in fp32, and their gradients);
- checkpointed: the previous `chunked_loss` (1024-token chunks, each recomputed in the backward);
- fused: today's `chunked_loss` (models/loss.py: chunks whose gradients are made in the same pass).
Shapes: SmolLM2-135M's (576 x 49,152, tied) and Qwen2.5-0.5B's (896 x 151,936), fp32 on this CPU, the weight
trained (full fine-tuning). Each variant runs in a process of its own (its peak resident memory is its own, above
what the process held before the step), the variants alternate within each round, and the median of the rounds is
reported with its spread. The losses and gradients of the three are checked equal before timing.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"SmolLM2-135M (576 x 49,152)": (576, 49152), "Qwen2.5-0.5B (896 x 151,936)": (896, 151936)}
VARIANTS = ("whole", "checkpointed", "fused")

_ONE = r'''
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from torch.utils.checkpoint import checkpoint
from moai_recipes.models.loss import CHUNK_TOKENS, IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_sum
torch.set_num_threads(2)
variant, d, v, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
g = torch.Generator().manual_seed(0)
weight = (torch.randn(v, d, generator=g) * 0.02).requires_grad_()
hidden = torch.randn(n, d, generator=g).requires_grad_()
labels = torch.randint(0, v, (n,), generator=g)
labels[: n // 4] = IGNORE_INDEX
ready = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the libraries, the weight, the hidden states

def run():
    if variant == "whole":
        return cross_entropy_sum(hidden @ weight.T, labels)
    if variant == "fused":
        return chunked_cross_entropy_sum(hidden, weight, labels)
    total = hidden.new_zeros(())
    for h, y in zip(hidden.split(CHUNK_TOKENS), labels.split(CHUNK_TOKENS)):
        total = total + checkpoint(lambda h, y: cross_entropy_sum(h @ weight.T, y), h, y, use_reentrant=False)
    return total

loss = run(); loss.backward()  # warm up (and the gradients to check)
check = {"loss": loss.item(), "gh": hidden.grad.double().sum().item(), "gw": weight.grad.double().abs().sum().item()}
hidden.grad = weight.grad = None
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the warm-up's peak: the step's (the same work)
start = time.perf_counter()
loss = run(); loss.backward()
seconds = time.perf_counter() - start
# Above what the process held before: the step's temporaries and the two gradients (the weight's, the hidden's).
print(json.dumps({"seconds": seconds, "peak_mib": (peak - ready) / 1024, **check}))
'''


def measure(variant: str, d: int, v: int, n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _ONE, str(ROOT), variant, str(d), str(v), str(n)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for name, (d, v) in SHAPES.items():
        results = {k: [] for k in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))  # alternate: drift falls on each alike
            for k in order:
                results[k].append(measure(k, d, v, args.tokens))
        ref = results["whole"][0]
        for k in VARIANTS:  # the same loss and gradients (summed in another order: fp32's rounding)
            got = results[k][0]
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (k, got, ref)
            assert abs(got["gw"] - ref["gw"]) <= 1e-3 * abs(ref["gw"]), (k, got, ref)
        print(f"{name}, {args.tokens} tokens (a quarter masked), fp32, {args.rounds} alternated rounds:")
        whole = statistics.median(x["seconds"] for x in results["whole"])
        for k in VARIANTS:
            s = [x["seconds"] for x in results[k]]
            m = [x["peak_mib"] for x in results[k]]
            print(f"  {k:<13} {statistics.median(s):6.2f} s (spread {min(s):.2f}-{max(s):.2f}), "
                  f"{statistics.median(s) / whole:4.2f}x whole's time; peak above inputs {statistics.median(m):7.0f} MiB")


if __name__ == "__main__":
    main()
