"""A full disk is the user's to fix, and loses nothing: checked before step 1, and any write that finds the disk full
(a step checkpoint on several ranks, the model, the adapter, metrics.jsonl, loss.png) ends with exit 2 and one
message, no .tmp left, the last complete checkpoint still resuming.

The disks are real: a tmpfs of a few MB mounted for the test (root only; elsewhere these tests are skipped), filled
by a ballast file as another user of a shared disk would fill it.
"""

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from moai_recipes.files import DiskFull
from tests.helpers import FSDP, ROOT, command_env, losses, make_hf_checkpoint, run_recipe, tensors

COMMON = ["logger=stdout", "epochs=2", "batch_size=8", "max_steps=12", "optimizer.lr=3e-3", "optimizer.warmup_steps=2",
          "checkpoint_every=2", "sample_max_new_tokens=0"]


class SmallDisk:
    """A tmpfs of `megabytes` at `path`; `fill()` takes what is left with a ballast file, `empty()` frees it."""

    def __init__(self, path: Path, megabytes: int):
        self.path, self.ballast = path, path / f"ballast-{uuid.uuid4().hex[:6]}"
        path.mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()}); these tests need root")

    def fill(self):
        with open(self.ballast, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 2**16)
                    f.flush()
            except OSError:
                pass

    def empty(self):
        self.ballast.unlink(missing_ok=True)

    def close(self):
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disks = []

    def make(megabytes: int) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / f"disk{len(disks)}", megabytes))
        return disks[-1]

    yield make
    for disk in disks:
        disk.close()


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


def test_a_disk_that_fills_mid_run_ends_it_cleanly_and_the_last_checkpoint_resumes(tmp_path, small_disk):
    """cpu-2, FSDP2: the disk is filled by someone else after the step-2 checkpoint; the step-4 save finds no room on
    its ranks. Exit 2, one message, no .tmp; freed, the same command resumes from step 2 and ends as an
    uninterrupted run does, bit for bit."""
    reference = tmp_path / "reference"
    r = run_recipe(*COMMON, "flavor=cpu-2", *FSDP, f"output_dir={reference}")
    assert r.returncode == 0, r.stdout + r.stderr

    disk = small_disk(48)
    out = disk.path / "run"
    args = [*COMMON, "flavor=cpu-2", *FSDP, f"output_dir={out}"]
    proc = subprocess.Popen([sys.executable, "-m", "recipes.full_finetune", *args], cwd=ROOT,
                            env=command_env({"MOAI_FAULT_STEP_DELAY": "0.3"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    end = time.time() + 300
    while not (out / "checkpoints" / "step-000002" / "meta.json").exists():
        assert proc.poll() is None and time.time() < end, proc.communicate()
        time.sleep(0.02)
    disk.fill()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stdout + stderr
    assert "Traceback" not in stderr and stderr.count("error:") == 1, stderr
    assert f"the disk of {out / 'checkpoints'} is full: the checkpoint of step 4 could not be written" in stderr
    assert f"resumes from the last complete checkpoint ({out / 'checkpoints' / 'step-000002'})" in stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]  # no .step-000004.tmp
    assert not (out / "model").exists()

    disk.empty()
    again = run_recipe(*args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "continuing at step 3" in again.stdout
    assert losses(out) == losses(reference)
    ref, got = tensors(reference / "model"), tensors(out / "model")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


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
