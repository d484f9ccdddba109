"""Tensor and pipeline parallelism compute what one process computes.

On cpu-4 (four gloo processes) every mesh the issue names, on a Qwen3 model (per-head q/k norms), gives the per-step losses, gradient norms and the final
validation loss of flavor=cpu within 1e-4 relative, with clipping on (its norm over every shard and stage): full fine-tuning and LoRA,
packed and padded rows between them. A step checkpoint saved on pipeline 2 x data 2 resumes on data 2 x tensor 2 and
on one process with the uninterrupted run's losses, and what a pipelined, tensor-parallel model exports is byte for
byte what one process exports. Each run states its mesh in plan.json, and the test checks it ran that one.
"""

import pytest
from safetensors.torch import load_file

from tests.helpers import (instruct_rows, last_wins, layout, make_hf_checkpoint, metrics, run_recipe, tensors,
                           write_jsonl)

STEPS = 4
# Eight layers (pipeline 4 interleaved runs eight stages), four key/value heads (tensor 4 cuts them); 48 samples:
# 36 to train on (four steps of 8), 12 to validate.
COMMON = ["dataset=instruct", "batch_size=8", f"max_steps={STEPS}", "optimizer.lr=2e-3", "optimizer.warmup_steps=0",
          "optimizer.max_grad_norm=0.5", "logger=stdout", "sample_max_new_tokens=0", "max_seq_len=64",
          "dataset.val_split=0.25"]
ROWS = {"packed": "plan.packing=true", "padded": "plan.packing=false"}
PIPELINED = "pipeline 2 (1f1b) x data 2 x tensor 1"
RESUMED = "resume=step 2 of the pipelined run"  # replaced by its checkpoint's folder
MESHES = {  # the mesh's plan.json name -> (method, rows, forced plan); run in this order
    PIPELINED: ("full", "padded", ["plan.tensor_parallel=1", "plan.pipeline_stages=2", "plan.pipeline_schedule=1f1b",
                                   "checkpoint_every=2"]),
    # Resumed from the pipelined run's step 2 checkpoint: its steps 3 and 4 on another mesh.
    "pipeline 1 x data 2 x tensor 2": ("full", "padded", ["plan.tensor_parallel=2", "plan.pipeline_stages=1", RESUMED]),
    "pipeline 2 (gpipe) x data 1 x tensor 2": ("lora", "packed", ["plan.tensor_parallel=2", "plan.pipeline_stages=2",
                                                                   "plan.pipeline_schedule=gpipe"]),
    "pipeline 4 (interleaved_1f1b) x data 1 x tensor 1": ("full", "packed", [
        "plan.pipeline_stages=4", "plan.pipeline_schedule=interleaved_1f1b"]),
    "pipeline 1 x data 1 x tensor 4": ("lora", "padded", ["plan.tensor_parallel=4"]),
}

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    # Qwen3: its per-head q/k norms see a tensor device's heads, and its head_dim (32) is not hidden / heads (16).
    return {"checkpoint": make_hf_checkpoint(root / "hf", "qwen3", num_layers=8, kv_heads=4),
            "data": write_jsonl(root / "data.jsonl", instruct_rows(48))}


def _run(model, out, method: str, rows: str, *extra):
    module = "recipes.lora_finetune" if method == "lora" else "recipes.full_finetune"
    args = [f"model.checkpoint_dir={model['checkpoint']}", f"dataset.path={model['data']}", *COMMON, ROWS[rows],
            *extra, f"output_dir={out}"]
    r = run_recipe(*last_wins(*args), module=module)
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
    step2 = f"resume={root / '0' / 'checkpoints' / 'step-000002'}"
    for i, (mesh, (method, rows, forced)) in enumerate(MESHES.items()):
        _run(model, root / str(i), method, rows, "flavor=cpu-4", *(step2 if a == RESUMED else a for a in forced))
    return {mesh: root / str(i) for i, mesh in enumerate(MESHES)}


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_gives_one_process_losses_and_gradient_norms(mesh, meshes, one_process):
    method, rows, _ = MESHES[mesh]
    assert layout(meshes[mesh]) == mesh
    ref, got = one_process[method, rows], metrics(meshes[mesh])
    assert ref[-1]["loss"] < ref[0]["loss"] and len(ref) == STEPS
    if RESUMED in MESHES[mesh][2]:  # resumed after step 2 of the pipelined run, whose steps it continues
        assert [r["step"] for r in got] == [3, 4]
        ref = ref[2:]
    assert len(got) == len(ref)
    assert any(r["grad_norm"] > 0.5 for r in ref)  # clipping acted
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (mesh, [r["loss"] for r in ref], [r["loss"] for r in got])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), mesh
    # The validation loss at the end, forward only (a pipeline's schedule without its backward).
    assert abs(ref[-1]["eval_loss"] - got[-1]["eval_loss"]) <= 1e-4 * ref[-1]["eval_loss"], mesh


