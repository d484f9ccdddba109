"""Every environment variable the project reads or writes, named here once and read or written only here.

Ours (MOAI_*), the user's folders, the world torchrun or SLURM gives a process, and the libraries' switches we
look at (W&B, the Hugging Face Hub, OpenMP). What our launcher tells its workers does not travel here: it is in
the job file they read (launch/worker.py). Tests set these variables as a user would.
"""

import os
from dataclasses import dataclass
from pathlib import Path

MOAI_HOME = "MOAI_HOME"  # the user's settings and the registry of running recipes
XDG_CONFIG_HOME = "XDG_CONFIG_HOME"  # where MOAI_HOME is when unset
MOAI_CACHE = "MOAI_CACHE"  # this machine's caches (the tiny checkpoint, converted models, CPU speed, traces)
PYTHONPATH = "PYTHONPATH"  # what a child Python process imports first
LLAMA_CPP = "MOAI_LLAMA_CPP"  # a llama.cpp source folder whose converter GGUF export uses (else fetched once)
FAULT_OOM_TOKENS = "MOAI_FAULT_OOM_TOKENS"  # test hook: a micro-batch of more tokens runs out of memory
FAULT_STEP_DELAY = "MOAI_FAULT_STEP_DELAY"  # test hook: seconds each step waits first, as on a slower machine
FAULT_MEMORY_HEADROOM = "MOAI_FAULT_MEMORY_HEADROOM"  # test hook: bytes of address space a step may add, for real
FAULT_NAN_STEP = "MOAI_FAULT_NAN_STEP"  # test hook: this step's embedding gradient is NaN, the others finite
FAULT_SAVE_DELAY = "MOAI_FAULT_SAVE_DELAY"  # test hook: seconds a save waits, half-written, as on a slower disk
TEST_COMPLETIONS = "MOAI_TEST_COMPLETIONS"  # test hook: recipes.grpo's completions from this function, not sampled
FORK_WORKERS = "MOAI_FORK_WORKERS"  # 0: a CPU flavor's workers start bare, as a GPU flavor's do (launch/elastic.py)
OMP_NUM_THREADS = "OMP_NUM_THREADS"  # a user's choice of threads per process, honoured as torchrun does
# The world a launcher gives a process (torchrun, our elastic launch) and the process group's rendezvous.
RANK, WORLD_SIZE, LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun's restarts of the group
# A SLURM job step (srun, one task per device), mapped onto torch's variables.
SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID = "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
SLURM_LAUNCH_NODE_IPADDR, SLURM_JOB_ID, SLURM_STEP_ID = "SLURM_LAUNCH_NODE_IPADDR", "SLURM_JOB_ID", "SLURM_STEP_ID"
# Weights & Biases: credentials, server and mode (wandb reads them too).
WANDB_API_KEY, WANDB_BASE_URL, WANDB_MODE, NETRC = "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE", "NETRC"
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"  # huggingface_hub downloads nothing


def _get(name: str) -> str | None:
    return os.environ.get(name) or None


def moai_home() -> Path:
    """The folder of this user's settings and of the registry of running recipes: MOAI_HOME, else
    $XDG_CONFIG_HOME/moai-recipes (~/.config/moai-recipes)."""
    if _get(MOAI_HOME):
        return Path(os.environ[MOAI_HOME]).expanduser()
    return Path(_get(XDG_CONFIG_HOME) or Path.home() / ".config").expanduser() / "moai-recipes"


def cache_dir() -> Path:
    """This machine's cache (the tiny checkpoint, converted models, the CPU's speed, layer traces, tokenised data,
    lm-eval's task index): MOAI_CACHE, else ~/.cache/moai-recipes."""
    return Path(_get(MOAI_CACHE) or Path.home() / ".cache" / "moai-recipes")


def llama_cpp_source() -> Path | None:
    """MOAI_LLAMA_CPP: a llama.cpp source folder (convert_hf_to_gguf.py, conversion/, gguf-py/)."""
    value = _get(LLAMA_CPP)
    return Path(value).expanduser() if value else None


def with_python_path(first: Path) -> dict:
    """This process's environment for a child Python process that imports from `first` before anything else."""
    return {**os.environ, PYTHONPATH: os.pathsep.join(filter(None, [str(first), _get(PYTHONPATH)]))}


