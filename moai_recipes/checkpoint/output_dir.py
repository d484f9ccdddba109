"""A run's folder: never overwrite an earlier run, resume one when asked, write the config and the plan.

`resume=auto` continues an earlier run of the same config from its newest complete checkpoint;
`resume=never` refuses a folder that holds a run; `resume=PATH` continues from that checkpoint.
"""

import copy
import fcntl
import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moai_recipes import env
from moai_recipes.checkpoint.integrity import damage
from moai_recipes.errors import UserError
from moai_recipes.files import write_json, write_text

# What marks a folder as holding an earlier run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "plan.json", "model", "adapter", "checkpoints")
# What may change between a run and its resumption: where and how it runs, not what it computes.
RESUMABLE_CHANGES = ("flavor", "plan", "logger", "output_dir", "resume", "resume_force", "max_steps",
                     "checkpoint_every", "checkpoint_keep",
                     "max_restarts", "skip_nonfinite_steps", "sample_max_new_tokens")
STEP_PREFIX = "step-"  # checkpoints/step-000004: a complete step checkpoint (checkpoint/steps.py writes them)
# The smaller plan the processes take when they start again after an out-of-memory step (train/out_of_memory.py).
OUT_OF_MEMORY_HINT = ".out-of-memory.json"
# The steps a run redone from a checkpoint skips whole: the optimizer in the backward had applied part of each before
# the rest proved not finite (train/loop.py).
SKIPPED_STEPS = ".skipped-steps.json"


@contextmanager
def holding_run_folder(output_dir: str, *, workers: bool = False):
    """Hold the run folder while this run lives: the same folder given to a second command is refused until every
    process of this run has ended (a lock of the kernel's: a process killed outright lets go of it too).

    The process that starts a run holds it alone; with `workers`, it then shares it with the workers it starts
    (`shared_by_worker`), so that the folder stays held while a worker outlives it (saving on SIGTERM). The lock is
    of this machine (MOAI_HOME/locks): runs on two machines must not be given one shared folder.
    """
    out = Path(output_dir).expanduser().resolve()
    fd = _lock_file(out)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"output_dir={output_dir} is in use by a run that is still going (`moai smi` lists it); let it "
                        "end or stop it (SIGTERM saves it, the same command resumes it), or pass another "
                        "output_dir=...") from None
    try:
        if workers:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def shared_by_worker(output_dir: str) -> None:
    """A worker of a launched run shares its launcher's hold on the run folder until the worker exits."""
    fcntl.flock(_lock_file(Path(output_dir).expanduser().resolve()), fcntl.LOCK_SH)  # held until the process ends


def _lock_file(out: Path) -> int:
    folder = env.moai_home() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    return os.open(folder / f"{hashlib.sha256(str(out).encode()).hexdigest()[:20]}.lock", os.O_RDWR | os.O_CREAT)


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"{STEP_PREFIX}{step:06d}"


def complete_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first (a crash mid-save leaves only a .tmp folder)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / "meta.json").exists())


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "meta.json").read_text())


def read_hint(out: Path | None) -> dict | None:
    """What an out-of-memory step of this run folder left for the processes that start again (None: nothing)."""
    try:
        return json.loads((Path(out) / OUT_OF_MEMORY_HINT).read_text()) if out else None
    except (OSError, ValueError):
        return None


def write_hint(out: Path, *, micro_batch_size: int, changes: list[dict]) -> None:
    """Leave the smaller plan for the processes that start again after an out-of-memory step, with this run's plan
    changes so far (train/out_of_memory.py)."""
    write_json(out / OUT_OF_MEMORY_HINT, {"micro_batch_size": micro_batch_size, "changes": changes})


def read_skipped_steps(out: Path | None) -> frozenset[int]:
    """The steps this run folder's run skips whole when it redoes them (SKIPPED_STEPS; none: an empty set)."""
    try:
        return frozenset(json.loads((Path(out) / SKIPPED_STEPS).read_text())["steps"]) if out else frozenset()
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()


def add_skipped_step(out: Path, step: int) -> None:
    """Add `step` to the steps the run skips whole when it redoes them."""
    write_json(out / SKIPPED_STEPS, {"steps": sorted(read_skipped_steps(out) | {step})})


