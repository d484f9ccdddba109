"""An out-of-memory step is redone with the next smaller plan: the same global batch, the same losses.
The error is injected (MOAI_FAULT_OOM_TOKENS: any micro-batch of more tokens runs out of memory, as a smaller
device would). Run: pytest tests/test_out_of_memory.py"""

import json

import pytest

from tests.test_full_finetune import metrics, run_recipe

pytestmark = pytest.mark.slow

# Samples cut to 32 tokens, 8 a step, padded: one micro-batch of 8 x 32 = 256 tokens is the fastest plan, and
# with more than 64 tokens out of memory, micro-batches of 2 or 1 rows are what fits.
COMMON = ["logger=stdout", "max_steps=4", "batch_size=8", "max_seq_len=32", "plan.packing=false",
          "optimizer.lr=3e-3", "sample_max_new_tokens=0"]


def test_an_out_of_memory_step_runs_again_smaller_with_the_same_losses(tmp_path):
    ref = run_recipe(*COMMON, "flavor=cpu", f"output_dir={tmp_path / 'ref'}")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    planned = json.loads((tmp_path / "ref" / "plan.json").read_text())["chosen"]
    assert planned["micro_batch_size"] * 32 > 64  # the plan the fault will hit

    r = run_recipe(*COMMON, "flavor=cpu", f"output_dir={tmp_path / 'oom'}", env={"MOAI_FAULT_OOM_TOKENS": "64"})
    assert r.returncode == 0, r.stdout + r.stderr
    # Step 1 runs again with smaller plans until one fits; the later steps keep it.
    plan = json.loads((tmp_path / "oom" / "plan.json").read_text())
    changes = plan["changes"]
    assert r.stdout.count("ran out of memory") == len(changes) and "Step 1 ran out of memory" in r.stdout
    assert [c["step"] for c in changes] == [1] * len(changes)
    assert changes[0]["from"]["micro_batch_size"] == planned["micro_batch_size"]
    sizes = [c["to"]["micro_batch_size"] for c in changes]
    assert sizes[-1] * 32 <= 64 and all(size * 32 > 64 for size in sizes[:-1])  # each redone until one fits
    assert plan["chosen"]["micro_batch_size"] == sizes[-1]
    for a, b in zip(metrics(tmp_path / "ref"), metrics(tmp_path / "oom"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], (a, b)


def test_on_several_processes_it_stops_naming_the_plan_to_force(tmp_path):
    r = run_recipe(*COMMON, "flavor=cpu-2", f"output_dir={tmp_path / 'run'}", env={"MOAI_FAULT_OOM_TOKENS": "16"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "step 1: out of memory" in r.stderr and "2 processes cannot redo a step together" in r.stderr
    assert "plan.micro_batch_size=" in r.stderr or "plan.recompute=full" in r.stderr
    assert "Traceback" not in r.stderr