def test_a_pipelined_checkpoint_resumes_on_one_process(model, meshes, tmp_path):
    """Saved at step 2 of 4 on pipeline 2 x data 2, resumed on one process: steps 3 and 4 have the uninterrupted run's
    losses (and on data 2 x tensor 2: the mesh test above)."""
    source = meshes[PIPELINED]
    out = tmp_path / "resumed"
    _run(model, out, "full", "padded", "flavor=cpu", f"resume={source / 'checkpoints' / 'step-000002'}")
    assert layout(out) == "single"
    uninterrupted = [r["loss"] for r in metrics(source)][2:]
    resumed = [r["loss"] for r in metrics(out)]
    assert len(resumed) == 2
    for a, b in zip(uninterrupted, resumed):
        assert abs(a - b) <= 1e-4 * abs(a), (uninterrupted, resumed)


def test_a_cut_model_exports_what_one_process_exports(model, tmp_path):
    """A LoRA trained one step (its B no longer zero) and saved; its checkpoint resumed with no step left, on one
    process and on pipeline 2 x tensor 2: the adapter the cut model gathers (each weight whole among its stage's
    tensor devices, then sent from its stage to rank 0) and the model it merges (B.A added to each cut weight) are
    byte for byte those of one process."""
    trained = tmp_path / "trained"
    _run(model, trained, "lora", "packed", "flavor=cpu", "max_steps=2", "checkpoint_every=1")
    outs = {}
    for flavor, forced in (("cpu", []), ("cpu-4", ["plan.tensor_parallel=2", "plan.pipeline_stages=2",
                                                    "plan.pipeline_schedule=1f1b"])):
        outs[flavor] = tmp_path / flavor
        _run(model, outs[flavor], "lora", "packed", f"flavor={flavor}", *forced,
             f"resume={trained / 'checkpoints' / 'step-000001'}", "max_steps=1")
    assert layout(outs["cpu-4"]) == "pipeline 2 (1f1b) x data 1 x tensor 2"
    adapter = load_file(outs["cpu"] / "adapter" / "adapter_model.safetensors")
    trained_b = [k for k in adapter if "lora_B" in k]
    assert trained_b and all(adapter[k].abs().max() > 0 for k in trained_b)  # merged: B.A is not zero
    base, merged, q = tensors(model["checkpoint"]), tensors(outs["cpu"] / "model"), "model.layers.0.self_attn.q_proj.weight"
    assert merged[q].dtype == base[q].dtype and not merged[q].equal(base[q])
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = (load_file(outs[f] / name) for f in ("cpu", "cpu-4"))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), name
        assert (outs["cpu"] / name).read_bytes() == (outs["cpu-4"] / name).read_bytes(), name


