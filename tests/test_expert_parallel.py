"""Mixture-of-Experts models on several processes: experts split over 2 and 4 of them (expert parallelism), beside
FSDP2's data parallelism, pipeline stages, tensor parallelism of the attention (each device routing its share of
the sequence) and context parallelism (each routing its share of every row), give one process's per-step losses, gradient norms
and balancing losses, full fine-tuning and LoRA on every expert, packed and padded; a run's checkpoints resume across
expert degrees (expert 2 x data 2 -> expert 4 -> one process) with the routers sending every token to two experts (the
others and their devices receive nothing). Each run's plan is asserted
from its own configuration line. Run: pytest tests/test_expert_parallel.py (about two minutes)
"""

import json
import signal
import time

import pytest
from safetensors.torch import load_file, save_file

from moai_recipes.errors import EXIT_STOPPED
from tests.helpers import make_hf_checkpoint, metrics, run_recipe, start_forked

pytestmark = pytest.mark.slow

COMMON = ["logger=stdout", "batch_size=8", "max_steps=6", "optimizer.lr=1e-3", "optimizer.warmup_steps=1",
          "sample_max_new_tokens=0", "measure_memory=false"]
PACKED, PADDED = "plan.packing=true", "plan.packing=false"
LORA = ("lora.apply_to_experts=true", "lora.apply_to_mlp=true", "lora.rank=4", "optimizer.lr=3e-3")