def fault_oom_tokens() -> int | None:
    """MOAI_FAULT_OOM_TOKENS: micro-batches of more tokens fail as out of memory (None: never)."""
    value = _get(FAULT_OOM_TOKENS)
    return int(value) if value else None


def fault_step_delay() -> float:
    """MOAI_FAULT_STEP_DELAY: seconds each step waits before it runs (0: none), so that a test can signal a run
    mid-way whatever the machine's speed."""
    return float(_get(FAULT_STEP_DELAY) or 0)


def fault_memory_headroom() -> int | None:
    """MOAI_FAULT_MEMORY_HEADROOM: after the first step, the process may grow its address space by this many bytes
    more (RLIMIT_AS), so that a larger micro-batch runs out of memory for real, wherever in its forward or backward
    the allocation fails (None: no limit)."""
    value = _get(FAULT_MEMORY_HEADROOM)
    return int(value) if value else None


def fault_nan_step() -> int | None:
    """MOAI_FAULT_NAN_STEP: in this step (1 first) the gradient reaching the token embeddings is NaN and every later
    layer's finite, the backward's last gradient the only bad one, as an overflow in the first layer makes it (None:
    never)."""
    value = _get(FAULT_NAN_STEP)
    return int(value) if value else None


def fault_save_delay() -> float:
    """MOAI_FAULT_SAVE_DELAY: seconds a step checkpoint or an export waits with its files written aside, before it
    is renamed into place (0: none), so that a test can kill a run in the middle of a save."""
    return float(_get(FAULT_SAVE_DELAY) or 0)


def test_completions() -> str | None:
    """MOAI_TEST_COMPLETIONS: the dotted path of a function (prompt ids, seeds) -> completions that recipes.grpo takes
    its completions from instead of sampling them, so that a test gives TRL and recipes.grpo the same ones."""
    return _get(TEST_COMPLETIONS)


def fork_workers() -> bool:
    """MOAI_FORK_WORKERS: unless 0, a CPU flavor's workers are forked from one process that imported the recipe."""
    return _get(FORK_WORKERS) != "0"


def omp_threads() -> int | None:
    """The threads per process the user asked for with OMP_NUM_THREADS (None: not set)."""
    value = _get(OMP_NUM_THREADS)
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def rank() -> int:
    """This process's rank in a launched world (0 outside one)."""
    return int(_get(RANK) or 0)


def restart_count() -> int:
    """How many times torchrun has started this group again (0: the first start)."""
    return int(_get(TORCHELASTIC_RESTART_COUNT) or 0)


@dataclass(frozen=True)
class GivenWorld:
    """The world torchrun, our launcher or SLURM gave this process."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str  # torch.distributed's rendezvous: env:// (torchrun's store), or tcp:// (SLURM's first node)


def given_world() -> GivenWorld | None:
    """The world this process was started in; None when it runs on its own.

    A SLURM job step of several tasks (srun, one per device) meets on the node srun started from (where rank 0
    runs), at a port of the job's own: two jobs sharing a node must not meet at the same one. An sbatch script
    may set MASTER_ADDR and MASTER_PORT itself (docs/multinode.md)."""
    e = os.environ
    if RANK in e and WORLD_SIZE in e:
        return GivenWorld(int(e[RANK]), int(e[WORLD_SIZE]), int(e.get(LOCAL_RANK, "0")), "env://")
    if SLURM_PROCID in e and int(e.get(SLURM_NTASKS, "1")) > 1:
        addr = e.get(MASTER_ADDR) or e.get(SLURM_LAUNCH_NODE_IPADDR, "127.0.0.1")
        job, step = int(e.get(SLURM_JOB_ID, "0")), int(e.get(SLURM_STEP_ID, "0"))
        port = e.get(MASTER_PORT) or str(20000 + (job * 7 + step) % 20000)
        return GivenWorld(int(e[SLURM_PROCID]), int(e[SLURM_NTASKS]), int(e.get(SLURM_LOCALID, "0")),
                          f"tcp://{addr}:{port}")
    return None


def wandb_mode() -> str | None:
    return _get(WANDB_MODE)


def wandb_credentials() -> tuple[str | None, str, str | None]:
    """(WANDB_API_KEY, the W&B server's URL, NETRC's path)."""
    return _get(WANDB_API_KEY), _get(WANDB_BASE_URL) or "https://api.wandb.ai", _get(NETRC)


def hub_offline() -> bool:
    return bool(_get(HF_HUB_OFFLINE))
