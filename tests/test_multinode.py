"""Several "nodes" on the engines users already run: two torchrun agents meeting by c10d rendezvous, and a real
SLURM (slurmctld, slurmd and munge started on this machine by scripts/local_slurm.sh). Each trains the same
global batches as flavor=cpu-2 and must give its losses.

Run: pytest tests/test_multinode.py   (the SLURM test skips, saying why, where SLURM cannot start)
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def assert_same(losses: list[float], reference: list[float], steps: int = 3) -> None:
    assert len(losses) == len(reference) == steps
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


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster of this machine (scripts/local_slurm.sh), for the module; the environment that reaches
    it. Skips, saying why, where it cannot start."""
    if not shutil.which("slurmctld") or not shutil.which("srun"):
        pytest.skip("SLURM is not installed (Debian: apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld, slurmd and munged here needs root")
    folder = tmp_path_factory.mktemp("slurm")
    script = str(ROOT / "scripts" / "local_slurm.sh")
    started = subprocess.run(["bash", script, "start", str(folder)], capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        pytest.skip(f"SLURM did not start: {(started.stdout + started.stderr).strip()[-500:]}")
    yield {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    subprocess.run(["bash", script, "stop", str(folder)], capture_output=True, timeout=60)


def test_srun_two_tasks_join_the_world_slurm_gives(tmp_path, slurm, cpu_2_losses):
    out = tmp_path / "run"
    r = subprocess.run(["srun", "-n", "2", "--cpus-per-task", "1", "--chdir", str(ROOT),
                        sys.executable, "-m", "recipes.full_finetune", *COMMON, "flavor=cpu-2", "plan.replicate=true",
                        f"output_dir={out}"], env=slurm, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 process(es)" in r.stdout and layout(out) == "replicated"
    assert_same([row["loss"] for row in metrics(out)], cpu_2_losses)


def documented_sbatch_script() -> str:
    text = (ROOT / "docs" / "multinode.md").read_text()
    return re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S).group(1)


def test_the_documented_sbatch_script_saves_on_the_signal_and_requeues(tmp_path, slurm):
    """docs/multinode.md's script, its sizes made one node of two CPU tasks: the tasks are signalled as at the time
    limit or a preemption (SIGTERM to the job's steps, not to the batch shell), save and exit 75; the script requeues
    the job, which resumes and ends with the losses of an uninterrupted run."""
    args = [*COMMON, "max_steps=6", "flavor=cpu-2", "plan.replicate=true"]
    reference = tmp_path / "reference"  # one process, in this one: cpu-2's losses to 1e-4, without two to start
    assert run_recipe(*COMMON, "max_steps=6", "flavor=cpu", f"output_dir={reference}").returncode == 0

    out, log = tmp_path / "run", tmp_path / "job.out"
    script = documented_sbatch_script()
    for documented, local in [("--nodes=4", "--nodes=1"), ("--ntasks-per-node=8", "--ntasks-per-node=2"),
                              ("--cpus-per-task=12", "--cpus-per-task=1"), ("--time=24:00:00", "--time=10:00"),
                              ("--output=%x-%j.out", f"--output={log}"), ("cd /path/to/moai-recipes", f"cd {ROOT}")]:
        assert documented in script
        script = script.replace(documented, local)
    script = re.sub(r"#SBATCH --gpus-per-node=8.*\n", "", script)
    script, n = re.subn(r"srun python -m recipes\.full_finetune .*?resume=auto",
                        f"srun {sys.executable} -m recipes.full_finetune {' '.join(args)} output_dir={out} resume=auto",
                        script, flags=re.S)
    assert n == 1 and "--signal=TERM@" in script and "scontrol requeue" in script
    (tmp_path / "train.sbatch").write_text(script)
    env = {**slurm, "MOAI_FAULT_STEP_DELAY": "1.5"}  # the steps outlast the signal's way to the tasks
    job = subprocess.run(["sbatch", "--parsable", str(tmp_path / "train.sbatch")], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    try:
        end = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 2):
            assert time.time() < end, log.read_text() if log.exists() else "the job never started"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True)  # the steps' tasks, as --signal does
        requeued_at = None
        # The first instance ends (exit 75) as the script requeues it: a final state counts once the requeued job
        # has been seen pending, and it is the second instance's.
        while True:
            shown = _show(job, env)
            state = _state_of(shown)
            if state in FINAL and (requeued_at is not None or "Restarts=0" in shown):
                break
            assert time.time() < end, log.read_text() + _slurmctld_log(env)
            if "Reason=BeginTime" in shown:  # requeued: SLURM holds it two minutes, of which we spare all but 3 s
                requeued_at = requeued_at or time.time()
                # Not at once: slurmd refuses the new start's credential if it is dated within the second of the
                # revoked one (a suite run saw "Killing non-startable batch JobId=2: Job credential revoked" when
                # started 80 ms after the requeue, and the job end FAILED).
                if time.time() - requeued_at > 3:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], env=env)
    text = log.read_text()
    assert state == "COMPLETED" and requeued_at is not None, text + _slurmctld_log(env)
    assert "SIGTERM: stopped after step" in text and "Resumed from" in text, text
    assert (out / "model").is_dir() and len(metrics(out)) == 6
    assert_same([row["loss"] for row in metrics(out)], [row["loss"] for row in metrics(reference)], steps=6)


def _show(job: str, env: dict) -> str:
    return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def _state_of(shown: str) -> str:
    found = re.search(r"JobState=(\w+)", shown)
    return found.group(1) if found else "UNKNOWN"


def _slurmctld_log(env: dict) -> str:
    """The controller's account of the job (requeues, completions, exit statuses), for a failure's message."""
    lines = (Path(env["SLURM_CONF"]).parent / "slurmctld.log").read_text().splitlines()
    return "\nslurmctld:\n" + "\n".join(line for line in lines if "JobId" in line or "Requeu" in line)
