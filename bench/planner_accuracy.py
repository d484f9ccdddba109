"""Planner accuracy: predicted against measured peak memory and step time, on real CPU training steps.

    python bench/planner_accuracy.py            # the default grid, ~5 minutes on 2 cores
    python bench/planner_accuracy.py --quick    # a smaller grid

For each (model, sequence length, micro-batch size, recompute) it builds the model as a recipe does
(meta -> recompute -> FSDP2 on a 1-process gloo world -> memory), runs real optimizer steps on
random tokens of exactly the sequence length, and measures the peak with PyTorch's MemTracker
(every tensor allocation, by category) and the median step time. The prediction is the planner's
for the same plan, without the fixed overhead and slack (MemTracker counts tensors only). Then,
per (model, sequence), it checks that the plan the planner chooses is within 5% of the fastest
plan measured. Prints a table and the error summary; docs/planner.md records a run.
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # our recipes/ before torchtune's

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh

from moai_recipes.flavors import resolve_flavor
from moai_recipes.models import ModelSpec, build_model, init_buffers
from moai_recipes.parallel import apply_recompute, shard_model
from moai_recipes.planner.memory import model_sizes, predict_memory
from moai_recipes.planner.search import choose_plan
from moai_recipes.planner.timing import predict_time
from moai_recipes.training import token_loss_sum

BASE = ModelSpec(family="llama", vocab_size=2048, num_layers=4, num_heads=8, num_kv_heads=4, embed_dim=256,
                 intermediate_dim=704, head_dim=32, max_position_embeddings=4096, rope_base=10000.0, norm_eps=1e-5,
                 tie_word_embeddings=False, rope_scaling=None, attention_bias=False, torch_dtype="float32")
MODELS = {"llama-256x4": BASE, "llama-512x6": replace(BASE, embed_dim=512, num_layers=6, intermediate_dim=1408, head_dim=64)}


def measure(spec: ModelSpec, *, seq: int, mbs: int, accum: int, recompute: str, steps: int) -> tuple[int, float]:
    """(peak bytes, median step seconds) of real training steps of `accum` micro-batches of `mbs`."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(spec, max_seq_len=seq)
    apply_recompute(model.layers, recompute)
    mesh = init_device_mesh("cpu", (1,))
    shard_model(model, model.layers, mesh=mesh, param_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, spec.vocab_size, (mbs, seq))

    def step(tracker=None):
        for _ in range(accum):
            if tracker:
                tracker.reset_mod_stats()  # MemTracker follows one forward at a time; its device peak stays
            token_loss_sum(model, tokens, tokens).backward()  # the recipe's loss, on random targets
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on, as in every later step
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(tracker)
    peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return peak, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    flavor = resolve_flavor(name="cpu", device="cpu", memory_gb=None, processes=1, device_memory_gb=None)
    grid_models = ["llama-256x4"] if args.quick else list(MODELS)
    seqs = [256] if args.quick else [128, 512]
    batches = [(1, 1), (4, 1), (2, 2)]  # (micro-batch size, accumulation steps)
    rows = []
    print(f"{'model':>12} {'seq':>4} {'mbs':>3} {'acc':>3} {'recompute':>9} {'pred MiB':>9} {'meas MiB':>9} {'err':>7} "
          f"{'pred s':>7} {'meas s':>7}")
    for name in grid_models:
        spec = MODELS[name]
        sizes = model_sizes(spec)
        for seq in seqs:
            for mbs, accum in batches:
                for rc in ("none", "selective", "full"):
                    pred = predict_memory(spec, sizes, num_devices=1, micro_batch_size=mbs, seq_len=seq, recompute=rc,
                                          reshard_after_forward=True, cpu_offload=False, compute_dtype="float32",
                                          fixed_overhead=0, slack=0.0,
                                          accumulation_steps=accum).total
                    t_pred = predict_time(spec, sizes, flavor.device, num_devices=1, batch_size=mbs * accum,
                                          micro_batch_size=mbs, accumulation_steps=accum, seq_len=seq, recompute=rc,
                                          reshard_after_forward=True, cpu_offload=False, compute_dtype="float32").total_s
                    peak, secs = measure(spec, seq=seq, mbs=mbs, accum=accum, recompute=rc, steps=args.steps)
                    err = (pred - peak) / peak
                    rows.append(dict(model=name, seq=seq, mbs=mbs, accum=accum, recompute=rc, pred=pred, meas=peak,
                                     err=err, t_pred=t_pred, t_meas=secs))
                    print(f"{name:>12} {seq:>4} {mbs:>3} {accum:>3} {rc:>9} {pred / 2**20:>9.1f} {peak / 2**20:>9.1f} "
                          f"{err:>+7.1%} {t_pred:>7.3f} {secs:>7.3f}", flush=True)
    errs = sorted(abs(r["err"]) for r in rows)
    print(f"\npeak memory: median |error| {statistics.median(errs):.1%}, worst {errs[-1]:.1%}, "
          f"under-predicted in {sum(r['err'] < 0 for r in rows)} of {len(errs)} (an under-prediction could OOM)")
    # The planner's choice for a global batch of 4 per device against the fastest measured plan.
    for name in grid_models:
        for seq in seqs:
            sub = [r for r in rows if r["model"] == name and r["seq"] == seq and r["accum"] == 1]
            per_step = {(r["mbs"], r["recompute"]): r["t_meas"] * 4 / r["mbs"] for r in sub}
            choice = choose_plan(spec=MODELS[name], flavor=flavor, batch_size=4, seq_len=seq, dtype="fp32")
            key = (choice.chosen.plan.micro_batch_size, choice.chosen.plan.recompute)
            best = min(per_step.values())
            if key in per_step:
                print(f"{name} seq {seq}: chosen mbs {key[0]} {key[1]}: {per_step[key]:.3f} s for 4 sequences, "
                      f"fastest measured {best:.3f} s ({per_step[key] / best - 1:+.1%})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
