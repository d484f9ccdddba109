"""What the weights, gradients and AdamW moments are stored in: precision=mixed|bf16 and optimizer.states.

Real runs of a small Llama on two processes (FSDP2 shards): bf16 weights, gradients and moments (torch's fused AdamW)
and int8 moments over fp32 masters (torchao's 8-bit AdamW) each learn, state their dtypes in plan.json, peak where
the planner says, and the int8 run resumes from a step checkpoint with the uninterrupted run's losses (torchao's
quantised state through DCP). The planner: the bytes each choice holds, the combinations refused by name, and the
leaner precision named (never chosen) where the user's does not fit.
Run: pytest tests/test_precision.py (about a minute and a half)
"""

import pytest

from moai_recipes.errors import UserError
from moai_recipes.planner.memory import STATE_BYTES
from moai_recipes.planner.plan import Workload
from moai_recipes.planner.search import choose_plan
from tests.helpers import make_hf_checkpoint, metrics, peak_error, plan_of, run_recipe, setup

COMMON = ["logger=stdout", "max_steps=4", "batch_size=8", "optimizer.lr=3e-3", "sample_max_new_tokens=0",
          "flavor=cpu-2", "plan.replicate=false"]
RUNS = {  # name -> (overrides, (compute, master weights, moments) in plan.json)
    "bf16": (["precision=bf16"], ("bfloat16", "bfloat16", "bfloat16")),
    "int8": (["optimizer.states=int8", "checkpoint_every=2"], ("float32", "float32", "int8")),
}


@pytest.fixture(scope="module")
def square(tmp_path_factory) -> str:
    """A Llama of 128-wide square projections (four key/value heads, an MLP as wide as the model): three parameter
    shapes where the built-in tiny model has six, and torchao's 8-bit AdamW compiles its step once per shape (about
    5 s each on two cores, in each process). Its shards still hold 8,192 values and more, which torchao keeps in 8
    bits (a tensor under 4,096 values keeps fp32 moments)."""
    folder = make_hf_checkpoint(tmp_path_factory.mktemp("square"), "llama", hidden=128, intermediate=128, kv_heads=4)
    return f"model.checkpoint_dir={folder}"


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_each_precision_learns_on_fsdp2_shards_and_its_peak_is_planned(tmp_path, name, square):
    extra, dtypes = RUNS[name]
    r = run_recipe(*COMMON, square, *extra, f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plan = plan_of(tmp_path / "run")
    assert (plan["param_dtype"], plan["master_dtype"], plan["optimizer_states"]) == dtypes and plan["sharded"]
    assert abs(peak_error(r.stdout)) <= 0.10
    losses = [row["loss"] for row in metrics(tmp_path / "run")]
    assert losses[-1] < losses[0] - 0.3, losses
    if name == "int8":  # torchao's 8-bit moments saved and loaded through DCP: the same steps 3 and 4
        resumed = tmp_path / "resumed"
        r = run_recipe(*COMMON, square, *extra, f"resume={tmp_path / 'run' / 'checkpoints' / 'step-000002'}",
                       f"output_dir={resumed}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert [row["loss"] for row in metrics(resumed)] == losses[2:]


def _work(model: str, **kwargs):
    _, spec, flavor = setup(f"model={model}", "flavor=small", "flavor.device=a100", "flavor.memory_gb=640")
    return Workload(spec=spec, batch_size=16, seq_len=2048, **kwargs), flavor


def test_the_planner_counts_each_precision_and_names_the_one_that_fits():
    """Llama-3-70B full fine-tuning on 8 x A100 80GB (torchtune's README row): nothing fits with fp32 masters and
    moments (offloaded, 1,111 GiB of the node's 1,024 GiB of host memory); the refusal names the leaner storage that
    fits, and with precision=bf16 it fits: the offloaded state in bf16."""
    mixed, flavor = _work("llama3_70b")
    with pytest.raises(UserError, match=r"With optimizer\.states=int8 \(8-bit AdamW moments\) it fits"):
        choose_plan(mixed, flavor)
    lean = choose_plan(_work("llama3_70b", precision="bf16")[0], flavor).chosen
    plan = lean.plan
    assert (plan.param_dtype, plan.master_dtype, plan.optimizer_states) == ("bfloat16", "bfloat16", "bfloat16")
    assert plan.cpu_offload and lean.fits
    total = mixed.spec.num_params()
    # Offloaded to the host: bf16 weights, bf16 gradients, two bf16 moments, a shard a process.
    assert abs(lean.host.offloaded - total * (2 + 2 + 4) / plan.shards) <= 1
    # On the device (not offloaded): the bytes each storage keeps per trained value.
    forced = {"cpu_offload": False, "micro_batch_size": 1}
    work = _work("llama3_2_1b")[0]
    for kwargs, moments, weights in ((dict(), 8, 4), (dict(states="int8"), STATE_BYTES["int8"], 4),
                                     (dict(precision="bf16"), 4, 2)):
        memory = choose_plan(_work("llama3_2_1b", **kwargs)[0], flavor, forced=forced).chosen
        n = memory.plan.shards
        assert abs(memory.memory.optimizer - work.spec.num_params() * moments / n) <= 1, kwargs
        assert memory.plan.master_dtype == ("bfloat16" if weights == 2 else "float32")


@pytest.mark.parametrize("kwargs, words", [
    (dict(precision="bf16", dtype="fp32"), "precision=bf16 stores the weights in bf16 and computes in bf16"),
    (dict(states="bf16"), r"optimizer\.states=bf16 keeps AdamW's moments in the trained weights' dtype"),
    (dict(precision="bf16", states="fp32"), r"optimizer\.states=fp32 keeps AdamW's moments"),
    (dict(precision="bf16", states="int8"), r"optimizer\.states=int8 goes with precision=mixed"),
])
def test_a_combination_that_cannot_work_is_refused_naming_why(kwargs, words):
    work, flavor = _work("llama3_2_1b", **kwargs)
    with pytest.raises(UserError, match=words):
        choose_plan(work, flavor)


def test_a_refused_precision_exits_2_with_one_line(tmp_path):
    r = run_recipe("precision=bf16", "dtype=fp32", f"output_dir={tmp_path}", module="recipes.plan")
    assert r.returncode == 2 and "precision=bf16 stores the weights in bf16" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr + r.stdout
