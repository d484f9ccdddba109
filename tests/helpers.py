"""What several test modules share: running a recipe (in this process where no process boundary is under test),
reading a run's outputs, and the files tests train on.

`run_recipe` runs a recipe as its command runs it and returns a subprocess.CompletedProcess-like result. A run of
one process (flavor=cpu, the default) goes through the same entry (launch/entry.main) in this process: the
imports are paid once for the whole suite instead of ~4.7 s a run. A run of several processes (flavor=cpu-2,
cpu-4) is a process of its own, where the launcher, the workers and their exit codes are what is tested: forked
from a process that imported the training stack once (tests/zygote.py: 5.3 s of CPU a run saved, 1:30 of the
suite's 11 minutes), or, when it changes a variable a library reads as it is imported, and whenever a test asks
with `isolated=True`, a fresh `python -m recipes.X`. `start_forked` forks one from the zygote without waiting for it,
for the tests that signal or kill a run mid-way.
"""

import atexit
import contextlib
import importlib
import io
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests import zygote

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ("recipes.full_finetune", "recipes.lora_finetune", "recipes.dpo", "recipes.grpo")


def run_recipe(*args, module: str = "recipes.full_finetune", env: dict | None = None, timeout: int = 600,
               isolated: bool | None = None):
    """`python -m module args` with `env` over this environment (None removes a variable); in this process
    unless it starts several processes or logs to W&B (forked from the zygote) or `isolated=True` (a fresh
    process)."""
    args = [str(a) for a in args]
    several = any(a in ("flavor=cpu-2", "flavor=cpu-4") for a in args)
    # A W&B run gets a process of its own, as a user's command does: the service it starts ends with it, its files
    # written out. Runs in pytest's process shared one service, and twice in whole suites of 2026-11-28 a finished
    # run's file was not there to read (once not within a minute).
    forked = several and module in TRAINING or "logger=wandb" in args
    if isolated is None and forked and zygote.runtime_only(env or {}):
        return _forked(args, module=module, env=env, timeout=timeout)
    if isolated or (isolated is None and several):
        return _in_subprocess(args, module=module, env=env, timeout=timeout)
    return _in_process(args, module=module, env=env)


def machine_cache(tmp_path_factory) -> Path:
    """The suite's MOAI_CACHE: the tiny checkpoint, this CPU's measured speed, the planner's layer traces, tokenised
    data. One for the whole run, also under `pytest -n 2`, whose workers would otherwise each measure and trace the
    same things (the cache is made for concurrent processes: written aside and renamed, tokenising under a lock).
    Tests about the cache itself give their own."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "moai-cache"


def command_env(changes: dict | None = None) -> dict:
    """The environment of a recipe's process: this one, quiet and offline, with `changes` (None removes one). Not
    this process's W&B service: a run in this process (a test's in-process run with logger=wandb) leaves its address
    in WANDB_SERVICE, and a command given it writes its runs through that service rather than one of its own, as a
    user's command would."""
    full = {**os.environ, "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "WANDB_SERVICE": None, **(changes or {})}
    return {k: v for k, v in full.items() if v is not None}


def _in_subprocess(args: list[str], *, module: str, env: dict | None, timeout: int):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=command_env(env), capture_output=True,
                          text=True, timeout=timeout)


_ZYGOTE: list[subprocess.Popen] = []  # this pytest process's (tests/zygote.py), started at its first command


