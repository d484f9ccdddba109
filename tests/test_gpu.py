"""The device paths, on a GPU (marked `gpu`; without a CUDA or ROCm device they skip): what scripts/gpu_check.py runs
as `pytest -m gpu` on a lent machine, beside its report. Written before any GPU has run them.
- each of the check's kernels against its fp32 reference in bf16 (the experts' grouped product, varlen flash
  attention on packed rows, fused and 8-bit AdamW, NF4 and LoRA on it, compile, activation offload's side stream);
- a run whose state is offloaded to the host trains on NCCL, its gradient norm reduced over the gloo group beside it
  (train/world.py starts cuda:nccl,cpu:gloo), and writes its model;
- packed rows train with the varlen kernel as padded rows do: the same losses.
Run: python -m pytest -m gpu tests/test_gpu.py"""

import pytest
import torch

from scripts.gpu_check import CHECKS, run_check
from tests.helpers import metrics, plan_of, run_recipe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")]


def _flavor() -> list[str]:
    """One device of the lent card, as the planner knows it."""
    name = torch.cuda.get_device_name().lower()
    kind = "h200" if "h200" in name else "a100" if "a100" in name else "h100"
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9
    return ["flavor=small", f"flavor.device={kind}", f"flavor.memory_gb={memory:.0f}"]


@pytest.mark.parametrize("check", CHECKS, ids=lambda fn: fn.__name__.removeprefix("check_"))
def test_a_device_kernel_matches_its_reference(check):
    result = run_check(check, torch.device("cuda"), torch.bfloat16, 2e-2)
    assert result["ok"], result


def test_state_offloaded_to_the_host_trains_on_nccl_with_its_norm_over_gloo(tmp_path):
    out = tmp_path / "offloaded"
    r = run_recipe(*_flavor(), "dtype=bf16", "plan.cpu_offload=true", "plan.replicate=false", "max_steps=3",
                   "batch_size=8", "logger=stdout", "sample_max_new_tokens=0", f"output_dir={out}", isolated=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert plan_of(out)["cpu_offload"] is True
    rows = metrics(out)
    assert len(rows) == 3 and all(row["grad_norm"] > 0 for row in rows), rows
    assert (out / "model").is_dir()


def test_packed_rows_train_with_the_varlen_kernel_as_padded_rows_do(tmp_path):
    losses = {}
    for packing in ("true", "false"):
        out = tmp_path / f"packing-{packing}"
        r = run_recipe(*_flavor(), "dtype=bf16", f"plan.packing={packing}", "max_steps=3", "batch_size=8",
                       "logger=stdout", "sample_max_new_tokens=0", f"output_dir={out}", isolated=True)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert plan_of(out)["packing"] is (packing == "true")
        losses[packing] = [row["loss"] for row in metrics(out)]
    assert losses["true"] == pytest.approx(losses["false"], rel=2e-2)  # bf16: the kernels' orders differ
