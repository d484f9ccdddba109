"""Running recipes register themselves so that `moai smi` lists them, as moreh-smi lists its jobs.

A run is one file, `<moai_home>/runs/<host>-<pid>.json`, written when the recipe starts and removed
when it ends, normally or by an exception (a user error, Ctrl-C, a crash in Python). A run killed
outright (kill -9, the kernel's OOM killer) cannot remove its file: `running()` drops the files of
this machine's processes that are gone (a home shared by several nodes holds theirs too). The
workers a recipe launches get its job id in their job file (launch/worker.py) and register as its workers: while their launcher
lives, smi counts them in its process tree (one row per job); a launcher killed outright can leave
them running, and then they are listed on their own, so that what still trains stays in sight.
Test: `python -m pytest tests/test_cli.py -q`.
"""

import json
import secrets
import shlex
import socket
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from moai_recipes.config.user_settings import moai_home
from moai_recipes.files import write_json
from moai_recipes.flavors import Flavor


@dataclass(frozen=True)
class Run:
    job_id: str
    host: str
    pid: int
    create_time: float  # with the pid, tells the run from a later process that got the same pid
    command: str  # as the user typed it: python -m recipes.full_finetune flavor=cpu-2 ...
    flavor: str  # display name: 4xLarge.2048GB, cpu-2
    device_kind: str  # gpu | cpu: where smi reads the memory
    total_memory_gb: float
    launcher: int | None = None  # a worker's: the pid of its job's listed process; None: the listed process


def runs_dir() -> Path:
    return moai_home() / "runs"


def new_job_id() -> str:
    return str(100000 + secrets.randbelow(900000))


def _register(flavor: Flavor, job_id: str, launcher: int | None) -> Path | None:
    me = psutil.Process()
    run = Run(job_id=job_id, host=socket.gethostname(), pid=me.pid, create_time=me.create_time(),
              command=shlex.join(["python", *sys.orig_argv[1:]]), flavor=flavor.name, device_kind=flavor.device.kind,
              total_memory_gb=flavor.total_memory_gb, launcher=launcher)
    path = runs_dir() / f"{run.host}-{run.pid}.json"
    try:
        write_json(path, asdict(run))
    except OSError as e:  # a read-only home must not stop a training run
        print(f"warning: cannot register the run in {path.parent} ({e}); `moai smi` will not list it", file=sys.stderr)
        return None
    return path


@contextmanager
def registered(flavor: Flavor, *, job_id: str, launcher: int | None = None):
    """List this process in `moai smi` while the block runs: as the job `job_id`, or as a worker of that job, whose
    listed process is `launcher` (smi shows a worker on its own only once that process is gone)."""
    path = _register(flavor, job_id, launcher)
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def _alive(run: Run) -> bool:
    try:
        p = psutil.Process(run.pid)
        return abs(p.create_time() - run.create_time) < 1 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running() -> list[Run]:
    """The registered runs whose process lives, oldest first (workers whose job's process is gone included);
    the files of dead ones are removed."""
    runs = []
    for path in runs_dir().glob("*.json"):
        try:
            run = Run(**json.loads(path.read_text()))
        except FileNotFoundError:  # it ended while we looked
            continue
        except (ValueError, TypeError):  # not a run file of this version: not ours to judge
            continue
        if run.host != socket.gethostname():  # another node's: neither measurable nor judgeable from here
            continue
        if _alive(run):
            runs.append(run)
        else:
            path.unlink(missing_ok=True)
    # A worker is part of its job's row while the job's process lives (smi measures that process's tree).
    listed = {r.pid for r in runs if r.launcher is None}
    return sorted((r for r in runs if r.launcher not in listed), key=lambda r: r.create_time)


def process_tree(pid: int) -> list[psutil.Process]:
    """A run's process and its descendants (the elastic launcher's workers); empty once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
