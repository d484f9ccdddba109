"""Nothing lost: step checkpoints, exact resume, a dead worker, another flavor, non-finite steps.

Real processes and real signals; the runs of several processes under both layouts a flavor can have, FSDP2 shards
and plain replicas (plan.json says which ran). A run that is signalled mid-way waits MOAI_FAULT_STEP_DELAY before
each step, so that it is still running when the signal comes, however fast the machine. Run: pytest
tests/test_checkpoints.py  (about three minutes)
"""

import enum
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from moai_recipes.checkpoint.integrity import checksums
from moai_recipes.errors import EXIT_STOPPED
from tests.helpers import (FSDP, ROOT, assert_same_weights, command_env, layout, make_hf_checkpoint, metrics,
                           run_recipe, start_forked)

pytestmark = pytest.mark.slow

COMMON = ["logger=stdout", "epochs=2", "batch_size=8", "max_steps=12", "optimizer.lr=3e-3", "optimizer.warmup_steps=2",
          "checkpoint_every=2", "sample_max_new_tokens=0"]


LAYOUTS = {"sharded": FSDP, "replicated": ("plan.replicate=true",)}
SLOW = {"MOAI_FAULT_STEP_DELAY": "0.25"}  # the remaining steps outlast any signal's way to the workers


def start(*args, stdout: Path | None = None, env: dict | None = None):
    """The run started and not waited for, its stderr in its stdout (forked from the suite's zygote: helpers)."""
    return start_forked(*COMMON, *args, env={**SLOW, **(env or {})}, merged=True, stdout=stdout)


def workers_of(proc) -> list[psutil.Process]:
    """The launcher's training processes: forked from it (launch/elastic.py), or started bare (MOAI_FORK_WORKERS=0,
    as on GPUs). Not its other children (multiprocessing's resource tracker)."""
    launcher = psutil.Process(proc.pid)
    return [child for child in launcher.children()
            if child.cmdline() == launcher.cmdline() or "moai_recipes.launch.worker" in " ".join(child.cmdline())]


