"""recipes.grpo's sampling on this CPU against the planner's prediction (planner/rollouts.py): the KV cache's bytes
and the seconds of a round's prefill and decode steps, for generation batches of 4 to 64 completions.

    python bench/rollout_time.py                      # SmolLM2-135M-Instruct (the demo's model), about 3 minutes
    python bench/rollout_time.py model=tiny           # the tiny model

Each row: `recipes.plan`'s plan for `recipes.grpo` with plan.generation_batch forced, then train/rollouts.Sampler on
the real model (built as the recipe builds it, one process) sampling every completion of one step's prompts, timed
twice after a warm-up (the median), with max_completion_length tokens each (no stop token counts: every completion
runs to the end, as the prediction assumes).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moai_recipes.config.compose import load_config  # noqa: E402
from moai_recipes.flavors import resolve_flavor  # noqa: E402
from moai_recipes.inputs import read_inputs  # noqa: E402
from moai_recipes.planner.cpu_speed import process_threads  # noqa: E402
from moai_recipes.planner.rollouts import rollout_bytes  # noqa: E402
from moai_recipes.planner.search import choose_plan  # noqa: E402
from moai_recipes.train.policy import build_policy  # noqa: E402
from moai_recipes.train.rollouts import Sampler, SamplingSettings  # noqa: E402
from moai_recipes.train.world import join_world  # noqa: E402


def main(argv: list[str]) -> None:
    model_args = argv or ["model=smollm2_135m", "dataset=additions", "max_completion_length=16", "max_seq_len=128"]
    torch.set_num_threads(process_threads(1))
    with join_world(resolve_flavor(name="cpu", device="cpu", memory_gb=None, processes=1, device_memory_gb=None),
                    None) as world:
        _rows(model_args, world)


def _rows(model_args: list[str], world) -> None:
    print("| generation batch | KV cache predicted / measured | round predicted / measured s (spread) |")
    print("|---|---|---|")
    for batch in (4, 16, 64):
        cfg = load_config("grpo", [*model_args, "batch_size=64", "num_generations=8", "output_dir=-",
                                   f"plan.generation_batch={batch}", "logger=stdout"])
        flavor = resolve_flavor(**cfg.flavor)
        inputs = read_inputs(cfg, flavor, dry=True, output=False)
        choice = choose_plan(inputs.workload, flavor, forced={"generation_batch": batch})
        plan = choice.chosen.plan
        model = build_policy(inputs, plan, world, lora=None, seed=0)
        prompts = [inputs.data.train[i]["tokens"] for i in range(8) for _ in range(8)]
        # No stop token: every completion runs max_completion_length tokens.
        sampler = Sampler(SamplingSettings(max_completion_length=cfg.max_completion_length), (), inputs.tokenizer.pad_id,
                          plan, world.device, cfg.max_seq_len)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            samples = sampler.complete(model, prompts, list(range(len(prompts))))
            times.append(time.perf_counter() - start)
        kv, _ = rollout_bytes(plan, inputs.workload)
        predicted = choice.chosen.time.terms["rollout"]
        print(f"| {batch} | {kv:,} / {samples.kv_cache_bytes:,} | {predicted:.2f} / {statistics.median(times[1:]):.2f} "
              f"({min(times[1:]):.2f}-{max(times[1:]):.2f}) |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
