"""A Mixture-of-Experts training step on this CPU: ours against transformers' own, on the same checkpoint and tokens.

    python bench/moe_step.py [--rounds 3] [--steps 5] [--experts 16] [--top-k 2] [--hidden 512]

The checkpoint is a Qwen3-MoE that transformers makes (random weights, `--layers` layers, every one sparse: `--experts`
experts of `--expert-dim`, top `--top-k`), saved once; every variant loads it and trains on the same batch of token ids
(`--batch` rows of `--seq` tokens, no padding), in fp32 (or `--dtype bf16`: every weight, gradient and moment in bf16,
as transformers trains a bf16 model), 2 threads, fused AdamW (lr 1e-5) for all, the load-balancing loss added with
config.json's coefficient by all (transformers' over the batch, ours per sample: the same work):
- ours: models/build.py's model, the experts stacked and computed by grouped products (torch._grouped_mm), each
  sample's balancing loss (models/moe.py), one step as train/loop.py takes it;
- ours-loop: the same with each expert computed by itself (GroupedExperts.implementation = "loop", the tests' oracle);
- transformers-<impl>: transformers' Qwen3MoeForCausalLM with experts_implementation=<impl> (eager: a loop over the
  experts hit; grouped_mm; batched_mm), `model(ids, labels=ids, output_router_logits=True).loss`.
Each variant runs in a process of its own, the variants alternate within each round, and the median step (of
`--steps` after two warm-up steps) and the peak resident memory above what the process held before its first step
are reported, medians of the rounds with their spread. The first step's losses are printed to show the same work.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# transformers' batched_mm gathers every token-expert pair's weights ([pairs, hidden, dim] a projection: 8 GiB at the
# default shapes) and runs this 24 GiB machine out of memory: pass it with --variants to try a smaller shape.
VARIANTS = ("ours", "ours-loop", "transformers-grouped_mm", "transformers-eager")

_ONE = r'''
import json, resource, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(2)
variant, folder, batch, seq, steps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
dtype = getattr(torch, sys.argv[7])
ids = torch.randint(0, 8000, (batch, seq), generator=torch.Generator().manual_seed(0))
if variant.startswith("transformers"):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              experts_implementation=variant.split("-", 1)[1])
    model.train()
    def loss_of():
        return model(ids, labels=ids, output_router_logits=True).loss
else:
    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.models.hf_format import HFFolder, load_weights
    from moai_recipes.models.loss import IGNORE_INDEX, cross_entropy_sum
    from moai_recipes.models.moe import GroupedExperts, Routing, routing_recorded
    hf = HFFolder.open(folder)
    GroupedExperts.implementation = "loop" if variant == "ours-loop" else "grouped"
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=seq)
    model.to_empty(device="cpu"); init_buffers(model, device="cpu"); load_weights(model, hf)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), IGNORE_INDEX)], dim=1)  # shifted as transformers shifts
    targets = int((labels != IGNORE_INDEX).sum())
    samples = torch.arange(batch)[:, None].expand(batch, seq)
    def loss_of():
        with routing_recorded(model, Routing(samples, batch, hf.spec)) as routing:
            ce = cross_entropy_sum(model(ids), labels) / targets
        return ce + hf.spec.router_aux_loss_coef * routing.balancing_losses().mean()
model.to(dtype)  # bf16: every weight, gradient and moment in bf16, as transformers trains a bf16 model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
ready = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times, first = [], None
for step in range(steps + 2):
    start = time.perf_counter()
    loss = loss_of()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - start)
    first = loss.item() if first is None else first
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": statistics.median(times[2:]), "peak_mib": (peak - ready) / 1024, "loss": first}))
'''


def make_checkpoint(folder: Path, args) -> Path:
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      moe_intermediate_size=args.expert_dim, num_experts=args.experts,
                                      num_experts_per_tok=args.top_k, norm_topk_prob=True,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    return folder


def run(variant: str, folder: Path, args) -> dict:
    r = subprocess.run([sys.executable, "-c", _ONE, str(ROOT), variant, str(folder), str(args.batch), str(args.seq),
                        str(args.steps), {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]], capture_output=True,
                       text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"{variant} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args()
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "qwen3-moe", args)
        results = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:  # alternated: neither side always runs first
                results[v].append(run(v, folder, args))
                print(f"round {r + 1} {v}: {results[v][-1]}", flush=True)
    print(f"\nQwen3-MoE, {args.layers} layers, hidden {args.hidden}, {args.experts} experts of {args.expert_dim}, "
          f"top {args.top_k}; {args.batch} x {args.seq} tokens, {args.dtype}, 2 threads; medians of {args.rounds} rounds")
    best = min((statistics.median(x["seconds"] for x in results[v]), v) for v in variants if v.startswith("transf"))
    print(f"{'variant':<26} {'s/step':>8} {'spread':>15} {'peak MiB':>9} {'vs best transformers':>21} {'first loss':>11}")
    for v in variants:
        secs = [x["seconds"] for x in results[v]]
        med = statistics.median(secs)
        print(f"{v:<26} {med:>8.3f} {min(secs):>7.3f}-{max(secs):<7.3f} "
              f"{statistics.median(x['peak_mib'] for x in results[v]):>9.0f} {best[0] / med:>20.2f}x "
              f"{results[v][0]['loss']:>11.6f}")


if __name__ == "__main__":
    main()
