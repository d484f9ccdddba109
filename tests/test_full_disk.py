"""A full disk is the user's to fix, and loses nothing: checked before step 1, and any write that finds the disk full
(a step checkpoint on several ranks, the model, the adapter, metrics.jsonl, loss.png) ends with exit 2 and one
message, no .tmp left, the last complete checkpoint still resuming.

The disks are real: a tmpfs of a few MB mounted for the test (root only; elsewhere these tests are skipped), filled
by a ballast file as another user of a shared disk would fill it (tests/helpers.SmallDisk). The step checkpoint that
finds the disk full on two processes is in tests/test_checkpoints.py, beside the uninterrupted run it is compared with.
"""

import pytest
import torch

from moai_recipes.files import DiskFull
from tests.helpers import make_hf_checkpoint, run_recipe

COMMON = ["logger=stdout", "epochs=2", "batch_size=8", "max_steps=12", "optimizer.lr=3e-3", "optimizer.warmup_steps=2",
          "checkpoint_every=2", "sample_max_new_tokens=0"]


def test_a_run_that_cannot_fit_is_refused_before_its_first_step(small_disk):
    disk = small_disk(3)
    out = disk.path / "run"
    r = run_recipe(*COMMON, "flavor=cpu", f"output_dir={out}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    # The tiny model's checkpoint is ~10 MiB (0.9M trainable values x 12 bytes); checkpoint_keep=2 holds 3 at once.
    assert f"output_dir={out} is on a disk with 3.0 MiB free" in r.stderr and "short" in r.stderr, r.stderr
    assert "3 step checkpoint(s)" in r.stderr and "checkpoint_keep=" in r.stderr
    assert "[Step 1/" not in r.stdout and not (out / "metrics.jsonl").exists()
    fits = run_recipe(*COMMON, "flavor=cpu", "checkpoint_every=null", "max_steps=2",
                      f"output_dir={small_disk(12).path / 'run'}")
    assert fits.returncode == 0, fits.stdout + fits.stderr  # no checkpoints: the model and the logs fit 12 MB


def test_the_model_adapter_and_logs_on_a_full_disk_raise_disk_full_and_leave_nothing_half_written(tmp_path, small_disk):
    """Each final writer, in this process, against a real full disk."""
    from moai_recipes.models.hf_format import HFFolder, load_weights, save_weights
    from moai_recipes.models.build import build_model
    from moai_recipes.models.lora import LoraOptions, save_adapter
    from moai_recipes.train.metrics_log import MetricsLog, StepMetrics

    hf = HFFolder.open(make_hf_checkpoint(tmp_path / "hf"))
    model = build_model(hf.spec, max_seq_len=64)
    load_weights(model, hf)
    disk = small_disk(1)
    disk.fill()
    with pytest.raises(DiskFull, match=r"the model .*/model could not be written .* it needs about"):
        save_weights(model, hf, disk.path / "model", rank=0)
    opts = LoraOptions(rank=2, alpha=4, dropout=0.0, attn_modules=["q_proj"], apply_to_mlp=False,
                       apply_to_output=False, quantize_base=False)
    adapters = {"layers.0.attn.q_proj.lora_a.weight": torch.zeros(2, 64),
                "layers.0.attn.q_proj.lora_b.weight": torch.zeros(64, 2)}
    with pytest.raises(DiskFull, match="the adapter"):
        save_adapter(adapters, opts=opts, out_dir=disk.path / "adapter", base_model="base")
    disk.empty()
    log = MetricsLog(disk.path, total_steps=2, config={}, plan={}, tracker={"kind": "stdout"})
    disk.fill()
    row = dict(step=1, loss=1.0, lr=1e-3, tokens=10, tokens_per_sec=1.0, step_time_s=1.0, grad_norm=1.0,
               peak_memory_bytes=0, host_peak_bytes=0, target_tokens=10, skipped=False)
    with pytest.raises(DiskFull, match="metrics.jsonl could not be written"):
        for _ in range(200):  # past the file's buffer
            log.step(StepMetrics(**{**row, "step": 1}))
    with pytest.raises(DiskFull, match="metrics.jsonl could not be written"):
        log.close()  # what the buffer still held
    disk.empty()
    log = MetricsLog(disk.path, total_steps=2, config={}, plan={}, tracker={"kind": "stdout"})
    log.rows = [row]
    disk.fill()
    with pytest.raises(DiskFull, match="loss.png could not be written"):
        log.close()
    left = sorted(p.name for p in disk.path.iterdir() if p != disk.ballast)
    assert left == ["metrics.jsonl"], left  # no .model.tmp-*, no .adapter.tmp-*, no loss.tmp.png
