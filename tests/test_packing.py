"""Packing is a plan choice, not a change of meaning: packed or padded, any token budget, any flavor, the same
per-step losses. Run: python -m pytest tests/test_packing.py -q (the runs are marked slow: about two minutes).
"""


import pytest
import torch

from moai_recipes.models.attention import Documents
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.spec import read_spec
from moai_recipes.models.tiny import tiny_checkpoint_dir
from tests.helpers import FSDP, layout, metrics, run_recipe


def test_a_packed_row_computes_each_document_as_if_it_were_alone():
    spec = read_spec(tiny_checkpoint_dir())
    torch.manual_seed(0)
    model = build_model(spec, max_seq_len=128)
    init_buffers(model, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    docs = [torch.randint(0, spec.vocab_size, (n,)) for n in (7, 30, 1, 19)]
    packed = Documents(tuple(len(d) for d in docs))
    row = torch.cat(docs).unsqueeze(0)
    together = model(row, mask=packed, input_pos=packed.positions(row.device))[0]
    alone = torch.cat([model(d.unsqueeze(0))[0] for d in docs])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    # and the gradients: the backward of a document never reaches into its neighbours
    model(row, mask=packed, input_pos=packed.positions(row.device))[0, :7].sum().backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(docs[0].unsqueeze(0))[0].sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(first[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
def test_packed_padded_any_budget_and_flavor_give_the_same_losses(tmp_path, varied_file):
    common = ("logger=stdout", "dataset=text", f"dataset.path={varied_file}", "max_seq_len=128", "batch_size=8",
              "max_steps=5", "optimizer.lr=1e-3", "sample_max_new_tokens=0")
    runs = {"cpu padded": ("flavor=cpu", "plan.packing=false", "plan.micro_batch_size=2"),
            "cpu packed 4x128": ("flavor=cpu", "plan.packing=true", "plan.micro_batch_size=4"),
            "cpu-2 packed sharded": ("flavor=cpu-2", *FSDP, "plan.packing=true",
                                     "plan.micro_batch_size=2")}
    # Padded rows on cpu-4 run in tests/test_layouts.py; replicas in tests/test_full_finetune.py.
    losses = {}
    for name, args in runs.items():
        out = tmp_path / name.replace(" ", "_")
        r = run_recipe(*common, *args, f"output_dir={out}")
        assert r.returncode == 0, (name, r.stdout + r.stderr)
        assert layout(out) == next((k for k in ("sharded", "replicated") if k in name), "single"), name
        losses[name] = [m["loss"] for m in metrics(out)]
        assert ("packed rows" in r.stdout) == ("packed" in name), name
    reference = losses["cpu padded"]
    assert len(reference) == 5
    for name, got in losses.items():
        for a, b in zip(reference, got, strict=True):
            assert abs(a - b) <= 1e-4 * abs(a), (name, reference, got)


def test_cpu_bf16_rows_are_padded_to_a_few_sizes_and_the_loss_stays_that_of_the_real_tokens():
    """The CPU's bf16 matmuls JIT kernels for every new row count (planner/search.ROW_SIZES_PER_DOUBLING): there a row
    is padded up to one of 8 sizes per doubling; elsewhere only to the tensor degree. The padding is a document of
    ignored labels: the loss sum is the real tokens' (fp32 here, to compare exactly enough)."""
    from dataclasses import replace

    from moai_recipes.models.loss import token_loss_sum
    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan
    from moai_recipes.train.micro_batches import model_inputs
    from tests.helpers import setup

    _, spec, cpu = setup("model=tiny", "flavor=cpu")
    work = Workload(spec=spec, batch_size=8, seq_len=512, lengths=(40, 120, 300))
    assert choose_plan(replace(work, dtype="bf16"), cpu).chosen.plan.row_sizes == 8
    plan = choose_plan(work, cpu).chosen.plan
    assert plan.row_sizes == 0 and plan.padded_row(429) == 429
    _, _, gpu = setup("model=tiny", "flavor=small", "flavor.device=h100")
    assert choose_plan(replace(work, dtype="bf16"), gpu).chosen.plan.row_sizes == 0

    sized = replace(plan, row_sizes=8, packing=True)
    assert [sized.padded_row(n) for n in (1, 7, 8, 9, 255, 256, 257, 429, 512)] == [1, 7, 8, 9, 256, 256, 288, 448, 512]
    lengths = range(1, 2049)
    assert all(n <= sized.padded_row(n) <= n * 9 / 8 for n in lengths)
    assert all(sized.padded_row(n) <= sized.padded_row(n + 1) for n in lengths)  # so row_length bounds every row
    assert len({sized.padded_row(n) for n in range(300, 600)}) == 9  # 300 row counts, 9 sizes

    torch.manual_seed(0)
    samples = [{"tokens": (t := torch.randint(0, spec.vocab_size, (n,)).tolist()), "labels": t} for n in (200, 229)]
    row = model_inputs(samples, sized, pad_id=0)
    assert row["tokens"].shape == (1, 448) and row["documents"].lengths == (200, 229, 19)
    assert (row["labels"][0, 429:] == -100).all()
    model = build_model(spec, max_seq_len=sized.row_length)
    init_buffers(model, device="cpu")
    bare = model_inputs(samples, replace(sized, row_sizes=0), pad_id=0)
    assert bare["tokens"].shape == (1, 429)
    losses = [token_loss_sum(model, r["tokens"], r["labels"], documents=r["documents"]) for r in (row, bare)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