def wait_for_step(out: Path, step: int, proc, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    raise TimeoutError


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted runs on cpu-2 every other run must reproduce: {layout: run folder}, made on first use."""
    made = {}

    def reference(kind: str) -> Path:
        if kind not in made:
            out = tmp_path_factory.mktemp(f"ref-{kind}") / "run"
            r = run_recipe(*COMMON, "flavor=cpu-2", *LAYOUTS[kind], f"output_dir={out}")
            assert r.returncode == 0, r.stdout + r.stderr
            assert layout(out) == kind
            made[kind] = out
        return made[kind]

    return reference


@pytest.fixture(scope="module")
def reference(references):
    return references("replicated")


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in metrics(out)]


def test_checkpoints_are_complete_rotated_and_costed(reference):
    kept = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert kept == ["step-000008", "step-000010"]  # checkpoint_keep=2; the last step is the model itself
    meta = json.loads((reference / "checkpoints" / "step-000010" / "meta.json").read_text())
    assert meta["step"] == 10 and meta["samples_seen"] == 80 and meta["world_size"] == 2 and meta["plan"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "train_state.pt"} <= {
        p.name for p in (reference / "checkpoints" / "step-000010").iterdir()}
    # Every checkpoint's cost is recorded, also of those rotated away: seconds, and bytes on disk.
    rows = [json.loads(line) for line in (reference / "checkpoints.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10] and all(r["seconds"] > 0 for r in rows)
    for row in rows[-2:]:
        folder = reference / row["path"]
        assert folder.name in kept and row["bytes"] == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.parametrize("kind", LAYOUTS)
def test_sigterm_saves_and_the_same_command_resumes_exactly(tmp_path, references, kind):
    reference = references(kind)
    out = tmp_path / "run"
    proc = start("flavor=cpu-2", *LAYOUTS[kind], f"output_dir={out}")
    wait_for_step(out, 4, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler's preemption would
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_STOPPED, log  # saved and stopped: a scheduler requeues it
    assert "Run the same command again to resume" in log and "Traceback" not in log
    stopped_at = len(metrics(out))
    assert 4 <= stopped_at < 12 and not (out / "model").exists()

    r = run_recipe(*COMMON, "flavor=cpu-2", *LAYOUTS[kind], f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"continuing at step {stopped_at + 1}" in r.stdout and layout(out) == kind
    assert losses(out) == losses(reference)
    assert_same_weights(reference / "model", out / "model")


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_nothing_happened(tmp_path, references):
    reference = references("sharded")
    out = tmp_path / "run"
    proc = start("flavor=cpu-2", *LAYOUTS["sharded"], f"output_dir={out}")
    wait_for_step(out, 5, proc)
    workers = workers_of(proc)
    assert len(workers) == 2
    workers[1].kill()  # kill -9 of one worker
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert "restarting the 2 processes" in log and "Resumed from" in log and layout(out) == "sharded"
    assert losses(out) == losses(reference)
    assert_same_weights(reference / "model", out / "model")


# A checkpoint crosses from one process to several and from two to four, and between FSDP2 shards and plain
# replicas: the checkpoint is the same distributed checkpoint either way.
@pytest.mark.parametrize("saved_on, saved_as, resumed_on, resumed_as", [("cpu-2", "sharded", "cpu-4", "replicated"),
                                                                       ("cpu", "single", "cpu-2", "sharded")])
def test_a_run_checkpointed_on_one_flavor_resumes_on_another(tmp_path, reference, saved_on, saved_as, resumed_on,
                                                             resumed_as):
    out = tmp_path / "run"
    proc = start(f"flavor={saved_on}", *(LAYOUTS[saved_as] if saved_as in LAYOUTS else ()), f"output_dir={out}")
    wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_STOPPED and layout(out) == saved_as
    r = run_recipe(*COMMON, f"flavor={resumed_on}", *LAYOUTS[resumed_as], f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert layout(out) == resumed_as
    processes = {"cpu": 1, "cpu-2": 2, "cpu-4": 4}[saved_on]
    assert f"saved on {saved_on} with {processes} process(es)" in r.stdout
    for a, b in zip(losses(reference), losses(out), strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)


def test_resume_refuses_another_config_and_never_means_never(tmp_path, reference):
    changed = run_recipe(*COMMON, "flavor=cpu", "optimizer.lr=1e-3", f"output_dir={reference}")
    assert changed.returncode == 2 and "finished run" in changed.stderr
    out = tmp_path / "run"
    proc = start("flavor=cpu", f"output_dir={out}")
    wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(timeout=120) == EXIT_STOPPED
    (out / "checkpoints" / ".step-000099.tmp").mkdir()  # what a crash while saving leaves behind: ignored
    other = run_recipe(*COMMON, "flavor=cpu", "optimizer.lr=1e-3", f"output_dir={out}")
    assert other.returncode == 2 and "optimizer.lr" in other.stderr and "Traceback" not in other.stderr
    never = run_recipe(*COMMON, "flavor=cpu", "resume=never", f"output_dir={out}")
    assert never.returncode == 2 and "holds an earlier run" in never.stderr
    step = sorted((out / "checkpoints").glob("step-*"))[0]
    given = run_recipe(*COMMON, "flavor=cpu", f"resume={step}", f"output_dir={tmp_path / 'elsewhere'}")
    assert given.returncode == 0 and f"Resumed from {step}" in given.stdout, given.stdout + given.stderr


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeping_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    r = run_recipe(*COMMON, "flavor=cpu", "optimizer.lr=1e30", "optimizer.max_grad_norm=null", "checkpoint_every=1",
                   f"output_dir={out}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "not finite" in r.stderr and "step " in r.stderr and "The last good checkpoint is" in r.stderr
    assert (out / "checkpoints").exists() and not (out / "model").exists()
    tolerated = run_recipe(*COMMON, "flavor=cpu", "optimizer.lr=1e30", "optimizer.max_grad_norm=null",
                           "skip_nonfinite_steps=100", f"output_dir={tmp_path / 'tolerated'}")
    assert tolerated.returncode == 0, tolerated.stderr
    assert any(row.get("skipped") for row in metrics(tmp_path / "tolerated"))


def test_a_worker_that_dies_while_exiting_a_finished_run_loses_nothing(tmp_path):
    """gloo can abort a worker at exit after the run finished: the run must not be restarted (its folder
    holds a finished run) and must not lose its last outputs. The fault is injected for real: a
    sitecustomize module SIGKILLs rank 1 from its exit handlers."""
    inject = tmp_path / "inject"
    inject.mkdir()
    # A worker is forked (launch/elastic.py) and ends through multiprocessing's exit handlers, not atexit's.
    (inject / "sitecustomize.py").write_text(
        "import os, signal\n"
        "from multiprocessing import util\n"
        "class Armed: pass\n"
        "ARMED = Armed()\n"
        "def arm(_):\n"
        "    util.Finalize(None, lambda: os.environ.get('RANK') == '1' and os.kill(os.getpid(), signal.SIGKILL),\n"
        "                  exitpriority=0)\n"
        "util.register_after_fork(ARMED, arm)\n")
    out = tmp_path / "run"
    env = command_env({"PYTHONPATH": str(inject)})
    r = subprocess.run([sys.executable, "-m", "recipes.full_finetune", *COMMON, "max_steps=4", "flavor=cpu-2",
                        f"output_dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "a worker failed while exiting" in r.stderr and "restarting" not in r.stdout
    assert (out / "model" / "config.json").exists() and (out / "loss.png").exists() and len(metrics(out)) == 4


def test_a_signal_that_lands_as_torch_starts_timing_a_call_still_stops_the_launcher_as_stopped(tmp_path, monkeypatch):
    """torch's metrics wrapper reads the clock inside its try; a SIGTERM that lands there raises its SignalException
    before the clock is read, and the wrapper's finally fails on the reading it never took (UnboundLocalError over the
    signal). The launcher still ends as stopped (EXIT_STOPPED, as on any other signal), not with a traceback: here
    the signal is made to land on the launcher's first timed call (torch's clock raising it, once)."""
    import time as real_time

    from torch.distributed.elastic.metrics import api as metrics_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from moai_recipes.launch.elastic import start_workers
    from tests.helpers import setup

    class SignalOnFirstReading:
        def __init__(self):
            self.signalled = False

        def time(self):
            if not self.signalled:
                self.signalled = True
                raise SignalException("got signal: 15", sigval=signal.SIGTERM)
            return real_time.time()

        def __getattr__(self, name):
            return getattr(real_time, name)

    clock = SignalOnFirstReading()
    monkeypatch.setattr(metrics_api, "time", clock)
    _, _, flavor = setup("flavor=cpu-2")
    assert start_workers(flavor, tmp_path / "job.json", "full_finetune") == EXIT_STOPPED
    assert clock.signalled


@pytest.mark.parametrize("workers", ["forked", "bare"])
def test_a_killed_launcher_takes_its_workers_down_with_a_checkpoint(tmp_path, reference, workers):
    """kill -9 of the launcher (no signal handler runs there): its workers must not train on unseen; they
    stop as if preempted, saving the step they reached, and the same command finishes the run exactly. Workers
    forked from the launcher, and started bare as on GPUs (MOAI_FORK_WORKERS=0)."""
    out = tmp_path / "run"
    # A file, not a pipe: nobody reads it once the launcher is gone.
    proc = start("flavor=cpu-2", f"output_dir={out}", stdout=tmp_path / "log",
                 env={"MOAI_FORK_WORKERS": "0" if workers == "bare" else None})
    wait_for_step(out, 3, proc)
    workers = workers_of(proc)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=120)
    assert not alive, (tmp_path / "log").read_text()
    done = len(metrics(out))
    assert done < 12 and int(sorted((out / "checkpoints").glob("step-*"))[-1].name[5:]) == done
    r = run_recipe(*COMMON, "flavor=cpu-2", f"output_dir={out}")
    assert r.returncode == 0 and f"continuing at step {done + 1}" in r.stdout, r.stdout + r.stderr
    assert layout(out) == layout(reference) == "replicated"
    assert losses(out) == losses(reference)


def test_killed_outright_mid_save_and_mid_export_the_same_command_ends_bit_for_bit(tmp_path, reference):
    """SIGKILL to the launcher and both workers at once (no handler runs), inside the first step checkpoint (so the
    folder holds no checkpoint: the same command starts over) and then inside the export (each held half-written by
    MOAI_FAULT_SAVE_DELAY): each time the same command goes on, and the run ends with the uninterrupted run's losses
    and weights. bench/chaos.py draws many such moments at random."""
    out = tmp_path / "run"

    def killed_when(ready):
        proc = start_forked(*COMMON, "flavor=cpu-2", f"output_dir={out}", env={"MOAI_FAULT_SAVE_DELAY": "0.3"},
                            merged=True)
        end = time.time() + 300
        while not ready():
            assert proc.poll() is None and time.time() < end, proc.communicate()[0]
            time.sleep(0.005)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in reversed(family):  # the workers first: none may see its launcher die and stop cleanly in between
            p.kill()
        proc.communicate()
        psutil.wait_procs(family, timeout=30)

    killed_when(lambda: (out / "checkpoints" / ".step-000002.tmp").exists())
    assert (out / "checkpoints" / ".step-000002.tmp").exists() and not (out / "checkpoints" / "step-000002").exists()
    killed_when(lambda: any(out.glob(".model.tmp-*")))
    assert any(out.glob(".model.tmp-*")) and not (out / "model").exists()  # inside the export
    r = run_recipe(*COMMON, "flavor=cpu-2", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "continuing at step 11" in r.stdout  # the last checkpoint before the export: step 10
    assert not any(out.glob(".*.tmp*")) and not any((out / "checkpoints").glob(".*.tmp"))
    assert layout(out) == layout(reference) and losses(out) == losses(reference)
    assert_same_weights(reference / "model", out / "model")


def test_a_disk_that_fills_mid_run_ends_it_cleanly_and_the_last_checkpoint_resumes(references, small_disk):
    """cpu-2, FSDP2: the disk is filled by someone else after the step-2 checkpoint; the step-4 save finds no room on
    its ranks. Exit 2, one message, no .tmp; freed, the same command resumes from step 2 and ends as an
    uninterrupted run does, bit for bit."""
    reference = references("sharded")
    disk = small_disk(48)
    out = disk.path / "run"
    args = [*COMMON, "flavor=cpu-2", *FSDP, f"output_dir={out}"]
    proc = start_forked(*args, env={"MOAI_FAULT_STEP_DELAY": "0.3"})
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
    assert_same_weights(reference / "model", out / "model")


def test_a_damaged_newest_checkpoint_is_named_and_passed_over_for_the_one_before(tmp_path):
    """Every save records its files' sizes and SHA-256; resume=auto reads the newest back, and a truncated or changed
    one is named and passed over; resume=PATH to it is refused."""
    whole = tmp_path / "whole"
    r = run_recipe(*COMMON, "flavor=cpu", "max_steps=5", f"output_dir={whole}")  # saves steps 2 and 4
    assert r.returncode == 0, r.stdout + r.stderr
    out = shutil.copytree(whole, tmp_path / "run")
    shutil.rmtree(out / "model")  # as if stopped after step 4's checkpoint
    damaged = out / "checkpoints" / "step-000004" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # a copy cut short, a disk that lost its tail
    kept = shutil.copytree(damaged.parent, tmp_path / "step-000004")

    given = run_recipe(*COMMON, "flavor=cpu", "max_steps=5", f"resume={kept}", f"output_dir={tmp_path / 'other'}")
    assert given.returncode == 2 and "Traceback" not in given.stderr, given.stdout + given.stderr
    assert f"resume={kept}: {kept / '__0_0.distcp'} is truncated (1000 of " in given.stderr

    r = run_recipe(*COMMON, "flavor=cpu", "max_steps=5", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"warning: {damaged} is truncated (1000 of " in r.stderr and "step-000004 is damaged" in r.stderr
    assert "continuing at step 3" in r.stdout
    assert losses(out) == losses(whole)
    assert_same_weights(whole / "model", out / "model")

    changed = out / "checkpoints" / "step-000004" / "train_state.pt"  # saved again by the resumed run: whole
    data = bytearray(changed.read_bytes())
    data[-20] ^= 0xFF  # one flipped byte, same size
    changed.write_bytes(bytes(data))
    # Two processes read it back, each hashing half of its files: the one whose half holds it finds it, both refuse.
    flipped = run_recipe(*COMMON, "flavor=cpu-2", "max_steps=5", f"resume={changed.parent}",
                         f"output_dir={tmp_path / 'flipped'}")
    assert flipped.returncode == 2 and "Traceback" not in flipped.stderr, flipped.stdout + flipped.stderr
    assert f"{changed} is damaged (its SHA-256 differs from the one saved)" in flipped.stderr, flipped.stderr


def test_resume_refuses_other_inputs_by_name_unless_forced(tmp_path, stopped_checkpoint):
    """A checkpoint records what it belongs to (the model as read, the tokenizer, the data's tokens, the global batch);
    resuming it into other inputs is refused by name, resume_force=true resumes anyway; max_steps may change."""
    given = [*COMMON, "flavor=cpu", "max_steps=4", f"resume={stopped_checkpoint}"]
    batch = run_recipe(*given, "batch_size=16", f"output_dir={tmp_path / 'batch'}")
    assert batch.returncode == 2 and "the global batch (8 -> 16) changed" in batch.stderr, batch.stderr
    assert "resume_force=true" in batch.stderr and "Traceback" not in batch.stderr
    data = run_recipe(*given, "dataset=facts", f"output_dir={tmp_path / 'data'}")
    assert data.returncode == 2 and "(the training data (its tokens) changed)" in data.stderr, data.stderr
    forced = run_recipe(*given, "batch_size=16", "resume_force=true", f"output_dir={tmp_path / 'forced'}")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "warning: resume_force=true" in forced.stderr and f"Resumed from {stopped_checkpoint}" in forced.stdout

    # The same model folder holding other weights (a copy trained further, put in its place): resume=auto.
    hf = make_hf_checkpoint(tmp_path / "hf")
    out = tmp_path / "run"
    first = run_recipe(*COMMON, "flavor=cpu", "max_steps=3", f"model.checkpoint_dir={hf}", f"output_dir={out}")
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.rmtree(out / "model")  # as if stopped after step 2's checkpoint
    weights = hf / "model.safetensors"
    original = weights.read_bytes()
    changed = load_file(weights)
    changed["model.norm.weight"] = changed["model.norm.weight"] * 2
    save_file(changed, weights)
    other = run_recipe(*COMMON, "flavor=cpu", "max_steps=3", f"model.checkpoint_dir={hf}", f"output_dir={out}")
    assert other.returncode == 2 and "(the model's weights or config.json changed)" in other.stderr, other.stderr
    weights.write_bytes(original)
    longer = run_recipe(*COMMON, "flavor=cpu", "max_steps=4", f"model.checkpoint_dir={hf}", f"output_dir={out}")
    assert longer.returncode == 0 and "continuing at step 3" in longer.stdout, longer.stdout + longer.stderr
    assert len(metrics(out)) == 4


class _Planted:
    """What a planted pickle does: unpickled, it runs a command (here: it leaves a file behind)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def stopped_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("planted") / "run"
    r = run_recipe(*COMMON, "flavor=cpu", "max_steps=3", f"output_dir={out}")  # saves after step 2
    assert r.returncode == 0, r.stdout + r.stderr
    return out / "checkpoints" / "step-000002"


@pytest.mark.parametrize("planted", ["train_state.pt", "rng-rank0.pt", ".metadata"])
def test_a_pickle_planted_in_a_checkpoint_is_refused_not_run(tmp_path, stopped_checkpoint, planted):
    checkpoint = shutil.copytree(stopped_checkpoint, tmp_path / "step-000002")
    marker = tmp_path / "it-ran"
    if planted == ".metadata":  # DCP's pickled metadata
        (checkpoint / planted).write_bytes(pickle.dumps(_Planted(marker)))
    else:  # torch.save's files
        torch.save(_Planted(marker), checkpoint / planted)
    # The planter rewrites the checksums too (else the resume would refuse the changed file as damaged, first).
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "files": checksums(checkpoint)}))
    r = run_recipe(*COMMON, "flavor=cpu", "max_steps=4", f"resume={checkpoint}", f"output_dir={tmp_path / 'resumed'}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{checkpoint / planted}: not loaded" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()


class _Python3112Pickler(pickle.Pickler):
    """Pickles an enum member as Python 3.11.2 does (Debian 12's python3.11): getattr(its class, its name); `member`
    gives another attribute of a class in its place, as a planter would."""

    def __init__(self, file, member=None):
        super().__init__(file)
        self.member = member

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, self.member or (type(obj), obj.name)
        return NotImplemented


def _rewritten_metadata(checkpoint: Path, python: str, member=None) -> None:
    """The checkpoint's DCP metadata as `python` writes it: 3.11.2 its enum members, 3.13 its paths
    (pathlib._local.PosixPath)."""
    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # ours, written by the run above
    if python == "3.11.2":
        with open(checkpoint / ".metadata", "wb") as f:
            _Python3112Pickler(f, member).dump(metadata)
    else:
        # The storage's path as 3.13 names it (this Python may be 3.13 already), in protocol 3, which names a class
        # in a line of text: protocol 4's frames would not survive a longer name.
        ours = pickle.dumps(metadata, protocol=3).replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
        assert ours.count(b"cpathlib._local\nPosixPath\n") == 1, ours
        (checkpoint / ".metadata").write_bytes(ours)
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "files": checksums(checkpoint)}))