def skew_routers(folder):
    """Make every router of `folder` send every token to experts 0 and 1, in that order: the embedding gives each
    token a large first hidden unit, which the routers weigh alone (RMSNorm keeps it the largest by far)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, 0] = 30.0
    for name, w in tensors.items():
        if name.endswith("mlp.gate.weight"):
            w.zero_()
            w[0, 0], w[1, 0] = 4.0, 2.0
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def weighty_balancing(folder):
    """The balancing loss weighed as much as the tokens' (router_aux_loss_coef 1, not 0.001): its gradient is most of
    the norm, so a layout whose balancing gradient is wrong (counted on a share of a row's tokens, or twice) moves the
    gradient norm at once. (Compared over three steps: from the fifth on, a routing decided by a hair turns one way or
    the other between any two layouts, plain data parallelism included, and the norm follows it by 2e-4 to 5e-4.)"""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 1.0}))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"qwen3_moe": make_hf_checkpoint(root / "qwen3_moe", "qwen3_moe", num_layers=3),
            "weighty": weighty_balancing(make_hf_checkpoint(root / "weighty", "qwen3_moe", num_layers=3)),
            "skewed": skew_routers(make_hf_checkpoint(root / "skewed", "qwen3_moe", num_layers=3)),
            "mixtral": make_hf_checkpoint(root / "mixtral", "mixtral", num_layers=2)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, checkpoints):
    """The one-process run of a checkpoint (packed rows), full fine-tuning or LoRA: its metrics rows, made on first
    use."""
    made = {}

    def rows(name: str, lora: bool = False, *extra: str) -> list[dict]:
        if (name, lora, extra) not in made:
            out = tmp_path_factory.mktemp(f"ref-{name}") / "run"
            r = run_recipe(*COMMON, "flavor=cpu", PACKED, f"model.checkpoint_dir={checkpoints[name]}",
                           f"output_dir={out}", *(LORA if lora else ()), *extra, module=RECIPES[lora])
            assert r.returncode == 0, r.stdout + r.stderr
            made[name, lora, extra] = metrics(out)
        return made[name, lora, extra]

    return rows


RECIPES = {False: "recipes.full_finetune", True: "recipes.lora_finetune"}


def assert_same_numbers(expected: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got):
        for key in ("loss", "grad_norm", "aux_loss", "expert_load"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (a["step"], key, a[key], b[key])


def configuration(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("Configuration for parallelism"))


# name: (flavor, checkpoint, overrides, the layout and the recomputation the configuration line names)
LAYOUTS = {
    "expert 2 x pipeline 2, LoRA on every expert, padded": (
        "cpu-4", "qwen3_moe", ("plan.expert_parallel=2", "plan.pipeline_stages=2", "plan.pipeline_schedule=1f1b", PADDED,
                               *LORA), "num_stages 2 (1f1b), No TP, DP 2, EP 2", "recomputation none"),
    # Each row's tokens split over two context devices (ulysses): a sample's routing is the sum of its shares', its
    # balancing loss the whole sample's (weighed 1: weighty_balancing), backpropagated by each through its own share.
    # Recomputed, selectively: each layer's all-to-alls and routing run again in the backward.
    "expert 2 x context 2 (ulysses), packed, balancing loss weighed 1, recomputed": ("cpu-4", "weighty", (
        "max_steps=3", "plan.expert_parallel=2", "plan.context_parallel=2", "plan.context_parallel_way=ulysses",
        "plan.pipeline_stages=1", "plan.tensor_parallel=1", "plan.recompute=selective", PACKED),
        "num_stages 1, No TP, DP 2, EP 2, CP 2 (ulysses)", "recomputation selective"),
    "expert 2 x tensor 2, padded, recomputed": ("cpu-4", "mixtral", (
        "plan.expert_parallel=2", "plan.tensor_parallel=2", "plan.pipeline_stages=1", "plan.recompute=full", PADDED),
        "num_stages 1, TP 2, DP 2, EP 2", "recomputation full"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_gives_one_process_numbers(tmp_path, checkpoints, reference, name):
    flavor, checkpoint, overrides, layout, recomputation = LAYOUTS[name]
    out, lora = tmp_path / "run", "lora.apply_to_experts=true" in overrides
    r = run_recipe(*COMMON, f"flavor={flavor}", *overrides, f"model.checkpoint_dir={checkpoints[checkpoint]}",
                   f"output_dir={out}", module=RECIPES[lora])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{layout}," in configuration(r.stdout) and recomputation in configuration(r.stdout), configuration(r.stdout)
    steps = tuple(o for o in overrides if o.startswith("max_steps="))
    assert_same_numbers(reference(checkpoint, lora, *steps), metrics(out))


def start(*args):
    return start_forked(*COMMON, *args, env={"MOAI_FAULT_STEP_DELAY": "0.3"}, merged=True)


def stopped_after(proc, out, step: int) -> tuple[int, str]:
    """SIGTERM once `step` steps are logged; (the step it saved and stopped at, its output)."""
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < step:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_STOPPED, log
    return len((out / "metrics.jsonl").read_text().splitlines()), log


def test_a_checkpoint_resumes_across_expert_degrees(tmp_path, checkpoints, reference):
    """Expert 2 x data 2 (packed), stopped; expert 4 (padded) resumes it, stopped again; one process ends it: every
    step as the uninterrupted one-process run's. The routers send every token to experts 0 and 1, which the first
    expert device holds: the others receive nothing (and expert 4's last three devices nothing at all)."""
    out, model = tmp_path / "run", f"model.checkpoint_dir={checkpoints['skewed']}"
    first, log = stopped_after(start("flavor=cpu-4", "plan.expert_parallel=2", "plan.pipeline_stages=1",
                                     "plan.tensor_parallel=1", PACKED, model, f"output_dir={out}"), out, 2)
    assert "num_stages 1, No TP, DP 4, EP 2," in configuration(log)
    second, log = stopped_after(start("flavor=cpu-4", "plan.expert_parallel=4", PADDED, model, f"output_dir={out}"),
                                out, first + 1)
    assert "DP 4, EP 4," in configuration(log) and f"continuing at step {first + 1}" in log
    assert second < 6, "the run ended before it could be stopped"
    r = run_recipe(*COMMON, "flavor=cpu", model, f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"continuing at step {second + 1}" in r.stdout and "DP 1," in configuration(r.stdout)
    assert_same_numbers(reference("skewed"), metrics(out))
    # Every sparse layer sent every token to experts 0 and 1: each twice the mean of 8, the load 4.
    assert all(abs(row["expert_load"] - 4.0) < 1e-6 for row in metrics(out))
