"""Context parallelism computes what one process computes.

Packed rows of several documents of varied lengths (up to the whole max_seq_len), each row's tokens split over 2 or
4 processes (head and tail chunks), attention over the whole row either way (ulysses: an all-to-all of the heads;
gather: the keys and values all-gathered): context 2 (ulysses; gather beside tensor 2), context 4 (the resumed run),
context 2 x data 2 (LoRA) and context 2 x tensor 2 give the per-step losses and gradient norms of flavor=cpu within 1e-5, with clipping on, full fine-tuning
and LoRA, on a grouped-query model (4 query heads, 2 key/value heads). 1e-5, not 1e-4: RoPE positions taken from
the wrong chunks (tried) move the first steps' gradient norms by 1.3e-4 to 1.2e-3 of themselves and little else. A step checkpoint of context 2 (ulysses)
resumes on context 4 (gather) with the uninterrupted run's losses. Each run states its mesh in plan.json, and the
test checks it ran that one. The planner's side: what it refuses, and what it chooses for a long row.
Run: pytest tests/test_context_parallel.py (about two minutes)
"""

import json

import pytest
import torch

from moai_recipes.errors import UserError
from moai_recipes.planner.plan import Workload
from moai_recipes.planner.search import choose_plan
from moai_recipes.train.context_parallel import share_indices, whole_row
from tests.helpers import layout, make_hf_checkpoint, metrics, model_of, plan_of, run_recipe, setup

STEPS = 4
COMMON = ["dataset=text", "max_seq_len=128", "batch_size=8", f"max_steps={STEPS}", "optimizer.lr=2e-3",
          "optimizer.warmup_steps=0", "optimizer.max_grad_norm=0.5", "logger=stdout", "sample_max_new_tokens=0",
          "plan.packing=true", "measure_memory=false"]
RECIPES = {"full": "recipes.full_finetune", "lora": "recipes.lora_finetune"}
LORA = ["lora.rank=4", "lora.apply_to_mlp=true"]


def context(degree: int, way: str) -> list[str]:
    return [f"plan.context_parallel={degree}", f"plan.context_parallel_way={way}", "plan.pipeline_stages=1"]


RESUMED = "resume=step 2 of the first run"  # replaced by that run's checkpoint folder
MESHES = {  # the mesh's plan.json name (tests.helpers.layout) -> (method, flavor, forced plan); run in this order
    "data 1 x context 2 (ulysses)": ("full", "cpu-2", [*context(2, "ulysses"), "plan.tensor_parallel=1",
                                                       "checkpoint_every=2"]),
    # With each layer's MLP in tiles and its saved input offloaded (on the CPU a copy: the same code as a GPU's
    # minus its streams).
    "data 2 x context 2 (ulysses)": ("lora", "cpu-4", [*context(2, "ulysses"), "plan.tensor_parallel=1",
                                                       "plan.recompute=full", "plan.tiled_mlp=true",
                                                       "plan.offload_activations=true"]),
    "data 1 x context 2 (gather) x tensor 2": ("full", "cpu-4", [*context(2, "gather"), "plan.tensor_parallel=2"]),
    # Each of two pipeline stages split over two context devices: the stages send each other their share's hidden
    # states, and each stage's attention meets its own context peer.
    "pipeline 2 (1f1b) x data 1 x context 2 (ulysses)": ("lora", "cpu-4", [
        "plan.context_parallel=2", "plan.context_parallel_way=ulysses", "plan.pipeline_stages=2",
        "plan.pipeline_schedule=1f1b", "plan.tensor_parallel=1"]),
    # Resumed from the first run's step 2 checkpoint: its steps 3 and 4 on another degree (context 4), the other way.
    "data 1 x context 4 (gather)": ("full", "cpu-4", [*context(4, "gather"), "plan.tensor_parallel=1", RESUMED]),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("cp") / "hf", num_layers=3, kv_heads=2)


