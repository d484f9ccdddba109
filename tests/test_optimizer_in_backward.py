"""AdamW in the backward (plan.optimizer_in_backward): each weight updated as soon as its gradient of the step is
complete, the gradient freed (train/optimizer_in_backward.py).

Real runs of the tiny model: with and without it, the same losses step for step and gradient norms within float
summation order, on one process (a plain fp32 module; a bf16 one computing on copies of its fp32 masters, where the
master's gradient is not autograd's), on two (FSDP2 shards, its sharded gradients), and with torchao's 8-bit AdamW
(LoRA); equal losses alone cannot tell it from step() after the backward, so a run also says what its backward
applied (`applied_in_backward`, all of it) and MemTracker measures the peak it saves. A step with one gradient not
finite, the others applied already, is redone from the last checkpoint and skipped whole, as after the backward. A run with it resumes from a step checkpoint, with it and without it (its state_dict is one AdamW's), to the
uninterrupted run's losses. The planner: offered only where nothing clips, with one micro-batch a step; the peak it
saves is the gradients'; refused by name where it cannot work.
Run: pytest tests/test_optimizer_in_backward.py (about two minutes)
"""

import pytest
import torch

from moai_recipes.errors import UserError
from moai_recipes.planner.plan import Workload
from moai_recipes.planner.search import choose_plan
from tests.helpers import metrics, plan_of, run_recipe, setup

COMMON = ["logger=stdout", "max_steps=4", "batch_size=8", "optimizer.lr=3e-3", "sample_max_new_tokens=0",
          "optimizer.max_grad_norm=null"]
RUNS = {  # name -> (recipe, overrides)
    "fp32, one process": ("recipes.full_finetune", ["flavor=cpu"]),
    "bf16 copies, one process": ("recipes.full_finetune", ["flavor=cpu", "dtype=bf16"]),
    "FSDP2, two processes": ("recipes.full_finetune", ["flavor=cpu-2", "plan.replicate=false"]),
    # Rank 32 on q_proj: its A (32 x 128) and B (128 x 32) hold 4,096 values each, the fewest torchao keeps in 8 bits
    # (at the default rank every adapter matrix kept fp32 moments); two shapes, each a compile of torchao's step.
    "LoRA, int8 AdamW": ("recipes.lora_finetune", ["flavor=cpu", "optimizer.states=int8", "lora.rank=32",
                                                   "lora.alpha=64", "lora.attn_modules=[q_proj]"]),
}


