"""Compiled layers (plan.compile=true) train exactly as eager ones: the same per-step losses to 1e-4, and dynamo's
own counter says it captured graphs (the run's last lines report it).
Run: python -m pytest tests/test_compile.py -q (slow: each of its two graphs compiles cold, half a minute or more on
2 cores)."""

import re

import pytest

from moai_recipes.errors import UserError
from moai_recipes.planner.plan import Workload
from moai_recipes.planner.search import choose_plan
from tests.helpers import FSDP, layout, metrics, run_recipe, setup, write_varied_text


@pytest.fixture
def uneven_file(tmp_path):
    """Plain text of a few to a hundred-odd tokens a sample, whose batches of 8 the two ranks of cpu-2 pack into
    unequal numbers of rows of 128 tokens at steps 3 and 4 (3 against 4, 2 against 3)."""
    words = "the quick brown fox jumps over a lazy dog and then runs far away into night".split()
    return write_varied_text(tmp_path / "uneven.jsonl", words)


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones(tmp_path, uneven_file):
    # What a compiled layer meets with LoRA's adapters: selective recomputation (inside the graph), and packed rows,
    # whose per-document attention stays eager (a graph break), under FSDP2's hooks (outside it).
    common = ("logger=stdout", "dataset=text", f"dataset.path={uneven_file}", "max_seq_len=128", "batch_size=8",
              "max_steps=4", "optimizer.lr=1e-3", "sample_max_new_tokens=0")
    # The eager reference in one process (this one): the losses are those of any flavor (tests/test_layouts.py).
    runs = {"eager": ("flavor=cpu", "plan.compile=false", "plan.packing=true", "plan.micro_batch_size=1",
                      "plan.recompute=selective"),
            # One process: a cold compile of one more graph costs half a minute on two cores.
            "compiled, recomputed": ("flavor=cpu", "plan.compile=true", "plan.packing=false",
                                     "plan.recompute=selective"),
            # What the planner compiles on a CPU flavor: packed rows. Each rank packs its share into rows of its own, so
            # one runs a step's last micro-batch empty (two padding tokens, train/micro_batches.py) while the other
            # runs a row: still the one graph (a one-token row had every layer compiled again for it).
            "compiled, packed": ("flavor=cpu-2", *FSDP, "plan.compile=true", "plan.packing=true",
                                 "plan.micro_batch_size=1", "plan.recompute=none")}
    losses = {}
    # A cold cache of the test's own: cpu-2's second process reads the first's compiled layers from it, which it
    # could not have compiled before (train/compile_turn.py); a warm one would give it them anyway.
    cold = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for name, forced in runs.items():
        out = tmp_path / name.replace(", ", "-")
        r = run_recipe(*common, *forced, f"output_dir={out}", module="recipes.lora_finetune", env=cold)
        assert r.returncode == 0, r.stdout + r.stderr
        compiled = name.startswith("compiled")
        assert ("compiled layers" if compiled else "eager layers") in r.stdout
        assert layout(out) == ("sharded" if "cpu-2" in " ".join(forced) else "single")
        graphs = re.search(r"torch.compile captured (\d+) graph", r.stdout)
        # One graph serves every layer, the first too, whose input LoRA's frozen embeddings give no gradient.
        assert (int(graphs.group(1)) == 1) if compiled else graphs is None, r.stdout[-2000:]
        # cpu-2's processes compiled in turn: the second waited, then read the graphs the first compiled.
        assert ("1 other process(es) read them from inductor's cache" in r.stdout) == ("flavor=cpu-2" in forced), r.stdout
        losses[name] = [m["loss"] for m in metrics(out)]
    assert len(losses["eager"]) == 4
    for name, got in losses.items():
        for a, b in zip(losses["eager"], got, strict=True):
            assert abs(a - b) <= 1e-4 * abs(a), (name, losses)


def test_a_compile_dynamo_would_leave_eager_is_never_planned_and_refused_when_forced():
    """On the CPU, packed rows' per-document attention inside a recomputed layer keeps dynamo from compiling it."""
    _, spec, flavor = setup("flavor=cpu-2")
    work = Workload(spec=spec, batch_size=8, seq_len=128)
    assert not [c for c in choose_plan(work, flavor, forced={"compile": True}).candidates
                if c.plan.packing and c.plan.recompute != "none"]
    with pytest.raises(UserError, match="nothing\\s+would be compiled"):
        choose_plan(work, flavor, forced={"compile": True, "packing": True, "recompute": "selective"})


def test_a_selectively_recomputed_layer_compiled_again_is_read_from_the_cache(tmp_path, monkeypatch):
    """torch.compile keys the graphs it traced by the recomputation's policy (its cache_hash): a second run of the same
    layer (dynamo reset as a new process would be) reads them from the cache instead of tracing again (a tiny model's
    compiled run: 18 s warm without it, 5.7 s with it, eager 6 s)."""
    import torch
    from torch._dynamo.utils import counters

    from moai_recipes.models.recompute import apply_recompute

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold, this test's own

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(torch.nn.functional.silu(self.up(x)))

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Layer()])
    apply_recompute(layers, "selective")
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    # Three compiles, the last two compared: a process's first compile is keyed with inductor's post-grad pass unset,
    # its later ones with the one torchao sets (part of the key), so the second of a process whose first
    # compile is this one's (this test alone) missed the first's entry. A run compiles its layers once a process.
    for _ in range(3):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(layers[0])(x).sum().backward()
        grads.append(x.grad.clone())
        x.grad = None
    assert counters["aot_autograd"]["autograd_cache_hit"] >= 1, dict(counters["aot_autograd"])
    assert not counters["aot_autograd"]["autograd_cache_bypass"], dict(counters["aot_autograd"])
    assert torch.equal(grads[1], grads[2])
