"""Planner accuracy: predicted against measured peak memory and step time, on real CPU training steps.

    python bench/planner_accuracy.py                  # the default grid, ~3 minutes on 2 cores
    python bench/planner_accuracy.py --processes 2    # the same on 2 gloo processes: FSDP2 shards the model
    python bench/planner_accuracy.py --quick          # a smaller grid

For each model and sequence length it takes every plan of a batch of 4 sequences (micro-batch 1, 2
or 4 with 4, 2 or 1 accumulation steps, each with the three recompute policies), builds the model as a
recipe does (meta -> recompute -> shard_model -> memory: on one fp32 process a plain module, on
--processes 2 FSDP2 over a gloo world, as flavor=cpu-2), runs real optimizer steps on random tokens
of exactly the sequence length, and measures the peak with PyTorch's MemTracker (every tensor
allocation, by category) and the step time (the fastest of --steps; with several processes the
largest over them). The prediction is the planner's for the same plan, without the fixed
overhead and slack (MemTracker counts tensors only). Then, under budgets that rule plans out, it
compares the plan the planner chooses with the fastest measured plan that fits the same budget.
Prints a table and the error summary; docs/planner.md records a run.
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # our recipes/ before torchtune's

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh

from moai_recipes.errors import UserError
from moai_recipes.flavors import resolve_flavor
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.spec import ModelSpec
from moai_recipes.planner.cpu_speed import cpu_speed, process_threads
from moai_recipes.planner.memory import SLACK, predict_memory
from moai_recipes.planner.plan import Plan, Workload
from moai_recipes.planner.search import SAFETY_MARGIN, choose_plan
from moai_recipes.planner.timing import predict_time
from moai_recipes.models.loss import token_loss_sum
from moai_recipes.models.recompute import apply_recompute
from moai_recipes.train.parallel import shard_model

BASE = ModelSpec(family="llama", vocab_size=2048, num_layers=4, num_heads=8, num_kv_heads=4, embed_dim=256,
                 intermediate_dim=704, head_dim=32, max_position_embeddings=4096, rope_base=10000.0, norm_eps=1e-5,
                 tie_word_embeddings=False, rope_scaling=None, attention_bias=False, torch_dtype="float32")
BATCH = 4  # sequences per device and step
MODELS = {"llama-256x4": BASE, "llama-512x6": replace(BASE, embed_dim=512, num_layers=6, intermediate_dim=1408, head_dim=64)}


def measure(spec: ModelSpec, *, seq: int, mbs: int, accum: int, recompute: str, chunked: bool,
            steps: int) -> tuple[int, float]:
    """(peak bytes, step seconds) of real training steps of `accum` micro-batches of `mbs`.

    The step time is the fastest of `steps` steps: other work on the machine only ever slows a step
    down, so the minimum is the steadiest estimate of what the plan costs (timeit's reasoning)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(spec, max_seq_len=seq)
    apply_recompute(model.layers, recompute)
    if dist.get_world_size() > 1:  # one fp32 process: a plain module, as the recipes keep it (Plan.sharded)
        shard_model(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), param_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, spec.vocab_size, (mbs, seq))

    def step(tracker=None):
        for _ in range(accum):
            if tracker:
                tracker.reset_mod_stats()  # MemTracker follows one forward at a time; its device peak stays
            token_loss_sum(model, tokens, tokens, chunked=chunked).backward()  # the recipe's loss, random targets
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
    # Every process holds the same share; a step lasts as long as its slowest process.
    worst = torch.tensor([float(peak), min(times, default=float("nan"))], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return int(worst[0]), float(worst[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1, help="gloo processes, as flavor=cpu-N (default 1)")
    args = ap.parse_args()
    n = args.processes
    # Each process gets its share of the cores, as the recipe's launcher gives its workers.
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", WORLD_SIZE=str(n))
    if n == 1:
        run(0, args)
    else:
        torch.multiprocessing.spawn(run, args=(args,), nprocs=n)


def run(rank: int, args) -> None:
    """The grid on one process of the world (rank 0 prints)."""
    n = args.processes
    warnings.filterwarnings("ignore", message="DTensor random")  # the random init of the measured models
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    flavor = resolve_flavor(name="cpu", device="cpu", memory_gb=None, processes=n, device_memory_gb=None)
    grid_models = ["llama-256x4"] if args.quick else list(MODELS)
    seqs = [256] if args.quick else [128, 512]
    # Every plan of a batch of BATCH sequences per device: (micro-batch size, accumulation steps) x recompute.
    plans = [(m, BATCH // m, rc, False) for m in (1, 2, 4) for rc in ("none", "selective", "full")]
    # The chunked loss is left out: MemTracker takes the final norm, called once per chunk after the model's
    # forward, for a new iteration and stops. Its memory is traced exactly (tests/test_loss.py, test_planner.py).
    rows = []
    speed = cpu_speed(process_threads(n))
    print(f"This CPU, measured for the planner: {speed.fp32_flops / 1e9:.0f} GFLOP/s fp32 matmul, "
          f"{speed.bytes_per_s / 1e9:.1f} GB/s elementwise, {torch.get_num_threads()} threads per process, "
          f"{n} process(es){' (FSDP2)' if n > 1 else ' (a plain module)'}\n")
    print(f"{'model':>12} {'seq':>4} {'mbs':>3} {'acc':>3} {'recompute':>9} {'chunked':>7} {'pred MiB':>9} {'meas MiB':>9} "
          f"{'err':>7} {'phase':>20} {'pred s':>7} {'meas s':>7} {'err':>7}")
    for name in grid_models:
        spec = MODELS[name]
        work = {seq: Workload(spec=spec, batch_size=BATCH * n, seq_len=seq, dtype="fp32") for seq in seqs}
        for seq in seqs:
            for mbs, accum, rc, chunked in plans:
                plan = Plan(batch_size=BATCH * n, num_devices=n, max_seq_len=seq, micro_batch_size=mbs,
                            accumulation_steps=accum, packing=False, recompute=rc, replicate=False, reshard_after_forward=True,
                            cpu_offload=False, chunked_loss=chunked, param_dtype="float32", master_dtype="float32")
                pred = predict_memory(plan, work[seq], "cpu")
                t_pred = predict_time(plan, work[seq], flavor.device).total_s
                peak, secs = measure(spec, seq=seq, mbs=mbs, accum=accum, recompute=rc, chunked=chunked, steps=args.steps)
                row = dict(model=name, seq=seq, mbs=mbs, accum=accum, recompute=rc, chunked=chunked, pred=pred.allocated, meas=peak,
                           err=(pred.allocated - peak) / peak, t_pred=t_pred, t_meas=secs, t_err=(t_pred - secs) / secs)
                rows.append(row)
                print(f"{name:>12} {seq:>4} {mbs:>3} {accum:>3} {rc:>9} {str(chunked):>7} {pred.allocated / 2**20:>9.1f} {peak / 2**20:>9.1f} "
                      f"{row['err']:>+7.1%} {pred.phase:>20} {t_pred:>7.3f} {secs:>7.3f} {row['t_err']:>+7.1%}", flush=True)
    errs = sorted(abs(r["err"]) for r in rows)
    under = [r["err"] for r in rows if r["err"] < 0]
    t_errs = sorted(abs(r["t_err"]) for r in rows)
    print(f"\npeak memory: median |error| {statistics.median(errs):.1%}, worst {errs[-1]:.1%}; under-predicted in "
          f"{len(under)} of {len(errs)}, by at most {-min(under, default=0):.1%} (the planner adds "
          f"{SLACK['cpu']:.0%} slack and keeps {SAFETY_MARGIN:.0%} free)")
    print(f"step time: median |error| {statistics.median(t_errs):.1%}, worst {t_errs[-1]:.1%}")
    print("\nThe planner's choice under budgets that rule plans out (each plan's measured peak + 15%), against the "
          "fastest measured plan that fits the same budget:")
    worst = worst_ranked = 0.0
    for name in grid_models:
        for seq in seqs:
            sub = [r for r in rows if r["model"] == name and r["seq"] == seq and not r["chunked"]]
            for budget in sorted({r["meas"] * 1.15 for r in sub}):
                gb = budget / (1 - SAFETY_MARGIN) / 2**30
                cpu = resolve_flavor(name="cpu", device="cpu", memory_gb=None, processes=n, device_memory_gb=gb)
                try:
                    choice = choose_plan(Workload(spec=MODELS[name], batch_size=BATCH * n, seq_len=seq, dtype="fp32"),
                                         cpu, forced={"chunked_loss": False, "reshard_after_forward": True, "packing": False,
                                                  "replicate": False})
                except UserError:
                    print(f"  {name} seq {seq} budget {budget / 2**20:.0f} MiB: nothing predicted to fit")
                    continue
                row = lambda p: next(r for r in sub if (r["mbs"], r["recompute"]) == (p.micro_batch_size, p.recompute))
                got = row(choice.chosen.plan)
                # The time ranking: the fastest measured of the plans the planner predicts to fit.
                ranked = min((row(c.plan) for c in choice.candidates if c.fits), key=lambda r: r["t_meas"])
                # And what the memory margin costs: the fastest measured of the plans that really fit.
                best = min((r for r in sub if r["meas"] <= budget), key=lambda r: r["t_meas"])
                slower, misranked = got["t_meas"] / best["t_meas"] - 1, got["t_meas"] / ranked["t_meas"] - 1
                worst, worst_ranked = max(worst, slower), max(worst_ranked, misranked)
                print(f"  {name} seq {seq} budget {budget / 2**20:.0f} MiB: chosen mbs {got['mbs']} {got['recompute']} "
                      f"({got['meas'] / 2**20:.0f} MiB, {got['t_meas']:.3f} s); fastest predicted to fit "
                      f"mbs {ranked['mbs']} {ranked['recompute']} {misranked:+.1%}; fastest that fits mbs {best['mbs']} "
                      f"{best['recompute']} ({best['meas'] / 2**20:.0f} MiB) {slower:+.1%}"
                      f"{'  OUT OF BUDGET' if got['meas'] > budget else ''}")
    print(f"chosen plans: at most {worst_ranked:.1%} slower than the fastest measured of the plans predicted to fit; "
          f"at most {worst:.1%} slower than the fastest that really fits (the memory margin's cost)")
    dist.destroy_process_group()
    if n > 1:  # torch 2.13's gloo can abort while a spawned process exits; its work is done and printed
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