def _run(tmp_path, name: str, in_backward: bool, *extra: str, env: dict | None = None, said: list | None = None):
    module, overrides = RUNS[name]
    out = tmp_path / f"{in_backward}"
    r = run_recipe(*COMMON, *overrides, f"plan.optimizer_in_backward={str(in_backward).lower()}", *extra,
                   f"output_dir={out}", module=module, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert plan_of(out)["optimizer_in_backward"] is in_backward
    if said is not None:
        said.append(r.stdout)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_the_same_losses_as_one_step_after_the_backward(tmp_path, name):
    runs = [metrics(_run(tmp_path, name, b)) for b in (False, True)]
    assert [row["loss"] for row in runs[1]] == pytest.approx([row["loss"] for row in runs[0]], rel=1e-6, abs=0)
    assert [row["grad_norm"] for row in runs[1]] == pytest.approx([row["grad_norm"] for row in runs[0]], rel=1e-5)
    assert runs[1][-1]["loss"] < runs[1][0]["loss"]


@pytest.mark.slow
def test_a_run_with_it_resumes_with_it_and_without_it(tmp_path):
    whole = _run(tmp_path, "fp32, one process", True, "checkpoint_every=2")
    losses = [row["loss"] for row in metrics(whole)]
    step2 = whole / "checkpoints" / "step-000002"
    for again in (True, False):  # the checkpoint holds one AdamW's state: either way reads it
        out = tmp_path / f"resumed-{again}"
        r = run_recipe(*COMMON, "flavor=cpu", f"plan.optimizer_in_backward={str(again).lower()}", f"resume={step2}",
                       f"output_dir={out}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert [row["loss"] for row in metrics(out)] == pytest.approx(losses[2:], rel=1e-6, abs=0), again


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32, one process", "FSDP2, two processes"])
def test_a_step_with_one_gradient_not_finite_is_skipped_whole_as_after_the_backward(tmp_path, name):
    """MOAI_FAULT_NAN_STEP=3: step 3's gradient is NaN at the token embeddings and finite everywhere else, so the
    optimizer in the backward has applied every other weight's when it meets the bad one, where a step after the
    backward applies none. The run goes back to its step-2 checkpoint and redoes step 3 skipped whole (one process:
    by itself; two: their launcher starts them again): every step's loss and the weights written are those of the run
    that steps after the backward. Without the redo, step 4's loss is 3% off (checked)."""
    from tests.helpers import tensors

    fault = {"MOAI_FAULT_NAN_STEP": "3"}
    said, runs = [], {}
    for b in (False, True):
        runs[b] = _run(tmp_path, name, b, "checkpoint_every=2", "skip_nonfinite_steps=1", env=fault, said=said)
    rows = {b: metrics(out) for b, out in runs.items()}
    assert [row["step"] for row in rows[True]] == [1, 2, 3, 4]
    assert [row["skipped"] for row in rows[True]] == [row["skipped"] for row in rows[False]] == [
        False, False, True, False]
    assert "to redo the steps since, this one skipped whole" in said[1] and "step 3" in said[1]
    assert [row["loss"] for row in rows[True]] == pytest.approx([row["loss"] for row in rows[False]], rel=1e-6,
                                                                 abs=0)
    after, before = tensors(runs[True] / "model"), tensors(runs[False] / "model")
    for key in before:
        assert torch.allclose(after[key], before[key], rtol=0, atol=1e-6), key


def _work(model: str = "llama3_2_3b", seq_len: int = 4096, **kwargs):
    _, spec, flavor = setup(f"model={model}", "flavor=small", "flavor.device=a100", "flavor.memory_gb=80")
    return Workload(spec=spec, batch_size=2, seq_len=seq_len, precision="bf16", **kwargs), flavor


def test_the_planner_offers_it_where_nothing_clips_and_counts_the_gradients_it_frees():
    """Llama-3.2-3B on one A100 in bf16, short rows (2 x 256 tokens) under full recomputation: the step's peak is its
    gradients' (the last layers' backward, or the optimizer's step), which the optimizer in the backward frees as it
    goes: a layer's at a time, not the model's 6.4 GB. (On torchtune's 4,096-token rows the peak is the
    activations' and it saves little: 24.9 -> 23.1 GiB in torchtune's README.)"""
    forced = {"recompute": "full", "packing": True, "micro_batch_size": 2, "chunked_loss": True}
    clipped, flavor = _work(seq_len=256)
    assert not any(c.plan.optimizer_in_backward for c in choose_plan(clipped, flavor, forced=forced).candidates)
    free = _work(seq_len=256, clips=False)[0]
    choice = choose_plan(free, flavor, forced=forced)
    by = {c.plan.optimizer_in_backward: c for c in choice.candidates if not c.plan.cpu_offload and not c.plan.compile
          and not c.plan.offload_activations}
    gradients = free.spec.num_params() * 2  # bf16
    assert by[False].memory.grads > 0.75 * gradients and by[False].memory.phase == "first layer backward"
    assert by[True].memory.grads <= 2 * gradients / free.spec.num_layers  # a layer's: the peak moves elsewhere
    assert by[True].memory.total < by[False].memory.total
    # Several micro-batches a step hold the earlier ones' gradients as without it: not offered unless forced.
    many = choose_plan(free, flavor, forced={"micro_batch_size": 1, "packing": False}).candidates
    assert not any(c.plan.optimizer_in_backward for c in many)


@pytest.mark.parametrize("kwargs, forced, words", [
    (dict(), {"optimizer_in_backward": True}, r"set optimizer\.max_grad_norm=null"),
    (dict(clips=False, reference="copy"), {"optimizer_in_backward": True}, r"recipes\.dpo runs its own step"),
    (dict(clips=False), {"optimizer_in_backward": True, "cpu_offload": True}, r"pipeline stages, replicas or CPU"),
])
def test_it_is_refused_by_name_where_it_cannot_work(kwargs, forced, words):
    work, flavor = _work(**kwargs)
    with pytest.raises(UserError, match=r"plan\.optimizer_in_backward=true: .*" + words):
        choose_plan(work, flavor, forced=forced)


@pytest.mark.slow
def test_it_applies_each_weight_in_the_backward_and_the_peak_falls_by_the_gradients_it_frees(tmp_path):
    """Observed, not inferred from equal losses (which step() after the backward would give as well): every step of
    the run with it says that the backward applied all of its trainable tensors (`applied_in_backward` 1.0), and
    PyTorch's MemTracker measures the peak fall by about half the model's gradients on a model whose step peaks at
    them (four layers of 256, rows of 32 tokens: weights, AdamW's moments and gradients; measured 42.6 -> 37.5 MB
    for 10.8 MB of gradients), each peak as the planner predicts it within 10%."""
    import re

    from tests.helpers import make_hf_checkpoint

    checkpoint = make_hf_checkpoint(tmp_path / "hf", hidden=256, num_layers=4)
    peaks, rows = {}, {}
    for in_backward in (False, True):
        out = tmp_path / str(in_backward)
        r = run_recipe(*COMMON, "max_steps=3", "batch_size=2", "max_seq_len=32", "flavor=cpu",
                       f"model.checkpoint_dir={checkpoint}", f"plan.optimizer_in_backward={str(in_backward).lower()}",
                       f"output_dir={out}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        off = re.search(r"Peak tensor memory per device: predicted [\d.]+ GiB, measured [\d.]+ GiB \(([-+][\d.]+)%\)",
                        r.stdout)
        assert off and abs(float(off.group(1))) <= 10, r.stdout[-2000:]
        rows[in_backward] = metrics(out)
        peaks[in_backward] = max(row["peak_memory_bytes"] for row in rows[in_backward])
    assert all(row["applied_in_backward"] == 1.0 for row in rows[True]) and len(rows[True]) == 3
    assert not any("applied_in_backward" in row for row in rows[False])
    gradients = 4 * 2.7e6  # fp32, the model's 2.7M parameters
    assert peaks[False] - peaks[True] >= 0.4 * gradients, peaks