def _forked(args: list[str], *, module: str, env: dict | None, timeout: int):
    """`python -m module args` forked from this pytest process's zygote, which imported the training stack once
    (tests/zygote.py); as subprocess.run would return it."""
    proc = start_forked(*args, module=module, env=env)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:  # as subprocess.run's timeout: the command's process killed, its output given
        proc.kill()
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_command(module: str, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m module args` (a test's own module, say one that forks its ranks) forked from the zygote."""
    return _forked([str(a) for a in args], module=module, env=None, timeout=timeout)


def start_forked(*args, module: str = "recipes.full_finetune", env: dict | None = None, merged: bool = False,
                 stdout: Path | None = None) -> "ForkedProcess":
    """`python -m module args` started from this pytest process's zygote and not waited for: what
    subprocess.Popen(..., text=True) gives a test that signals or kills a run mid-way, without the 5 s of imports
    a fresh process pays. `merged`: stderr into stdout (stderr=subprocess.STDOUT); `stdout`: a file to write it to
    instead of one of its own. One at a time: the zygote serves its next command once this one ended (a run a failed
    test left running is killed first)."""
    if not zygote.runtime_only(env or {}):
        raise ValueError(f"{sorted(env)}: a variable a library reads as it is imported needs a process of its own")
    if not _ZYGOTE or _ZYGOTE[0].poll() is not None:
        # Unbuffered: a line read never reads ahead into the next, which select() then would not see.
        _ZYGOTE[:] = [subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=ROOT, env=command_env(),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)]
        atexit.register(_ZYGOTE[0].kill)
    return ForkedProcess(_ZYGOTE[0], [str(a) for a in args], module=module, env=env, merged=merged, stdout=stdout)


class ForkedProcess:
    """A command forked from the zygote, held as subprocess.Popen holds a process: pid, poll, wait, send_signal,
    kill, communicate (its output, read from the files it wrote once it ended)."""

    in_flight: "ForkedProcess | None" = None

    def __init__(self, server: subprocess.Popen, args: list[str], *, module: str, env: dict | None, merged: bool,
                 stdout: Path | None):
        if ForkedProcess.in_flight is not None:  # left running by a test that failed before it ended it
            ForkedProcess.in_flight.kill()
            ForkedProcess.in_flight.communicate(timeout=120)
        self.args, self.returncode, self._server = [sys.executable, "-m", module, *args], None, server
        self._folder = tempfile.TemporaryDirectory(prefix="moai-forked-")
        self._out = Path(stdout) if stdout else Path(self._folder.name) / "stdout"
        self._err = self._out if merged else Path(self._folder.name) / "stderr"
        server.stdin.write(json.dumps({"module": module, "args": args, "env": command_env(env), "cwd": str(ROOT),
                                       "stdout": str(self._out), "stderr": str(self._err)}).encode() + b"\n")
        self.pid = json.loads(server.stdout.readline() or b'{"pid": null}')["pid"]
        if self.pid is None:
            raise RuntimeError(f"tests/zygote.py ended (exit code {server.wait()}) before forking {module} {args}")
        ForkedProcess.in_flight = self

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._server.stdout], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._server.stdout], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended()
        return self.returncode

    def _ended(self) -> None:
        self.returncode = json.loads(self._server.stdout.readline())["code"]
        ForkedProcess.in_flight = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        out = self._out.read_text()
        err = None if self._err == self._out else self._err.read_text()
        self._folder.cleanup()
        return out, err


def _in_process(args: list[str], *, module: str, env: dict | None):
    """The command's own entry point in this process, its output captured and its exit code returned."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with _environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if module in TRAINING:
                from moai_recipes.launch.entry import main

                code = main(module.rpartition(".")[2], args)
            else:
                code = importlib.import_module(f"moai_recipes.{module}").main(args)
        except SystemExit as e:  # exit_on_user_error, --help, --cfg
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # a crash: what `python -m` would print, and its exit code
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess([module, *args], code or 0, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _environment(changes: dict):
    before = {k: os.environ.get(k) for k in changes}
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_hf_checkpoint(folder: Path, family: str = "llama", *, tie: bool = False, max_shard_size: str | None = None,
                       dtype: str = "float32", num_layers: int = 2, hidden: int = 64, intermediate: int | None = None,
                       seed: int = 0, kv_heads: int = 2, experts: int = 8) -> Path:
    """Write a tiny Hugging Face checkpoint of `family` with transformers' own save_pretrained."""
    import transformers

    from moai_recipes.models.tiny import demo_texts, write_tokenizer

    folder = Path(folder)
    vocab = write_tokenizer(folder, demo_texts(), vocab_size=384)
    ids = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden + 32,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                  pad_token_id=ids["<|pad|>"], tie_word_embeddings=tie)
    if family == "llama":
        cfg = transformers.LlamaConfig(rope_theta=500000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(rope_theta=10000.0, sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":  # per-head q/k norm, and a head_dim that is not hidden / heads
        cfg = transformers.Qwen3Config(rope_theta=1000000.0, head_dim=hidden // 2, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":  # 8 experts, top 2 not renormalised; layer 1 dense (mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(rope_theta=1000000.0, head_dim=hidden // 2, num_experts=experts,
                                          num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                                          mlp_only_layers=[1] if num_layers > 2 else [], norm_topk_prob=False,
                                          **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":  # every layer sparse, top 2 renormalised
        cfg = transformers.MixtralConfig(rope_theta=1000000.0, num_local_experts=experts, num_experts_per_tok=2,
                                         **common)
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).to(getattr(torch, dtype))
    with torch.no_grad():  # norms start at ones; perturb them so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # a router of std 0.02 scores every expert alike: sharpen it
                p.mul_(50)
            if ".experts." in name:  # experts of std 0.02 add next to nothing to the residual stream: weigh them
                p.mul_(4 if family == "qwen3_moe" else 2)  # (Mixtral's are wider)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def make_peft_adapter(base: Path, folder: Path, modules: list[str], *, std: float = 0.2):
    """A PEFT LoRA adapter on `base` saved to `folder` (B drawn at random, so that it changes the model); returns the
    peft model, whose merge_and_unload() is the reference."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    lora.save_pretrained(folder)
    return lora


QUESTIONS = [("What color is the sky on a clear day?", ["blue", "green", "red", "purple"], 0),
             ("Which animal barks?", ["cat", "dog", "fish"], 1),
             ("How many legs has a spider?", ["six", "eight", "four"], 1),
             ("What do bees make?", ["milk", "silk", "honey"], 2),
             ("Which is a planet?", ["Mars", "Paris", "Nile", "Everest"], 0),
             ("What is frozen water?", ["steam", "ice"], 1)]


def make_quiz_tasks(folder: Path) -> Path:
    """Two lm-eval tasks of our own over local files: quiz_mc (multiple choice) and quiz_gen (generation)."""
    folder.mkdir()
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, label in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "label": label}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for q, choices, label in QUESTIONS:
            f.write(json.dumps({"prompt": f"Q: {q}\nA:", "answer": choices[label]}) + "\n")
    (folder / "quiz_mc.yaml").write_text(f"""task: quiz_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")
    (folder / "quiz_gen.yaml").write_text(f"""task: quiz_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 12, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")
    return folder


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in metrics(out)]


def plan_of(out: Path) -> dict:
    """The plan a run ran (plan.json's chosen)."""
    return json.loads((out / "plan.json").read_text())["chosen"]


# Force FSDP2's shards over every process: the planner may also cut the model (tensor, pipeline) or its rows
# (context) where it prices that faster, and a test of FSDP2 must run FSDP2.
FSDP = ("plan.replicate=false", "plan.tensor_parallel=1", "plan.pipeline_stages=1", "plan.context_parallel=1")


def layout(out: Path) -> str:
    """How a run spread its model, from its plan.json: 'sharded' (FSDP2), 'replicated', 'single' (one process), or
    its mesh ('pipeline 2 (1f1b) x data 1 x tensor 2', 'data 1 x context 2 (ulysses)', 'pipeline 2 (1f1b) x data 1 x
    context 2 (gather)') where it cut the model or its rows."""
    plan = plan_of(out)
    stages = (f"pipeline {plan['pipeline_stages']} ({plan['pipeline_schedule']}) x " if plan["pipeline_stages"] > 1
              else "")
    if plan["context_parallel"] > 1:
        return (f"{stages}data {plan['data_parallel']} x context {plan['context_parallel']} "
                f"({plan['context_parallel_way']})" + (f" x tensor {plan['tensor_parallel']}"
                                                       if plan["tensor_parallel"] > 1 else ""))
    if plan["tensor_parallel"] > 1 or plan["pipeline_stages"] > 1:
        return f"{stages or 'pipeline 1 x '}data {plan['data_parallel']} x tensor {plan['tensor_parallel']}"
    if plan["num_devices"] == 1:
        return "single"
    assert plan["sharded"] != plan["replicate"], plan
    return "sharded" if plan["sharded"] else "replicated"


def peak_error(stdout: str) -> float:
    """The error of the planner's peak memory that a run states at its end (measured against predicted)."""
    m = re.search(r"Peak tensor memory per device: predicted [\d.]+ GiB, measured [\d.]+ GiB \(([+-][\d.]+)%\)", stdout)
    assert m, stdout[-2000:]
    return float(m.group(1)) / 100


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def without_packages(folder: Path, *names: str) -> dict:
    """The environment changes under which a process cannot import the packages `names` (as on a machine where
    they were never installed): a sitecustomize in `folder`, first on PYTHONPATH, marks them absent."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{n!r}] = None  # its import fails\n" for n in names))
    return {"PYTHONPATH": str(folder)}


def assert_same_weights(expected: Path, got: Path) -> None:
    """The Hugging Face folders `expected` and `got` hold the same tensors, bit for bit: the same names (every layer
    of the config's, none missing on either side) and the same values."""
    ref, out = tensors(expected), tensors(got)
    layers = json.loads((expected / "config.json").read_text())["num_hidden_layers"]
    assert {f"model.layers.{i}." for i in range(layers)} <= {re.sub(r"(layers\.\d+\.).*", r"\1", k) for k in ref}, sorted(ref)
    assert ref.keys() == out.keys(), sorted(set(ref) ^ set(out))
    different = [k for k in ref if not torch.equal(ref[k], out[k])]
    assert not different, f"{len(different)} of {len(ref)} tensors differ: {different[:5]}"


def write_varied_text(path: Path, words: list[str], samples: int = 48) -> Path:
    """Plain text rows (`text`) of `words` drawn at random, from a few to 200 words a row with a long tail (seeded)."""
    rng = random.Random(0)
    rows = []
    for _ in range(samples):
        n = min(int(rng.lognormvariate(3.0, 0.9)) + 2, 200)
        rows.append({"text": " ".join(rng.choice(words) for _ in range(n))})
    return write_jsonl(path, rows)


def last_wins(*args: str) -> list[str]:
    """Command-line overrides with a later value of a key in place of an earlier one (Hydra refuses a key given
    twice): a test's common settings, then what one run changes."""
    return list({a.split("=")[0]: a for a in args}.values())


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def instruct_rows(n: int = 24) -> list[dict]:
    return [{"instruction": f"Say the number {i} in words.", "input": "", "output": f"The number is {i}."}
            for i in range(n)]


def setup(*overrides, recipe="full_finetune"):
    """A recipe's config, its model's spec (from the config alone) and its flavor, as the planner gets them."""
    from moai_recipes.config.compose import load_config
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.models.spec import spec_for

    cfg = load_config(recipe, list(overrides))
    return cfg, spec_for(architecture=cfg.model.architecture, checkpoint_dir=None), resolve_flavor(**cfg.flavor)


def wandb_records(run_dir: Path) -> dict:
    """What an offline W&B run logged, read back from its run-*.wandb file with wandb's own record type
    (wandb.proto's Record; wandb 0.31 ships no reader of its own): {"history": [rows with "_step"], "summary": {},
    "config": {}}. The file is LevelDB's log format: a 7-byte header, then 32 KiB blocks of records, each a 7-byte
    header (crc32c, length, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes.

    W&B's service writes the file, not the run's process, and `run.finish()` can return before the service has
    written it out: a run in pytest's process (whose service lived on) was read back with no history three times in
    whole suites, and twice (2026-11-28) before the file itself was there; W&B runs are now processes of their own
    (run_recipe), and the reader still waits for what it reads. The run ends with an "exit" record: read until the
    file and that record are there (a minute at most, then say so)."""
    found = None
    for _ in range(600):
        paths = list(Path(run_dir).glob("run-*.wandb"))
        assert len(paths) <= 1, paths
        data = paths[0].read_bytes() if paths else b""
        if len(data) >= 7:  # its header written
            found = _wandb_file(data)
            if found.pop("exit"):
                return found
        time.sleep(0.1)
    raise AssertionError(f"{run_dir}: no run-*.wandb file with an exit record a minute after the run ended (what was "
                         f"there: {found})")


def _wandb_file(data: bytes) -> dict:
    import struct

    from wandb.proto import wandb_internal_pb2

    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    values = lambda items: {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
    found = {"history": [], "summary": {}, "config": {}, "exit": False}
    pos, record = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if kind == 0:  # a block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        record = chunk if kind in (1, 2) else record + chunk
        if kind in (2, 3):
            continue
        r = wandb_internal_pb2.Record()
        r.ParseFromString(record)
        which = r.WhichOneof("record_type")
        found["exit"] |= which == "exit"
        if which == "history":
            found["history"].append({**values(r.history.item), "_step": r.history.step.num})
        elif which == "summary":
            found["summary"].update(values(r.summary.update))
        elif which in ("run", "config"):
            update = (r.run.config if which == "run" else r.config).update
            found["config"].update({k: v.get("value", v) if isinstance(v, dict) else v
                                    for k, v in values(update).items()})
    return found


class SmallDisk:
    """A tmpfs of `megabytes` at `path`; `fill()` takes what is left with a ballast file, `empty()` frees it."""

    def __init__(self, path: Path, megabytes: int):
        self.path, self.ballast = path, path / f"ballast-{uuid.uuid4().hex[:6]}"
        path.mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            import pytest

            pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()}); these tests need root")

    def fill(self):
        # Unbuffered: nothing is left for the close to flush onto the full disk (a buffered close raised ENOSPC).
        with open(self.ballast, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 2**16)
            except OSError:
                pass

    def empty(self):
        self.ballast.unlink(missing_ok=True)

    def close(self):
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def model_of(folder, lora=None, max_seq_len: int = 128):
    """Our model of a checkpoint folder (RoPE for rows up to `max_seq_len`); with `lora` (LoraOptions) its adapters
    initialised, B drawn at random (so that they change the model)."""
    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.models.hf_format import HFFolder, load_weights
    from moai_recipes.models.lora import freeze_base, init_adapters

    hf = HFFolder.open(folder)
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=max_seq_len, lora=lora.builder_kwargs() if lora else None)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf, allow_missing=(".lora_a.", ".lora_b.") if lora else ())
    if lora:
        freeze_base(model)
        init_adapters(model, seed=0)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_b." in name:
                    p.normal_(0, 0.2)
    return model, hf.spec


def start_adapter(model: Path, folder: Path, seed: int) -> Path:
    """Our LoRA start (rank 4 on q_proj and v_proj, A as init_adapters draws it with `seed`, B zero) as a PEFT
    adapter in `folder`: what TRL starts from in the tests that compare a LoRA run with it."""
    from moai_recipes.models.build import build_model
    from moai_recipes.models.lora import gather_adapters, init_adapters, lora_options, save_adapter
    from moai_recipes.models.spec import read_spec

    opts = lora_options({"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": False, "apply_to_output": False,
                         "rank": 4, "alpha": 8.0, "dropout": 0.0, "quantize_base": False}, spec=read_spec(model))
    start = build_model(read_spec(model), max_seq_len=128, lora=opts.builder_kwargs())
    init_adapters(start, seed=seed)
    save_adapter(gather_adapters(start), opts=opts, out_dir=folder, base_model=str(model))
    return folder
