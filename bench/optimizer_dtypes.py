"""The optimizer step's time by storage, on this CPU, against the planner's `optimizer` share of a step
(planner/timing.optimizer_s at the measured memory bandwidth; int8: INT8_STEP_S_PER_VALUE, fitted here): SmolLM2-135M's parameters with random
gradients, torch's fused AdamW over fp32 and over bf16 weights and moments, torchao's 8-bit AdamW over fp32 masters.
Clipping's passes (measured beside: the norm and the scaling) are part of what the planner counts.

Run: python bench/optimizer_dtypes.py   (about two minutes; the int8 step compiles first)

    python bench/optimizer_dtypes.py --in-backward

measures instead what the optimizer in the backward (train/optimizer_in_backward.py) adds a tensor: a stack of 100
linear layers (200 tensors), a step of a forward, a backward and the step, with one AdamW over all the parameters
and with each applied in the backward (timing.IN_BACKWARD_PARAM_S); alternating, medians of 20 steps.
"""

import statistics
import sys
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


def in_backward(rounds: int = 3, layers: int = 100, width: int = 64) -> None:
    torch.set_num_threads(process_threads(1))

    def step_s(in_bwd: bool) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        plan = SimpleNamespace(optimizer_in_backward=in_bwd, optimizer_states="float32", master_dtype="float32")
        optimizer = build_optimizer(model.parameters(), SETTINGS, plan)
        x, times = torch.randn(32, width), []
        for _ in range(25):
            start = time.perf_counter()
            optimizer.armed = True  # the loop arms it before a step's last micro-batch
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return statistics.median(times[5:])

    for r in range(rounds):
        plain, applied = step_s(False), step_s(True)
        print(f"round {r + 1}: one AdamW {plain * 1e3:.2f} ms, in the backward {applied * 1e3:.2f} ms a step: "
              f"{(applied - plain) / (2 * layers) * 1e6:.0f} us more a tensor", flush=True)


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
    in_backward() if "--in-backward" in sys.argv else main()
