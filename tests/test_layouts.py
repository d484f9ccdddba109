"""Tensor and pipeline parallelism compute what one process computes.

On cpu-4 (four gloo processes) every mesh the issue names gives the per-step losses and gradient norms of
flavor=cpu within 1e-4 relative, with clipping on (its norm over every shard and stage): full fine-tuning and LoRA,
packed and padded rows between them. A step checkpoint saved on pipeline 2 x data 2 resumes on one process and on
tensor 2 x data 2 with the uninterrupted run's losses, and what a cut model exports is byte for byte what one
process exports. Each run states its mesh in plan.json, and the test checks it ran that one.
"""

import pytest
from safetensors.torch import load_file

from tests.helpers import instruct_rows, layout, make_hf_checkpoint, metrics, run_recipe, write_jsonl

STEPS = 4
# Eight layers (pipeline 4 interleaved runs eight stages), four key/value heads (tensor 4 cuts them).
COMMON = ["dataset=instruct", "batch_size=8", f"max_steps={STEPS}", "optimizer.lr=2e-3", "optimizer.warmup_steps=0",
          "optimizer.max_grad_norm=0.5", "logger=stdout", "sample_max_new_tokens=0", "max_seq_len=64"]
ROWS = {"packed": "plan.packing=true", "padded": "plan.packing=false"}
MESHES = {  # the mesh's plan.json name -> (method, rows, forced plan)
    "pipeline 1 x data 2 x tensor 2": ("full", "packed", ["plan.tensor_parallel=2", "plan.pipeline_stages=1"]),
    "pipeline 2 (1f1b) x data 2 x tensor 1": ("full", "padded", ["plan.tensor_parallel=1", "plan.pipeline_stages=2",
                                                                  "plan.pipeline_schedule=1f1b", "checkpoint_every=2"]),
    "pipeline 2 (gpipe) x data 1 x tensor 2": ("lora", "packed", ["plan.tensor_parallel=2", "plan.pipeline_stages=2",
                                                                   "plan.pipeline_schedule=gpipe"]),
    "pipeline 4 (interleaved_1f1b) x data 1 x tensor 1": ("full", "packed", [
        "plan.pipeline_stages=4", "plan.pipeline_schedule=interleaved_1f1b"]),
    "pipeline 1 x data 1 x tensor 4": ("lora", "padded", ["plan.tensor_parallel=4"]),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {"checkpoint": make_hf_checkpoint(root / "hf", num_layers=8, kv_heads=4),
            "data": write_jsonl(root / "data.jsonl", instruct_rows(32))}


def _run(model, out, method: str, rows: str, *extra):
    module = "recipes.lora_finetune" if method == "lora" else "recipes.full_finetune"
    args = [f"model.checkpoint_dir={model['checkpoint']}", f"dataset.path={model['data']}", *COMMON, ROWS[rows],
            *extra, f"output_dir={out}"]
    r = run_recipe(*{a.split("=")[0]: a for a in args}.values(), module=module)  # a later value of a key wins
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def one_process(model, tmp_path_factory):
    """flavor=cpu's losses and gradient norms for each method and kind of rows."""
    root = tmp_path_factory.mktemp("one")
    out = {}
    for method in ("full", "lora"):
        for rows in ROWS:
            _run(model, root / f"{method}-{rows}", method, rows, "flavor=cpu")
            out[method, rows] = metrics(root / f"{method}-{rows}")
    return out


@pytest.fixture(scope="module")
def meshes(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("meshes")
    for i, (mesh, (method, rows, forced)) in enumerate(MESHES.items()):
        _run(model, root / str(i), method, rows, "flavor=cpu-4", *forced)
    return {mesh: root / str(i) for i, mesh in enumerate(MESHES)}


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_gives_one_process_losses_and_gradient_norms(mesh, meshes, one_process):
    method, rows, _ = MESHES[mesh]
    assert layout(meshes[mesh]) == mesh
    ref, got = one_process[method, rows], metrics(meshes[mesh])
    assert len(got) == STEPS and ref[-1]["loss"] < ref[0]["loss"]
    assert any(r["grad_norm"] > 0.5 for r in ref)  # clipping acted
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (mesh, [r["loss"] for r in ref], [r["loss"] for r in got])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), mesh


@pytest.mark.parametrize("flavor, forced", [("cpu", []), ("cpu-4", ["plan.tensor_parallel=2", "plan.pipeline_stages=1"])])
def test_a_pipelined_checkpoint_resumes_on_another_mesh(flavor, forced, model, meshes, tmp_path):
    """Saved at step 2 of 4 on pipeline 2 x data 2; resumed on one process, or on data 2 x tensor 2: steps 3 and 4
    have the uninterrupted run's losses."""
    source = meshes["pipeline 2 (1f1b) x data 2 x tensor 1"]
    out = tmp_path / "resumed"
    _run(model, out, "full", "padded", f"flavor={flavor}", *forced, f"resume={source / 'checkpoints' / 'step-000002'}")
    assert layout(out) == ("single" if flavor == "cpu" else "pipeline 1 x data 2 x tensor 2")
    uninterrupted = [r["loss"] for r in metrics(source)][2:]
    resumed = [r["loss"] for r in metrics(out)]
    assert len(resumed) == 2
    for a, b in zip(uninterrupted, resumed):
        assert abs(a - b) <= 1e-4 * abs(a), (uninterrupted, resumed)


def test_a_cut_model_exports_what_one_process_exports(model, tmp_path):
    """No step learns anything (lr 0): the merged model and the adapter a pipeline 2 x tensor 2 LoRA run writes
    are byte for byte those of one process."""
    outs = {}
    for flavor, forced in (("cpu", []), ("cpu-4", ["plan.tensor_parallel=2", "plan.pipeline_stages=2",
                                                    "plan.pipeline_schedule=1f1b"])):
        outs[flavor] = tmp_path / flavor
        _run(model, outs[flavor], "lora", "packed", f"flavor={flavor}", *forced, "optimizer.lr=0", "max_steps=1")
    assert layout(outs["cpu-4"]) == "pipeline 2 (1f1b) x data 1 x tensor 2"
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = (load_file(outs[f] / name) for f in ("cpu", "cpu-4"))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), name
        assert (outs["cpu"] / name).read_bytes() == (outs["cpu-4"] / name).read_bytes(), name