def _run(out, method: str, *extra, checkpoint, data):
    r = run_recipe(*COMMON, *(LORA if method == "lora" else ()), f"model.checkpoint_dir={checkpoint}",
                   f"dataset.path={data}", *extra, f"output_dir={out}", module=RECIPES[method])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def one_process(checkpoint, varied_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    for method in RECIPES:
        _run(root / method, method, "flavor=cpu", checkpoint=checkpoint, data=varied_file)
    return {method: metrics(root / method) for method in RECIPES}


@pytest.fixture(scope="module")
def meshes(checkpoint, varied_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("meshes")
    step2 = f"resume={root / '0' / 'checkpoints' / 'step-000002'}"
    for i, (method, flavor, forced) in enumerate(MESHES.values()):
        _run(root / str(i), method, f"flavor={flavor}", *(step2 if a == RESUMED else a for a in forced),
             checkpoint=checkpoint, data=varied_file)
    return {mesh: root / str(i) for i, mesh in enumerate(MESHES)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_every_split_of_the_rows_gives_one_process_losses_and_gradient_norms(mesh, meshes, one_process):
    method, _, forced = MESHES[mesh]
    out = meshes[mesh]
    assert layout(out) == mesh
    ran = plan_of(out)
    for name, value in (a.removeprefix("plan.").split("=") for a in forced if a.startswith("plan.")):
        assert str(ran[name] if name != "tiled_mlp" else ran[name] > 1).lower() == value, (name, ran[name])
    expected, got = one_process[method], metrics(out)
    if RESUMED in forced:
        expected = expected[2:]
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (mesh, a["step"], key, a[key], b[key])
    assert any(r["grad_norm"] > 0.5 for r in one_process[method])  # clipping acted: its norm spans every shard


def test_the_rows_are_cut_into_head_and_tail_chunks_that_add_up_to_the_row():
    """Device c of C holds chunks c and 2C-1-c of 2C: the same number of earlier keys to attend to on every device
    (causal attention's work is even), and every place once."""
    row = 48
    for size in (2, 3, 4):
        shares = [share_indices(row, size, c) for c in range(size)]
        assert sorted(i for s in shares for i in s.tolist()) == list(range(row))
        work = [sum(i + 1 for i in s.tolist()) for s in shares]  # keys each device's queries see, causally
        assert len(set(work)) == 1, work
        tokens = torch.arange(row) * 10
        parts = torch.stack([tokens[s] for s in shares])
        assert torch.equal(whole_row(parts, dim=0), tokens)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_tiled_mlp_and_offloaded_activations_compute_what_the_whole_layer_computes(checkpoint, method):
    """Each on its own and together, under full recomputation: the loss and every gradient of the plain model (up to
    the order of the tiles' weight-gradient sums), and every layer's input went through the offload."""
    from moai_recipes.models.activation_offload import ActivationOffload
    from moai_recipes.models.hf_format import HFFolder
    from moai_recipes.models.lora import lora_options
    from moai_recipes.models.recompute import apply_recompute
    from moai_recipes.models.tiled_mlp import apply_tiled_mlp

    hf = HFFolder.open(checkpoint)
    settings = {"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": True, "apply_to_output": False, "rank": 4,
                "alpha": 8.0, "dropout": 0.0, "quantize_base": False}
    lora = lora_options(settings, spec=hf.spec) if method == "lora" else None
    tokens = torch.randint(0, hf.spec.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))

    def run(tiles: int, offload: ActivationOffload | None):
        model, _ = model_of(checkpoint, lora)
        apply_tiled_mlp(model.layers, tiles)
        apply_recompute(model.layers, "full" if tiles or offload else "none", offload)
        loss = model(tokens).float().square().mean()
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, plain_grads = run(0, None)
    for tiles, offload in ((7, None), (0, ActivationOffload()), (3, ActivationOffload())):
        loss, grads = run(tiles, offload)
        assert abs(loss.item() - plain.item()) <= 1e-7 * abs(plain.item()), (tiles, offload)
        assert grads.keys() == plain_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, plain_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        if offload:  # the input of each of the 3 layers, [4, 128, 64] in fp32
            assert offload.offloaded_bytes == 3 * 4 * 128 * 64 * 4 and not offload._waiting


def test_tiles_and_offloading_are_refused_where_they_cannot_work_and_chosen_only_where_they_are_needed():
    tiny, flavor = _planned("tiny", 256, "flavor=4xlarge")
    cases = [
        (dict(tiled_mlp=True, recompute="selective"), "under full recomputation"),
        (dict(offload_activations=True, recompute="none"), "under full recomputation"),
        (dict(tiled_mlp=True, tensor_parallel=2), "tensor parallelism cuts the MLP"),
        (dict(offload_activations=True, compile=True), "is not compiled"),
    ]
    for forced, words in cases:
        with pytest.raises(UserError, match=words):
            choose_plan(tiny, flavor, forced=forced)
    with pytest.raises(UserError, match="routes its tokens together"):
        choose_plan(*_planned("qwen3_30b_a3b", 4096, "flavor=4xlarge", batch_size=64), forced=dict(tiled_mlp=True))
    # On the CPU the host is the device: offloading is never chosen there (only run where forced), nor tiles where
    # the whole MLP fits.
    cpu = choose_plan(*_planned("tiny", 256, "flavor=cpu-2"))
    assert not any(c.plan.offload_activations for c in cpu.candidates) and not cpu.chosen.plan.tiled_mlp
    forced = choose_plan(*_planned("tiny", 256, "flavor=cpu-2"), forced=dict(offload_activations=True, tiled_mlp=True))
    assert forced.chosen.plan.offload_activations and forced.chosen.plan.tiled_mlp >= 8
    assert forced.chosen.plan.recompute == "full" and forced.chosen.memory.total == pytest.approx(
        choose_plan(*_planned("tiny", 256, "flavor=cpu-2"), forced=dict(
            recompute="full", tiled_mlp=True, micro_batch_size=forced.chosen.plan.micro_batch_size,
            packing=forced.chosen.plan.packing)).chosen.memory.total, rel=0.01)
    # A GPU node: 70B at 64K tokens fits, its samples whole, only with its activations on the host, which the node's
    # memory counts.
    work, h100 = _planned("llama3_70b", 65536, "flavor=small", "flavor.device=h100", "flavor.memory_gb=640")
    chosen = choose_plan(work, h100).chosen
    assert chosen.plan.offload_activations and chosen.host.activations > 0
    assert chosen.host.activations == pytest.approx(80 * 65536 * 8192 * 2 / chosen.plan.tensor_parallel
                                                     / chosen.plan.context_parallel, rel=0.01)
    with pytest.raises(UserError, match="nothing fits"):
        choose_plan(work, h100, forced=dict(offload_activations=False, context_parallel=1))


def test_the_gather_ways_blocks_of_queries_attend_as_each_document_does_alone(monkeypatch):
    """Blocks of 16 queries (not GATHER_BLOCK's 1,024, which the runs above never fill), within and across
    documents, against keys from their document's start: the outputs and gradients of per-document causal
    attention, for 4 query heads on 4 key/value heads and on 2 (grouped-query: torchtune hands the attention its
    keys and values expanded to the query heads, and the gather way moves the 2 heads only, as the all-gather's
    own input shows). A one-process gloo group: the gather of one is the row itself."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import moai_recipes.train.context_parallel as context_parallel
    from moai_recipes.models.attention import Documents, attend_documents

    monkeypatch.setattr(context_parallel, "GATHER_BLOCK", 16)
    gathered = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # before 2.13
    all_gather = getattr(dist, name)
    monkeypatch.setattr(dist, name, lambda out, x, group=None: (gathered.append(tuple(x.shape)),
                                                                all_gather(out, x, group=group))[1])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        share = context_parallel.ContextShare(documents=Documents((40, 7, 50, 3)), mesh=init_device_mesh("cpu", (1,)),
                                              way="gather")
        for kv_heads in (4, 2):
            g = torch.Generator().manual_seed(kv_heads)
            q = torch.randn(1, 4, 100, 8, generator=g, requires_grad=True)
            k, v = (torch.randn(1, kv_heads, 100, 8, generator=g, requires_grad=True) for _ in range(2))
            twins = [x.detach().clone().requires_grad_() for x in (q, k, v)]

            def expanded(x):  # as torchtune's attention hands them over
                return x.unsqueeze(2).expand(1, kv_heads, 4 // kv_heads, 100, 8).flatten(1, 2)

            gathered.clear()
            blocked = share.attend(q, expanded(k), expanded(v), 0.0, kv_groups=4 // kv_heads)
            whole = attend_documents(twins[0], expanded(twins[1]), expanded(twins[2]), share.documents, 0.0)
            assert gathered == [(kv_heads, 100, 16)], gathered  # k and v side by side, of the key/value heads
            torch.testing.assert_close(blocked, whole)
            grad = torch.randn(blocked.shape, generator=g)
            blocked.backward(grad)
            whole.backward(grad)
            for a, b in zip((q, k, v), twins):
                torch.testing.assert_close(a.grad, b.grad)
    finally:
        dist.destroy_process_group()


def _planned(model: str, seq_len: int, *flavor, batch_size: int = 8):
    """(the workload, the flavor) the planner gets for `model` on `flavor` (overrides)."""
    _, spec, resolved = setup(f"model={model}", *flavor)
    return Workload(spec=spec, batch_size=batch_size, seq_len=seq_len), resolved


def test_a_degree_or_way_that_cannot_split_the_rows_is_refused_naming_why():
    tiny, flavor = _planned("tiny", 256, "flavor=4xlarge")
    cases = [
        # 4 query heads over tensor 2: 2 a device, which ulysses cannot give to 4 context devices.
        (dict(context_parallel=4, context_parallel_way="ulysses", tensor_parallel=2), "gather takes any head count"),
        (dict(context_parallel=3), "must divide the flavor's 32 devices"),
        (dict(context_parallel_way="gather"), "needs plan.context_parallel of 2 or more"),
        (dict(context_parallel=2, context_parallel_way="ring"), "is not a way"),
    ]
    for forced, words in cases:
        with pytest.raises(UserError, match=words):
            choose_plan(tiny, flavor, forced=forced)
    # Qwen3.5's Gated DeltaNet carries a state from token to token: no way splits its rows.
    with pytest.raises(UserError, match="its linear_attention layers carry a state from one token to the next"):
        choose_plan(*_planned("qwen3_5_35b_a3b", 4096, "flavor=4xlarge", batch_size=64),
                    forced=dict(context_parallel=2, context_parallel_way="ulysses"))
    # A Mixture-of-Experts model's rows are split (each device routes its share; tests/test_expert_parallel.py).
    moe = choose_plan(*_planned("qwen3_30b_a3b", 4096, "flavor=4xlarge", batch_size=64),
                      forced=dict(context_parallel=2)).chosen.plan
    assert (moe.context_parallel, moe.expert_parallel > 1) == (2, True), moe.describe()
    # The gather way takes the heads ulysses cannot.
    chosen = choose_plan(tiny, flavor, forced=dict(context_parallel=4, tensor_parallel=2)).chosen.plan
    assert (chosen.context_parallel, chosen.context_parallel_way, chosen.tensor_parallel) == (4, "gather", 2)


def test_the_planner_splits_a_row_no_device_holds_and_leaves_short_rows_whole():
    """Llama-3-8B on one 8 x H100 node: 8 x 256K-token rows fit only cut (over context or tensor devices) or with their
    activations offloaded; 8 x 1M-token rows only split over context devices; 8K rows are not split (the
    data-parallel devices take whole samples, with no exchange per layer)."""
    h100 = ("flavor=small", "flavor.device=h100", "flavor.memory_gb=640")
    long = choose_plan(*_planned("llama3_8b", 262144, *h100)).chosen.plan
    assert long.context_parallel > 1 or long.tensor_parallel > 1 or long.offload_activations, long
    with pytest.raises(UserError, match="nothing fits"):
        choose_plan(*_planned("llama3_8b", 262144, *h100),
                    forced=dict(context_parallel=1, tensor_parallel=1, offload_activations=False))
    longer = choose_plan(*_planned("llama3_8b", 1 << 20, *h100)).chosen.plan
    assert longer.context_parallel > 1 and longer.packing
    with pytest.raises(UserError, match="nothing fits"):
        choose_plan(*_planned("llama3_8b", 1 << 20, *h100), forced=dict(context_parallel=1))
    assert choose_plan(*_planned("llama3_8b", 8192, *h100, batch_size=64)).chosen.plan.context_parallel == 1


def test_a_split_into_shares_under_512_tokens_is_priced_only_where_nothing_else_fits():
    """search.MIN_CONTEXT_TOKENS: 1,024-token rows over cpu-4's context devices. With room for a split in two (512
    tokens a device) no split in four (256) is priced; where nothing else fits, it is, and chosen; forced, it is
    priced like any other."""
    forced = {"recompute": "full", "tensor_parallel": 1, "packing": True}

    def plan(memory_gb: float, **more):
        work, flavor = _planned("tiny", 1024, "flavor=cpu-4", f"flavor.device_memory_gb={memory_gb}", batch_size=4)
        return choose_plan(work, flavor, forced={**forced, **more})

    roomy, tight = plan(0.013), plan(0.011)
    assert {c.plan.context_parallel for c in roomy.candidates} == {1, 2}, roomy.chosen.plan
    assert roomy.chosen.plan.context_parallel == 2 and roomy.chosen.fits
    assert not any(c.fits for c in tight.candidates if c.plan.context_parallel < 4)
    assert tight.chosen.plan.context_parallel == 4 and tight.chosen.fits, tight.chosen.plan
    assert plan(0.013, context_parallel=4).chosen.plan.context_parallel == 4


def test_longest_finds_the_longest_samples_a_flavor_trains(tmp_path):
    """recipes.plan longest=true: the longest samples that fit (a multiple of 1,024 tokens: 1,024 more do not) and
    the plan that trains them, here split over the flavor's four devices."""
    small = ("flavor=cpu-4", "flavor.device_memory_gb=0.02")
    forced = {"recompute": "full", "tensor_parallel": 1, "packing": True}  # fewer candidates to price at each length
    r = run_recipe("model=tiny", *small, "batch_size=4", "longest=true", *(f"plan.{k}={v}" for k, v in forced.items()),
                   f"output_dir={tmp_path}", module="recipes.plan", isolated=False)  # planning starts no process
    assert r.returncode == 0, r.stdout + r.stderr
    found = json.loads((tmp_path / "plan.json").read_text())
    tokens, chosen = found["longest_tokens"], found["chosen"]
    assert f"{tokens:,} tokens" in r.stdout and tokens % 1024 == 0 and chosen["max_seq_len"] == tokens
    assert chosen["context_parallel"] > 1 and chosen["fits"], chosen
    work, flavor = _planned("tiny", tokens + 1024, *small, batch_size=4)
    with pytest.raises(UserError, match="nothing fits"):
        choose_plan(work, flavor, forced=forced)
