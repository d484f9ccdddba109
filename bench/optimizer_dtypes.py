"""The optimizer step's time by storage, on this CPU, against the planner's `optimizer` share of a step
(planner/timing.optimizer_s at the measured memory bandwidth; int8: INT8_STEP_S_PER_VALUE, fitted here): SmolLM2-135M's parameters with random
gradients, torch's fused AdamW over fp32 and over bf16 weights and moments, torchao's 8-bit AdamW over fp32 masters.
Clipping's passes (measured beside: the norm and the scaling) are part of what the planner counts.

Run: python bench/optimizer_dtypes.py   (about two minutes; the int8 step compiles first)
"""

import statistics
import time
from types import SimpleNamespace

import torch

from moai_recipes.planner.cpu_speed import process_threads
from moai_recipes.planner.timing import BANDWIDTH_EFFICIENCY, device_speed, optimizer_s
from moai_recipes.flavors import resolve_flavor
from moai_recipes.train.optim import build_optimizer, clip_gradients

SHAPES = [(49152, 576)] + [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536),
                           (576,), (576,)] * 30 + [(576,)]  # SmolLM2-135M: tied embedding, 30 layers, final norm
SETTINGS = SimpleNamespace(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
CHOICES = {"fp32 (precision=mixed)": ("float32", "float32"), "bf16 (precision=bf16)": ("bfloat16", "bfloat16"),
           "int8 moments (fp32 masters)": ("float32", "int8")}


def main() -> None:
    flavor = resolve_flavor(name="cpu", device="cpu", memory_gb=None, processes=1, device_memory_gb=None)
    torch.set_num_threads(process_threads(1))
    _, bandwidth = device_speed(flavor.device, compute_dtype="float32", num_devices=1)
    speed = bandwidth * BANDWIDTH_EFFICIENCY["cpu"]
    print("| storage | measured s/step (median of 10, spread) | predicted s |")
    print("|---|---|---|")
    for name, (master, states) in CHOICES.items():
        dtype = getattr(torch, master)
        params = [torch.nn.Parameter(torch.randn(s, dtype=dtype) * 0.02) for s in SHAPES]
        plan = SimpleNamespace(master_dtype=master, optimizer_states=states)
        optimizer = build_optimizer(params, SETTINGS, plan)
        model = torch.nn.Module()
        model.params = torch.nn.ParameterList(params)
        times = []
        for step in range(13):
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            start = time.perf_counter()
            clip_gradients(model, 1.0)
            optimizer.step()
            times.append(time.perf_counter() - start)
        steady = times[3:]
        n = sum(p.numel() for p in params)
        predicted = optimizer_s(plan, "cpu", n, speed)
        print(f"| {name} | {statistics.median(steady):.3f} ({min(steady):.3f}-{max(steady):.3f}) | {predicted:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
