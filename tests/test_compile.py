"""Compiled layers (plan.compile=true) train exactly as eager ones: the same per-step losses to 1e-4, and dynamo's
own counter says it captured graphs (the run's last lines report it).
Run: python -m pytest tests/test_compile.py -q (slow: a cold compile takes a minute on 2 cores, two processes
compiling at once; seconds once inductor's cache is warm)."""

import re

import pytest

from tests.helpers import layout, metrics, run_recipe


@pytest.mark.slow
def test_compiled_layers_train_as_eager_ones(tmp_path, varied_file):
    # Everything a compiled layer meets in one run: LoRA's adapters, FSDP2's hooks (outside the graph), selective
    # recomputation (inside it) and packed rows, whose per-document attention stays eager.
    common = ("logger=stdout", "dataset=text", f"dataset.path={varied_file}", "max_seq_len=128", "batch_size=8",
              "max_steps=4", "optimizer.lr=1e-3", "sample_max_new_tokens=0", "flavor=cpu-2", "plan.replicate=false",
              "plan.packing=true", "plan.micro_batch_size=1", "plan.recompute=selective")
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        r = run_recipe(*common, f"plan.compile={str(compiled).lower()}", f"output_dir={out}",
                       module="recipes.lora_finetune")
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("compiled layers" if compiled else "eager layers") in r.stdout
        assert layout(out) == "sharded"
        graphs = re.search(r"torch.compile captured (\d+) graph", r.stdout)
        assert (int(graphs.group(1)) >= 1) if compiled else graphs is None, r.stdout[-2000:]
        losses[compiled] = [m["loss"] for m in metrics(out)]
    assert len(losses[False]) == 4
    for a, b in zip(losses[False], losses[True], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), losses
