"""Several "nodes" on the engines users already run: two torchrun agents meeting by c10d rendezvous, and a real
SLURM (slurmctld, slurmd and munge started on this machine by scripts/local_slurm.sh). Each trains the same
global batches as flavor=cpu-2 and must give its losses.

Run: pytest tests/test_multinode.py   (the SLURM test skips, saying why, where SLURM cannot start)
"""

import os
import shutil
import subprocess
import sys

import pytest

from moai_recipes.train.world import free_port
from tests.helpers import FSDP, ROOT, layout, metrics, run_recipe

pytestmark = pytest.mark.slow

COMMON = ["max_steps=3", "batch_size=6", "optimizer.lr=3e-3", "logger=stdout", "sample_max_new_tokens=0"]


@pytest.fixture(scope="module")
def cpu_2_losses(tmp_path_factory):
    """The losses of flavor=cpu-2, run as flavor=cpu (one process, cheaper): the two give the same losses to 1e-4
    (tests/test_full_finetune.py::test_same_losses_on_any_flavor_and_micro_batch)."""
    out = tmp_path_factory.mktemp("cpu") / "run"
    r = run_recipe(*COMMON, "flavor=cpu", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    return [row["loss"] for row in metrics(out)]


def assert_same(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference) == 3
    for a, b in zip(reference, losses):
        assert abs(a - b) <= 1e-4 * a, (reference, losses)


def test_two_torchrun_agents_with_c10d_rendezvous_train_as_cpu_2(tmp_path, cpu_2_losses):
    """`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` started twice, as on two machines."""
    out, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "moai-two-nodes",
         "-m", "recipes.full_finetune", *COMMON, "flavor=cpu-2", *FSDP, f"output_dir={out}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [a.communicate(timeout=600)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)
    assert any("2 process(es)" in log for log in logs) and layout(out) == "sharded"
    assert_same([row["loss"] for row in metrics(out)], cpu_2_losses)


def _slurm_or_skip(tmp_path) -> dict:
    """Start a one-node SLURM cluster of this machine (scripts/local_slurm.sh); skip, saying why, if it cannot."""
    if not shutil.which("slurmctld") or not shutil.which("srun"):
        pytest.skip("SLURM is not installed (Debian: apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld, slurmd and munged here needs root")
    started = subprocess.run(["bash", str(ROOT / "scripts" / "local_slurm.sh"), "start", str(tmp_path / "slurm")],
                             capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        pytest.skip(f"SLURM did not start: {(started.stdout + started.stderr).strip()[-500:]}")
    return {**os.environ, "SLURM_CONF": str(tmp_path / "slurm" / "slurm.conf")}


def test_srun_two_tasks_join_the_world_slurm_gives(tmp_path, cpu_2_losses):
    env = _slurm_or_skip(tmp_path)
    try:
        out = tmp_path / "run"
        r = subprocess.run(["srun", "-n", "2", "--cpus-per-task", "1", "--chdir", str(ROOT),
                            sys.executable, "-m", "recipes.full_finetune", *COMMON, "flavor=cpu-2", "plan.replicate=true",
                            f"output_dir={out}"],
                           env={**env, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "2 process(es)" in r.stdout and layout(out) == "replicated"
        assert_same([row["loss"] for row in metrics(out)], cpu_2_losses)
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "local_slurm.sh"), "stop", str(tmp_path / "slurm")],
                       capture_output=True, timeout=60)
