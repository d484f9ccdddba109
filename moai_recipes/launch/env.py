"""The environment variables between our launcher and the workers it starts, named and read here only.

Workers are separate processes (the elastic launcher execs `python -m <recipe>` for each), so what
the launcher must tell them travels in their environment. Everything else a worker needs is on its
command line (the resolved config). torchrun's and SLURM's own variables are read in world.py.
"""

import os

LAUNCHER_PID = "MOAI_LAUNCHER_PID"  # the process that started the workers: they stop when it dies
JOB_ID = "MOAI_JOB_ID"  # the `moai smi` job the workers belong to
RESTART = "MOAI_RESTART"  # how many times the launcher has started the group again after a dead worker
_TORCHRUN_RESTART = "TORCHELASTIC_RESTART_COUNT"  # the same, when torchrun restarts the group


def set_launcher(pid: int) -> None:
    """In the launcher, before starting workers: they inherit it."""
    os.environ[LAUNCHER_PID] = str(pid)


def set_restart(attempt: int) -> None:
    os.environ[RESTART] = str(attempt)


def launcher_pid() -> int | None:
    """In a worker our launcher started: the launcher's pid; None otherwise."""
    value = os.environ.get(LAUNCHER_PID)
    return int(value) if value else None


def restart_count() -> int:
    """How many times this run's workers have been restarted, by us or by torchrun (0: the first start)."""
    return max(int(os.environ.get(RESTART) or 0), int(os.environ.get(_TORCHRUN_RESTART) or 0))


def set_job(job_id: str) -> None:
    """In a registered job's process: the workers it launches register as its workers."""
    os.environ[JOB_ID] = job_id


def clear_job() -> None:
    os.environ.pop(JOB_ID, None)


def job() -> tuple[str | None, int | None]:
    """(job id, its launcher's pid) inherited from the job that started this worker; (None, None) if none."""
    job_id = os.environ.get(JOB_ID) or None
    return job_id, (launcher_pid() if job_id else None)
