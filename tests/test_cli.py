"""The `moai` tools as a person uses them: real processes, a real terminal, a recipe running beside.

Run: python -m pytest tests/test_cli.py -q   (the test that trains is marked slow: about a minute)
"""

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, make_hf_checkpoint

from moai_recipes.config.compose import load_config
from moai_recipes.flavors import resolve_flavor
from moai_recipes.launch.registry import registered, running, runs_dir
from moai_recipes.tools import cli
from moai_recipes.tools.gpu_stats import read_gpus


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A MOAI_HOME of this test's own: no choice of the developer's or of another test leaks in."""
    monkeypatch.setenv("MOAI_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def moai(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run_python("-m", "moai_recipes.tools.cli", *args, **kwargs)


def run_python(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root, as the README has users do."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env or os.environ.copy(), capture_output=True,
                          text=True, timeout=timeout)


def clean_error(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 2, one message naming `words`, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("error: "), result.stderr
    for w in words:
        assert w in result.stderr, (w, result.stderr)


def table_row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if f" {name} " in f" {line} ")


def test_the_console_script_is_the_cli():
    target = re.search(r'^moai = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    module, _, func = target.partition(":")
    assert getattr(import_module(module), func) is cli.main
    if shutil.which("moai"):  # installed (pip install -e .): the script a user types
        result = subprocess.run(["moai", "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "switch" in result.stdout and "validate" in result.stdout


def test_flavors_lists_every_flavor_and_stars_the_default():
    out = moai("flavors").stdout
    for name in ("Small.64GB", "xLarge.512GB", "4xLarge.2048GB", "48xLarge.24576GB", "auto", "cpu", "cpu-2", "cpu-4"):
        assert table_row(out, name)
    row = table_row(out, "4xLarge.2048GB")
    assert "32 x MI250 (16 cards)" in row and "64 GB" in row and "2048 GB" in row and "flavor=4xlarge" in row
    assert table_row(out, "auto").startswith("*") and not row.startswith("*")  # the shipped default: this machine
    assert "1 x CPU process" in table_row(out, "auto")  # no GPU here
    assert moai("switch", "4xlarge").returncode == 0
    assert table_row(moai("flavors").stdout, "4xLarge.2048GB").startswith("*")


def test_switch_persists_and_recipes_use_it_unless_the_command_line_says(home):
    result = moai("switch", "cpu-2")
    assert result.returncode == 0 and 'switched to  "cpu-2"' in result.stdout
    assert json.loads((home / "settings.json").read_text()) == {"flavor": "cpu-2"}
    assert "name: cpu-2" in run_python("-m", "recipes.full_finetune", "--cfg", "job").stdout
    assert load_config("plan", []).flavor.name == "cpu-2"
    assert load_config("plan", ["flavor=cpu"]).flavor.name == "cpu"  # the command line wins
    assert moai("switch", "4xLarge.2048GB").returncode == 0  # the MoAI name works too
    assert json.loads((home / "settings.json").read_text()) == {"flavor": "4xlarge"}


def test_a_bad_choice_says_what_is_valid_and_changes_nothing(home):
    moai("switch", "cpu-2")
    clean_error(moai("switch", "5xlarge"), "unknown flavor '5xlarge'", "4xlarge", "cpu-2")
    assert json.loads((home / "settings.json").read_text()) == {"flavor": "cpu-2"}


def test_a_home_that_cannot_be_written_is_a_clean_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "MOAI_HOME": str(tmp_path / "a-file" / "home")}  # its parent is a file: no folder there
    clean_error(moai("switch", "cpu-2", env=env), "cannot save the default flavor", "MOAI_HOME", "flavor=NAME")


class Terminal:
    """A process on a pseudo-terminal, driven as a person at the keyboard would."""

    def __init__(self, *args: str):
        self.fd, tty = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdin=tty, stdout=tty, stderr=tty,
                                     env={**os.environ, "TERM": "dumb"}, close_fds=True)
        os.close(tty)
        self.seen = ""

    def expect(self, text: str, timeout: float = 60) -> str:
        """Read until `text` appears; return what came since the last expect."""
        start, deadline = len(self.seen), time.monotonic() + timeout
        while text not in self.seen[start:]:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no {text!r} within {timeout} s; the terminal shows:\n{self.seen}"
            self.seen += os.read(self.fd, 4096).decode(errors="replace")
        return self.seen[start:]

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def test_interactive_switch_in_a_terminal(home):
    term = Terminal("-m", "moai_recipes.tools.cli", "switch")
    screen = term.expect("Selection (1-17, q, Q): ")
    assert "Current MoAI Accelerator: auto\n" in screen.replace("\r", "")
    assert "1. Small.64GB\r\n" in screen and "8. 4xLarge.2048GB\r\n" in screen and "14. auto  *" in screen
    term.type("8")
    screen = term.expect("Selection (1-17, q, Q): ")
    assert 'The MoAI Accelerator model is successfully switched to  "4xLarge.2048GB".' in screen
    assert "8. 4xLarge.2048GB  *" in screen and "14. auto\r\n" in screen and "15. cpu\r\n" in screen
    term.type("99")  # not on the list: asks again, changes nothing
    assert "not a choice" in term.expect("Selection (1-17, q, Q): ")
    term.type("q")
    assert term.proc.wait(timeout=30) == 0
    assert json.loads((home / "settings.json").read_text()) == {"flavor": "4xlarge"}


def test_registration_ends_with_the_run_even_when_it_fails():
    flavor = resolve_flavor(name="cpu", device="cpu", memory_gb=None, processes=1, device_memory_gb=None)
    with pytest.raises(RuntimeError), registered(flavor, job_id="123456"):
        assert [(r.pid, r.job_id) for r in running()] == [(os.getpid(), "123456")]
        raise RuntimeError("a crash in the training loop")
    assert running() == [] and not list(runs_dir().glob("*.json")) and "MOAI_JOB_ID" not in os.environ


# A stand-in for a launcher and its two workers: each worker holds 200 MiB.
LAUNCHER = """
import subprocess, sys, time
from moai_recipes.flavors import resolve_flavor
from moai_recipes.launch.registry import new_job_id, registered
worker = "import time; x = bytes([1]) * (200 * 2**20); print('up', flush=True); time.sleep(120)"
flavor = resolve_flavor(name="cpu-2", device="cpu", memory_gb=None, processes=2, device_memory_gb=None)
with registered(flavor, job_id=new_job_id()):
    workers = [subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    [w.stdout.readline() for w in workers]
    print("ready", flush=True)
    time.sleep(120)
"""


def test_smi_counts_the_memory_of_the_workers_a_run_launched():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert launcher.stdout.readline().strip() == "ready"
        out = moai("smi").stdout
        row = table_row(out, str(launcher.pid))  # one row: the workers are part of their launcher's job
        assert int(row.split("|")[5].split()[0]) >= 400
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


# A launcher whose workers register as a recipe's do (launch/entry.py registers the job, launch/worker.py each
# worker of it, with the job id and the launcher's pid the job file gives them).
REGISTERING_LAUNCHER = """
import os, subprocess, sys, time
from moai_recipes.flavors import resolve_flavor
from moai_recipes.launch.registry import new_job_id, registered
worker = '''
import sys, time
from moai_recipes.flavors import resolve_flavor
from moai_recipes.launch.registry import registered
flavor = resolve_flavor(name="cpu-2", device="cpu", memory_gb=None, processes=2, device_memory_gb=None)
with registered(flavor, job_id=sys.argv[1], launcher=int(sys.argv[2])):
    print("up", flush=True)
    time.sleep(120)
'''
job = new_job_id()
with registered(resolve_flavor(name="cpu-2", device="cpu", memory_gb=None, processes=2, device_memory_gb=None), job_id=job):
    workers = [subprocess.Popen([sys.executable, "-c", worker, job, str(os.getpid())], stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    [w.stdout.readline() for w in workers]
    print(*[w.pid for w in workers], flush=True)
    time.sleep(120)
"""


def test_workers_left_running_by_a_killed_launcher_stay_listed_until_they_end():
    launcher = subprocess.Popen([sys.executable, "-c", REGISTERING_LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True)
    workers = []
    try:
        workers = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(workers) == 2, workers
        job = [r for r in running() if r.pid == launcher.pid]
        assert len(job) == 1 and [r.pid for r in running()] == [launcher.pid]  # one row: the workers are its tree
        launcher.kill()  # kill -9 the launcher alone: its workers live on (as torch's elastic workers do)
        launcher.wait()
        orphans = running()
        assert sorted(r.pid for r in orphans) == sorted(workers) and {r.job_id for r in orphans} == {job[0].job_id}
        out = moai("smi").stdout
        assert all(job[0].job_id in table_row(out, str(pid)) for pid in workers), out
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:  # the orphans are reaped by init, not by us
        time.sleep(0.2)
    assert running() == [] and not list(runs_dir().glob("*.json"))


@pytest.mark.slow
def test_smi_shows_a_running_recipe_and_forgets_it_once_killed(tmp_path):
    out_dir = tmp_path / "run"
    recipe = subprocess.Popen(
        [sys.executable, "-m", "recipes.full_finetune", "model=tiny", "dataset=demo", "flavor=auto", "logger=stdout",
         f"output_dir={out_dir}", "epochs=400"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (out_dir / "metrics.jsonl").exists() or not (out_dir / "metrics.jsonl").read_text():
            assert recipe.poll() is None and time.monotonic() < deadline, "the recipe did not reach its first step"
            time.sleep(0.5)
        out = moai("smi").stdout
        device, process = table_row(out, "MoAI Accelerator"), table_row(out, str(recipe.pid))
        assert "* 0" in device and " auto " in device and "%" in device
        assert "python -m recipes.full_finetune model=tiny" in process and int(process.split("|")[5].split()[0]) > 50
    finally:
        recipe.kill()  # kill -9: the run cannot unregister itself
        recipe.wait()
    out = moai("smi").stdout
    # The pid as a number of its own: 4106 was once in "24106 MiB", the host's memory (a fresh clone, 2026-11-29).
    assert not re.search(rf"(?<!\d){recipe.pid}(?!\d)", out) and "Processes:" not in out, out
    assert not list(runs_dir().glob("*.json"))  # the dead run's file is gone too


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo "30000, 81559, 90"; echo "10000, 81559, 70" ;;
  --query-compute-apps=*) echo "{pid}, 1234"; echo "99999999, 500" ;;
esac
"""


def test_gpu_figures_come_from_the_driver_tool(tmp_path, monkeypatch):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI.format(pid=sleeper.pid))
        (bin_dir / "nvidia-smi").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        gpus = read_gpus()
        assert (gpus.used_mib, gpus.total_mib, gpus.utilization) == (40000, 2 * 81559, 80)
        # A run on a GPU flavor other than the current one: smi shows that flavor as device 1.
        p = psutil.Process(sleeper.pid)
        run = dict(job_id="123456", host=socket.gethostname(), pid=p.pid, create_time=p.create_time(), command="python -m recipes.lora_finetune",
                   flavor="4xLarge.2048GB", device_kind="gpu", total_memory_gb=2048)
        runs_dir().mkdir(parents=True)
        (runs_dir() / f"{p.pid}.json").write_text(json.dumps(run))
        out = moai("smi").stdout
        assert "1234 MiB" in table_row(out, "4xLarge.2048GB") and "80 %" in table_row(out, "4xLarge.2048GB")
        assert table_row(out, "4xLarge.2048GB").startswith("|    1") and "* 0" in table_row(out, "auto")
        assert "1234 MiB" in table_row(out, str(p.pid))
    finally:
        sleeper.kill()
        sleeper.wait()


FAKE_ROCM_SMI = """#!/bin/sh
echo '{"card0": {"GPU use (%)": "100", "VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "21474836480"},
       "card1": {"GPU use (%)": "50", "VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "10737418240"},
       "system": {"Driver version": "6.7.0"}}'
"""


def test_amd_figures_come_from_rocm_smi(tmp_path, monkeypatch):
    from moai_recipes.tools import gpu_stats

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rocm-smi").write_text(FAKE_ROCM_SMI)
    (bin_dir / "rocm-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # no nvidia-smi, whatever this machine has
    monkeypatch.setattr(gpu_stats, "_nvml", lambda: None)
    gpus = read_gpus()
    assert (gpus.used_mib, gpus.total_mib, gpus.utilization) == (30 * 1024, 2 * 65520, 75)
    assert gpus.per_pid_mib is None  # rocm-smi does not tell: smi shows the GPUs' figure for the device


def test_ls_lists_the_recipes_and_the_options_of_each_group():
    out = moai("ls").stdout
    for recipe in ("full_finetune", "lora_finetune", "plan"):
        assert f"python -m recipes.{recipe}" in table_row(out, recipe)
    assert "mistral" in table_row(out, "model") and "4xlarge" in table_row(out, "flavor")


def test_a_copied_config_runs_from_its_own_folder(tmp_path):
    mine = tmp_path / "mine"
    result = moai("cp", "full_finetune", str(mine / "my.yaml"))
    assert result.returncode == 0 and f"--config-path {mine} --config-name my" in result.stdout
    copy = (mine / "my.yaml").read_text()  # every key with its default: the copy is what a user edits
    (mine / "my.yaml").write_text(copy.replace("batch_size: 16 ", "batch_size: 4 "))
    assert moai("cp", "model/mistral", f"{mine}/").returncode == 0  # lands where Hydra looks: mine/model/
    edited = (mine / "model" / "mistral.yaml").read_text().replace("mistralai/Mistral-7B-v0.1", "me/my-mistral")
    (mine / "model" / "mistral.yaml").write_text(edited)
    job = run_python("-m", "recipes.full_finetune", "--config-path", str(mine), "--config-name", "my", "model=mistral",
                     "dataset=chat", "--cfg", "job")  # dataset/ is not in mine/: the shipped one
    assert job.returncode == 0, job.stderr
    assert "batch_size: 4\n" in job.stdout and "hf_repo: me/my-mistral" in job.stdout and "kind: chat" in job.stdout
    clean_error(moai("cp", "full_finetune", str(mine / "my.yaml")), "exists")  # never overwrites
    assert "batch_size: 4 " in (mine / "my.yaml").read_text()
    clean_error(moai("cp", "model/mistrl", str(tmp_path / "x.yaml")), "did you mean model/mistral")


def test_validate_passes_a_good_config_and_names_what_is_wrong_in_a_bad_one(tmp_path):
    moai("cp", "full_finetune", str(tmp_path / "my.yaml"))
    good = moai("validate", str(tmp_path / "my.yaml"), "flavor=cpu-2", "max_steps=3")
    assert good.returncode == 0, good.stderr
    assert "composes for recipes.full_finetune" in good.stdout and "Flavor cpu-2: 2 x cpu" in good.stdout
    assert "Model tiny" in good.stdout and "80 samples" in good.stdout and "3 steps" in good.stdout
    assert good.stdout.rstrip().splitlines()[-1].startswith("OK")
    # Mistakes in the config itself are found before torch is even imported: seconds.
    clean_error(moai("validate", "full_finetune", "batch_size=0"), "batch_size=0 must be at least 1")
    clean_error(moai("validate", "full_finetune", "model=mistrall"), "did you mean model=mistral")
    clean_error(moai("validate", "model/mistral"), "moai validate full_finetune model=mistral")


def validate_here(capsys, *args: str) -> tuple[int, str]:
    """`moai validate ARGS` in this process (torch imported once for the variations below): exit code, output."""
    try:
        code = cli.main(["validate", *args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_validate_checks_the_checkpoint_folder_has_what_the_model_needs(tmp_path, capsys):
    folder = make_hf_checkpoint(tmp_path / "mistral", "mistral")
    code, out = validate_here(capsys, "lora_finetune", "model=mistral", f"model.checkpoint_dir={folder}")
    assert code == 0 and "Model mistral from" in out and "LoRA: rank 8 on q_proj, v_proj" in out, out
    code, out = validate_here(capsys, "full_finetune", "model=qwen2_5_0_5b", f"model.checkpoint_dir={folder}")
    assert code == 2 and "holds a mistral model" in out
    (folder / "tokenizer.json").unlink()
    code, out = validate_here(capsys, "lora_finetune", "model=mistral", f"model.checkpoint_dir={folder}")
    assert code == 2 and "no tokenizer.json" in out
    next(folder.glob("*.safetensors")).unlink()
    code, out = validate_here(capsys, "lora_finetune", "model=mistral", f"model.checkpoint_dir={folder}")
    assert code == 2 and "no *.safetensors weights" in out


def test_validate_checks_what_generate_reads_an_adapter_and_its_base_included(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    qwen = make_hf_checkpoint(tmp_path / "qwen2", "qwen2")
    code, out = validate_here(capsys, "generate", f"model.checkpoint_dir={qwen}", "temperature=0.7")
    assert code == 0 and f"Model from {qwen}: qwen2" in out and "temperature 0.7" in out, out  # any family, as generate
    assert "\nOK: nothing wrong found.\n" in out and "recipes.plan" not in out  # no training hint for generate
    adapter = tmp_path / "adapter"  # made by peft itself; its config names the qwen2 folder as its base
    get_peft_model(AutoModelForCausalLM.from_pretrained(str(qwen)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
                   ).save_pretrained(adapter)
    code, out = validate_here(capsys, "generate", f"adapter_dir={adapter}")
    assert code == 0 and f"Model from {qwen}" in out and f"Adapter {adapter}: r=4" in out, out
    other = make_hf_checkpoint(tmp_path / "llama", "llama", hidden=128)
    code, out = validate_here(capsys, "generate", f"adapter_dir={adapter}", f"model.checkpoint_dir={other}")
    assert code == 2 and "trained for another base model" in out, out
    for bad, words in (("temperature=-1", "temperature=-1"), ("device_map=spread", "balanced_low_0"),
                       ("top_p=0", "top_p=0"), ("adapter_dir=/nonexistent", "adapter_dir=/nonexistent")):
        code, out = validate_here(capsys, "generate", f"model.checkpoint_dir={qwen}", bad)
        assert code == 2 and words in out, (bad, out)


def test_run_starts_a_recipe_from_any_folder_and_passes_its_command_line(tmp_path):
    # From a folder that is not the repository, `python -m recipes...` would find torchtune's `recipes`;
    # `moai run` finds ours, and the recipe gets every argument, --cfg and --help included.
    beside = Path(sys.executable).with_name("moai")  # the venv's, also when its bin/ is not on PATH
    moai_script = str(beside) if beside.exists() else shutil.which("moai")
    if not moai_script:
        pytest.skip("the console script is not installed (pip install -e .)")
    where = dict(cwd=tmp_path, capture_output=True, text=True, timeout=300)
    r = subprocess.run([moai_script, "run", "plan", "flavor=cpu-2", "model=tiny", "batch_size=8",
                        f"output_dir={tmp_path / 'out'}"], **where)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Chosen:" in r.stdout and json.loads((tmp_path / "out" / "plan.json").read_text())["flavor"]
    r = subprocess.run([moai_script, "generate", "--cfg", "job", "prompt=hi"], **where)
    assert r.returncode == 0 and "max_new_tokens:" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([moai_script, "generate", "--help"], **where)
    assert r.returncode == 0 and "with the groups model," in r.stdout, r.stdout + r.stderr
    clean_error(subprocess.run([moai_script, "run", "full_finetun"], **where), "'full_finetun'", "full_finetune")


UNTOUCHED_TORCH = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules, file=sys.stderr))
if sys.argv[1] == "moai":
    from moai_recipes.tools.cli import main
    sys.exit(main(sys.argv[2:]))
from moai_recipes.launch.entry import main
sys.exit(main("full_finetune", sys.argv[2:]))
"""


def test_what_needs_no_tensor_answers_without_importing_torch():
    """torch's import is 2 s of a command's start: the flavors table, a switch, a config printed and a mistyped key
    answer without it (flavor=auto looks for a GPU's device files before asking torch)."""
    for args, code in ((["moai", "flavors"], 0), (["moai", "switch", "cpu"], 0),
                       (["recipe", "--cfg", "job"], 0), (["recipe", "optimizer.lrr=3"], 2)):
        r = run_python("-c", UNTOUCHED_TORCH, *args)
        assert r.returncode == code and "torch imported: False" in r.stderr, (args, r.stdout[-500:], r.stderr[-2000:])