def test_a_tied_model_is_cut_over_its_vocabulary_and_its_stages_keep_one_weight(model, tmp_path):
    """tie_word_embeddings under tensor parallelism: one weight, cut over the vocabulary, is the embedding and the
    output projection of tensor 2 x data 2; under pipeline stages (2 x data 2, and 2 x tensor 2) the last stage holds a
    copy of the first's embedding, their gradients summed, the copy counted once in the norm. Each computes the per-step losses
    and gradient norms of one process (clipping on), and the pipelined run's step checkpoint resumes on one process
    with the uninterrupted run's losses."""
    tied = {"checkpoint": make_hf_checkpoint(tmp_path / "hf", "qwen3", tie=True, num_layers=2, kv_heads=4),
            "data": model["data"]}
    runs = {}
    meshes = {"cpu": ("single", []),
              "tensor": ("pipeline 1 x data 2 x tensor 2", ["plan.tensor_parallel=2", "plan.pipeline_stages=1"]),
              "pipeline": ("pipeline 2 (1f1b) x data 2 x tensor 1", [
                  "plan.tensor_parallel=1", "plan.pipeline_stages=2", "plan.pipeline_schedule=1f1b",
                  "checkpoint_every=2"]),
              # The first stage's vocabulary-cut embedding gets its gradient whole, cut before the pair sums it.
              "pipeline x tensor": ("pipeline 2 (gpipe) x data 1 x tensor 2", [
                  "plan.tensor_parallel=2", "plan.pipeline_stages=2", "plan.pipeline_schedule=gpipe"])}
    for name, (mesh, forced) in meshes.items():
        flavor = "cpu" if name == "cpu" else "cpu-4"
        _run(tied, tmp_path / name, "full", "packed", f"flavor={flavor}", "max_steps=3", *forced)
        assert layout(tmp_path / name) == mesh
        runs[name] = metrics(tmp_path / name)
    assert len(runs["cpu"]) == 3 and any(r["grad_norm"] > 0.5 for r in runs["cpu"])  # clipping acted
    for name in ("tensor", "pipeline", "pipeline x tensor"):
        for a, b in zip(runs["cpu"], runs[name], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), (name, key, a, b)
    resumed = tmp_path / "resumed"
    _run(tied, resumed, "full", "packed", "flavor=cpu", "max_steps=3",
         f"resume={tmp_path / 'pipeline' / 'checkpoints' / 'step-000002'}")
    assert [r["step"] for r in metrics(resumed)] == [3]
    assert abs(metrics(resumed)[0]["loss"] - runs["pipeline"][2]["loss"]) <= 1e-4 * runs["pipeline"][2]["loss"]


@pytest.mark.parametrize("forced, message", [
    (["plan.tensor_parallel=4"], "plan.tensor_parallel=4 cannot cut this model: num_key_value_heads=2 does not divide "
                                 "by 4. Degrees that can: 1, 2"),
    (["plan.tensor_parallel=3"], "plan.tensor_parallel=3 must divide the flavor's 4 devices"),
    (["plan.pipeline_stages=4", "plan.pipeline_schedule=interleaved_1f1b"],
     "plan.pipeline_stages=4 cannot cut this model: 8 stages need at least as many layers, and the model has 4"),
    (["plan.pipeline_schedule=zigzag"], "plan.pipeline_schedule=zigzag is not a schedule; valid: gpipe, 1f1b, "
                                        "interleaved_1f1b"),
])
def test_a_degree_that_cannot_cut_the_model_is_refused_by_name(forced, message):
    r = run_recipe("flavor=cpu-4", "model=tiny", *forced, module="recipes.plan", isolated=False)  # 4 layers, 2 kv heads
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_layers_are_split_by_cost_and_the_last_stage_holds_the_head():
    from moai_recipes.planner.layouts import split_layers
    from tests.helpers import setup

    spec = setup("model=llama3_8b")[1]  # a 128K vocabulary: the output projection weighs 2.4 layers
    split = split_layers(spec, 4)
    assert sum(split) == 32 and split[-1] < split[0], split
    assert split_layers(spec, 32) == (1,) * 32


def test_the_planner_cuts_a_70b_model_where_that_is_faster():
    """48xlarge (384 MI250 devices): tensor parallelism inside a node beats FSDP2 alone, which all-gathers the whole
    model for every micro-batch over the links between nodes; both predicted."""
    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan
    from tests.helpers import setup

    _, spec, flavor = setup("model=llama3_70b", "flavor=48xlarge")
    work = Workload(spec=spec, batch_size=512, seq_len=4096)
    chosen = choose_plan(work, flavor).chosen
    alone = choose_plan(work, flavor, forced={"tensor_parallel": 1, "pipeline_stages": 1, "context_parallel": 1}).chosen
    assert 1 < chosen.plan.tensor_parallel <= flavor.device.per_node
    assert chosen.time.total_s < 0.8 * alone.time.total_s
    assert "TP 8" in chosen.plan.describe() and "num_stages" in chosen.plan.describe()