def check_output_dir(cfg: DictConfig, *, restarting: bool = False, verify: bool = True) -> tuple[Path, Path | None]:
    """Return the run folder and the checkpoint to resume from (None: start afresh), or a UserError.

    `restarting`: the launcher restarted the workers of this very run; without a checkpoint yet,
    it starts over instead of refusing its own folder. `verify`: read the checkpoint's files back against their
    checksums (resume=auto passes over a damaged newest one to the one before; resume=PATH refuses it).
    """
    out = Path(cfg.output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir={cfg.output_dir} is a file; give a folder")
    if cfg.resume not in ("auto", "never"):
        checkpoint = _given_checkpoint(cfg.resume)
        return out, verified(cfg, checkpoint) if verify else checkpoint
    found = [name for name in RUN_FILES if (out / name).exists()]
    if not found:
        return out, None
    finished = [name for name in ("model", "adapter") if (out / name).exists()]
    checkpoints = complete_checkpoints(out)
    if not checkpoints and not finished and cfg.resume == "auto" and _same_config(out / "config.yaml", cfg):
        # This command's own earlier run, which no process runs any more (the folder is held while one does), ended
        # before its first checkpoint (killed outright, a machine lost): it starts again from the first step.
        return out, None
    if cfg.resume == "never" or finished or (not checkpoints and not restarting):
        why = (f"a finished run ({', '.join(finished)})" if finished else
               f"an earlier run ({', '.join(found)})" + ("" if checkpoints or cfg.resume == "never" else
                                                         " with no checkpoint to resume from"))
        raise UserError(f"output_dir={cfg.output_dir} holds {why}; pass another output_dir=... or remove that folder")
    if not checkpoints:
        return out, None
    _check_same_config(out / "config.yaml", cfg)
    return out, verified(cfg, checkpoints[-1]) if verify else checkpoints[-1]


def verified(cfg: DictConfig, checkpoint: Path | None, *, share: tuple[int, int] = (0, 1),
             agree=lambda why: [why]) -> Path | None:
    """`checkpoint` if its files read back as saved. Else, under resume=auto, the newest whole one before it (the
    damaged ones named and passed over); under resume=PATH a UserError naming the file. Several processes share the
    reading: `share` is this one's (rank, ranks), `agree(why)` every rank's finding (a collective)."""
    if checkpoint is None:
        return None
    candidates = [c for c in complete_checkpoints(checkpoint.parent.parent) if c.name <= checkpoint.name][::-1]
    for candidate in candidates if cfg.resume == "auto" else [checkpoint]:
        why = next((w for w in agree(damage(candidate, share)) if w), None)
        if why is None:
            return candidate
        if cfg.resume != "auto":
            raise UserError(f"resume={cfg.resume}: {why}; the checkpoint is damaged. Resume from an earlier one "
                            f"({checkpoint.parent}) or with resume=auto, which takes the newest whole one")
        if env.rank() == 0:
            print(f"warning: {why}: the checkpoint {candidate.name} is damaged and is not loaded; "
                  "resuming from the one before it", file=sys.stderr, flush=True)
    raise UserError(f"every checkpoint in {checkpoint.parent} is damaged (see above); start afresh with another "
                    "output_dir=..., or resume=PATH from a copy of a whole one")


def run_finished(cfg: DictConfig) -> bool:
    """Whether the run in output_dir has written its last output: the model (full fine-tuning, or LoRA's
    merged model, written after the adapter), or the adapter when LoRA saves no merged model."""
    last = "model" if cfg.get("save_merged", True) else "adapter"
    return (Path(cfg.output_dir).expanduser() / last).is_dir()


def _given_checkpoint(path: str) -> Path:
    checkpoint = Path(path).expanduser().resolve()
    if not (checkpoint / "meta.json").exists():
        raise UserError(f"resume={path} is not a complete checkpoint folder (one of output_dir/checkpoints/step-*); "
                        "use resume=auto to take the newest one of output_dir")
    return checkpoint


def _identity(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in RESUMABLE_CHANGES}


def _changed_config(saved: Path, cfg: DictConfig) -> list[str]:
    """The keys (but those that may change on resume) whose value in `cfg` is not the one in the config.yaml `saved`."""
    before = _identity(OmegaConf.to_container(OmegaConf.load(saved), resolve=True))
    now = _identity(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    if now.get("model", {}).get("checkpoint_dir") is None and "model" in before:
        now["model"]["checkpoint_dir"] = before["model"].get("checkpoint_dir")  # resolved when the run started
    return sorted(_diff(before, now))


def _same_config(saved: Path, cfg: DictConfig) -> bool:
    try:
        return saved.exists() and not _changed_config(saved, cfg)
    except (OSError, ValueError):  # a config.yaml a kill cut short is no run's config
        return False


def _check_same_config(saved: Path, cfg: DictConfig) -> None:
    if not saved.exists():
        return
    changed = _changed_config(saved, cfg)
    if changed and cfg.resume_force:
        if env.rank() == 0:
            print(f"warning: resume_force=true: resuming a run whose config was another ({', '.join(changed[:6])})",
                  file=sys.stderr, flush=True)
    elif changed:
        raise UserError(f"output_dir={cfg.output_dir} holds a run with another config (changed: {', '.join(changed[:6])}); "
                        "resume it with the same settings, or start afresh with another output_dir, or resume anyway "
                        "with resume_force=true (flavor, plan, max_steps, checkpoint_every and logger may change on "
                        "resume)")


def check_same_identity(checkpoint: Path, identity: dict, *, force: bool) -> None:
    """Refuse (unless `force`) to resume `checkpoint` into a run of another model, tokenizer, data or global batch:
    what `identity` says of this run against what the checkpoint's save recorded of its own."""
    saved = read_meta(checkpoint).get("identity")
    if not saved:  # saved before identities were recorded
        return
    changed = [k for k in identity if identity[k] != saved.get(k)]
    if "tokenizer" in changed and "data" in changed:
        changed.remove("data")  # the same data tokenised anew: the tokenizer is what changed
    if not changed:
        return
    what = ", ".join(f"the global batch ({saved.get(k)} -> {identity[k]})" if k == "batch_size" else
                     {"model": "the model's weights or config.json", "tokenizer": "the tokenizer",
                      "data": "the training data (its tokens)"}[k] for k in changed)
    if force:
        if env.rank() == 0:
            print(f"warning: resume_force=true: resuming {checkpoint} although {what} differ(s) from its run's",
                  file=sys.stderr, flush=True)
        return
    raise UserError(f"{checkpoint} was saved by a run of other inputs ({what} changed): resuming it would train on "
                    "from a state that belongs to other inputs. Use the same model, tokenizer, data and batch_size; start "
                    "afresh (another output_dir=..., or without resume=); or resume anyway with resume_force=true")


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if a != b else []


def write_config(out: Path, cfg: DictConfig) -> None:
    write_text(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))


def start_run_folder(out: Path, cfg: DictConfig, *, model_dir: Path, plan: dict, hint: dict | None,
                     resume_step: int) -> tuple[DictConfig, list[dict]]:
    """Write a starting run's config.yaml (with the model folder its weights came from: the tiny default's, a Hub
    download's) and plan.json (with the changes earlier out-of-memory steps made, `hint`); keep the metrics of the
    steps a resumed run's checkpoint covers and drop the later ones (they are about to run again). Returns the
    resolved config and the kept metrics rows."""
    resolved = copy.deepcopy(cfg)
    resolved.model.checkpoint_dir = str(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    # What a killed earlier process of this run left half-written (saves, exports: written aside, never renamed).
    # This run holds the folder: no live writer owns them.
    for tmp in [*out.glob(".*.tmp*"), *out.glob("checkpoints/.*.tmp")]:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    write_config(out, resolved)
    write_json(out / "plan.json", {**plan, "changes": hint["changes"]} if hint else plan)
    kept = _truncate_jsonl(out / "metrics.jsonl", resume_step)
    _truncate_jsonl(out / "checkpoints.jsonl", resume_step)
    return resolved, kept


def record_plan_change(out: Path, plan: dict, change: dict) -> None:
    """plan.json after the plan changed mid-run (train/out_of_memory.py): the new plan, and every change so far."""
    path = out / "plan.json"
    changes = json.loads(path.read_text()).get("changes", []) if path.exists() else []
    write_json(path, {**plan, "changes": [*changes, change]})


def _truncate_jsonl(path: Path, last_step: int) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line a kill or a full disk cut short: the step it was about runs again
            continue
    kept = [r for r in rows if r["step"] <= last_step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept
