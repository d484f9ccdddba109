"""The loss: the chunked cross-entropy equals the plain one in value and gradients, on tensors, on real
torchtune models (tied embeddings too), and in the recipe under FSDP2. Run: pytest tests/test_loss.py"""

import dataclasses
import json

import pytest
import torch

from moai_recipes.models.loss import (
    CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_cross_entropy_sum,
    cross_entropy_sum,
    token_loss_sum,
)
from tests.helpers import FSDP, layout, metrics, run_recipe


def test_chunks_give_the_loss_and_gradients_of_the_whole():
    torch.manual_seed(0)
    project = torch.nn.Linear(32, 50, bias=False)
    hidden = torch.randn(3, CHUNK_TOKENS // 2 + 7, 32, requires_grad=True)  # 3 chunks, the last one short
    labels = torch.randint(0, 50, hidden.shape[:2])
    labels[0, :100] = IGNORE_INDEX  # masked prompt tokens, across a chunk boundary too
    labels[1, -300:] = IGNORE_INDEX

    whole = cross_entropy_sum(project(hidden), labels)
    grads = torch.autograd.grad(whole * 0.5, [hidden, project.weight])  # a scaled loss: the backward scales
    chunked = chunked_cross_entropy_sum(hidden, project.weight, labels)
    chunked_grads = torch.autograd.grad(chunked * 0.5, [hidden, project.weight])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    for a, b in zip(chunked_grads, grads):  # summed in another order: tolerance on the gradient's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("model_name", ["tiny", "qwen2_5_0_5b"])  # untied llama; qwen2 with tied embeddings
def test_a_chunked_model_loss_equals_the_plain_one(model_name):
    from moai_recipes.config.compose import load_config
    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.models.spec import spec_for

    cfg = load_config("full_finetune", [f"model={model_name}"])
    spec = spec_for(architecture=cfg.model.architecture, checkpoint_dir=None)
    spec = dataclasses.replace(spec, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                               intermediate_dim=128, vocab_size=300)
    torch.manual_seed(0)
    model = build_model(spec, max_seq_len=1024)
    init_buffers(model, device="cpu")
    tokens = torch.randint(0, spec.vocab_size, (2, 900))  # 1800 tokens: two chunks
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX

    losses, grads = [], []
    for chunked in (False, True):
        model.zero_grad()
        loss = token_loss_sum(model, tokens, labels, chunked=chunked)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert "unembed" not in vars(model)  # the model is itself again
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name)


@pytest.mark.slow
def test_the_recipe_trains_alike_with_a_chunked_loss_on_two_processes(tmp_path):
    """Micro-batches of 3 x 512 tokens: several chunks each, under FSDP2 with the root gathered."""
    rows = [{"text": " ".join(f"word{(i * 7 + j) % 97}" for j in range(400))} for i in range(18)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["dataset=text", f"dataset.path={data}", "max_seq_len=512", "batch_size=6", "max_steps=3",
              "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "logger=stdout", "sample_max_new_tokens=0"]
    plain = run_recipe(*common, "flavor=cpu", "plan.chunked_loss=false", f"output_dir={tmp_path / 'plain'}")
    chunked = run_recipe(*common, "flavor=cpu-2", *FSDP, "plan.chunked_loss=true",
                         f"output_dir={tmp_path / 'chunked'}")
    assert plain.returncode == 0 and chunked.returncode == 0, chunked.stdout + chunked.stderr
    assert "chunked loss true" in chunked.stdout and layout(tmp_path / "chunked") == "sharded"
    a, b = metrics(tmp_path / "plain"), metrics(tmp_path / "chunked")
    assert a[0]["tokens"] == 6 * 512 and len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * x["loss"] and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-3 * x["grad_norm"]