@pytest.mark.parametrize("python", ["3.11.2", "3.13"])
def test_a_checkpoint_written_by_another_python_resumes_and_no_other_getattr_is_run(tmp_path, stopped_checkpoint,
                                                                                    python):
    """DCP's metadata as other Pythons pickle it: 3.11.2 names each tensor's memory format getattr(_MEM_FORMAT_ENCODING,
    NAME), 3.13 the storage's path pathlib._local.PosixPath (a module 3.11 has not). The resume reads either (every
    resume on those Pythons was refused as code), and a getattr of anything but an enum member of DCP's own classes is
    refused."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    checkpoint = shutil.copytree(stopped_checkpoint, tmp_path / "step-000002")
    _rewritten_metadata(checkpoint, python)
    written = (checkpoint / ".metadata").read_bytes()
    assert (b"getattr" in written and b"TORCH_CONTIGUOUS_FORMAT" in written if python == "3.11.2"
            else b"pathlib._local" in written), written
    r = run_recipe(*COMMON, "flavor=cpu", "max_steps=4", f"resume={checkpoint}", f"output_dir={tmp_path / 'resumed'}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [m["step"] for m in metrics(tmp_path / "resumed")] == [3, 4]
    if python != "3.11.2":
        return
    planted = shutil.copytree(stopped_checkpoint, tmp_path / "planted" / "step-000002")
    _rewritten_metadata(planted, python, member=(_MEM_FORMAT_ENCODING, "__class__"))  # an attribute, not a member
    r = run_recipe(*COMMON, "flavor=cpu", "max_steps=4", f"resume={planted}", f"output_dir={tmp_path / 'refused'}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{planted / '.metadata'}: not loaded: it asks for _MEM_FORMAT_ENCODING.__class__" in r.stderr, r.stderr


def test_dcp_entries_that_are_not_plain_values_are_refused(tmp_path):
    """DCP saves non-tensor entries (the optimizer's hyperparameters) with torch.save and loads them with
    weights_only=False; our planner reads them as data only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from moai_recipes.checkpoint.no_code import SafeLoadPlanner, SafeReader

    marker = tmp_path / "it-ran"
    dcp.save({"lr": 0.1, "betas": (0.9, 0.95), "evil": _Planted(marker)}, checkpoint_id=str(tmp_path / "c"))
    loaded = {"lr": 0.0, "betas": (0.0, 0.0), "evil": None}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(loaded, storage_reader=SafeReader(tmp_path / "c"), planner=SafeLoadPlanner(tmp_path / "c"))
    assert "evil" in str(caught.value) and not marker.exists()
    plain = {"lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(plain, storage_reader=SafeReader(tmp_path / "c"), planner=SafeLoadPlanner(tmp_path / "c"))
    assert plain == {"lr": 0.1, "betas": (0.9, 0.95)}
