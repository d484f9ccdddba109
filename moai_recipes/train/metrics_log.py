"""What the user sees of a run: the step line, a tqdm bar, metrics.jsonl, checkpoints.jsonl, W&B, and loss.png.

Only rank 0 makes a MetricsLog. The step line follows the MoAI training log:
`[Step 4/144] | Loss: 0.85546875 | Duration: 5.30 | Throughput: 99006.09 tokens/sec`.
"""

import json
import netrc
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

from moai_recipes import env
from moai_recipes.checkpoint.output_dir import complete_checkpoints
from moai_recipes.files import room_for

# What an objective measured that the step line shows beside the loss: DPO's margin and accuracy, GRPO's reward, its
# spread, the KL to the reference and the completions' length (the rest: metrics.jsonl, W&B).
LINE_METRICS = ("rewards/margins", "rewards/accuracies", "reward", "reward_std", "kl", "completions/mean_length",
                "time/generate", "time/score", "time/train")


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step as the log records it: a row of metrics.jsonl, a W&B point, the step line."""

    step: int
    loss: float  # mean over the global batch's target tokens
    lr: float
    tokens: int  # processed, padding excluded, global
    tokens_per_sec: float
    step_time_s: float
    grad_norm: float
    peak_memory_bytes: int  # tensors, the most at once on any rank (measured steps; 0 when not measured)
    host_peak_bytes: int  # resident memory, the most of any process so far
    target_tokens: int
    skipped: bool  # not applied: its loss or gradient was not finite
    flops_per_token: float = 0.0  # model FLOPs (planner/flops.py): the step's matmuls and attention per token
    mfu: float = 0.0  # model FLOPs / (step time x the devices' peak in the compute dtype)
    hfu: float = 0.0  # the same with recomputation's FLOPs: what the devices computed
    eval_loss: float | None = None  # the validation loss, where measured after this step
    eval_time_s: float | None = None
    tasks: dict[str, float] | None = None  # eval_tasks' metrics, `task/metric` -> value, where run after this step
    extra: dict[str, float] | None = None  # what else the objective measured (DPO: rewards/chosen ...), as keys
    traced: bool = False  # the CPU's tensor memory was followed op by op in this step (train/peak_memory.py): slower
    profiled: bool = False  # torch.profiler recorded this step (profile_steps, train/profiling.py): slower

    def row(self) -> dict:
        row = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"
               and (k not in ("traced", "profiled") or v)}
        return {**row, **(self.extra or {})}



def wandb_logged_in() -> bool:
    """True when W&B has credentials: WANDB_API_KEY, or a netrc entry for its host (what `wandb login` writes)."""
    key, url, netrc_path = env.wandb_credentials()
    if key:
        return True
    try:
        return netrc.netrc(netrc_path).authenticators(urlparse(url).hostname) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(mode: str) -> str:
    """`auto`: online when logged in, offline otherwise; an explicit WANDB_MODE in the environment wins."""
    if env.wandb_mode():
        return env.wandb_mode()
    if mode != "auto":
        return mode
    return "online" if wandb_logged_in() else "offline"


class MetricsLog:
    """Rank 0's record of a run. Every step: a line, a JSON row, a W&B point; at the end: loss.png."""

    def __init__(self, output_dir: Path, *, total_steps: int, config: dict, plan: dict, tracker: dict):
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        self.rows: list[dict] = []
        self._jsonl = open(self.output_dir / "metrics.jsonl", "a", buffering=1)
        self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=False,
                         disable=not sys.stderr.isatty(), file=sys.stderr)
        self._wandb = None
        if tracker["kind"] == "wandb" and wandb_mode(tracker["mode"]) != "disabled":
            self._wandb = _start_wandb(self.output_dir, config=config, plan=plan.get("chosen", plan), tracker=tracker)

    @classmethod
    def start(cls, cfg, inputs, choice) -> "MetricsLog":
        """The log of a run whose folder (inputs.out) output_dir.start_run_folder has just written (config.yaml,
        plan.json, the metrics a resumed run keeps)."""
        from omegaconf import OmegaConf

        from moai_recipes.checkpoint.output_dir import start_run_folder

        plan = choice.as_dict()
        resolved, kept = start_run_folder(inputs.out, cfg, model_dir=inputs.hf.folder, plan=plan,
                                          hint=inputs.out_of_memory_hint, resume_step=inputs.resume_step)
        log = cls(inputs.out, total_steps=inputs.total_steps, plan=plan,
                  config=OmegaConf.to_container(resolved, resolve=True, enum_to_str=True),
                  tracker=OmegaConf.to_container(cfg.logger, enum_to_str=True))
        log.rows = kept
        log._bar.update(inputs.resume_step)
        return log

    def checkpoint(self, *, step: int, path: Path, seconds: float, size: int) -> None:
        """A step checkpoint's cost: a line, a row of checkpoints.jsonl, a W&B point.

        The row outlives the folder (checkpoint_keep deletes old ones), and the folder's own meta.json
        cannot hold its size or the time of the save that writes it.
        """
        self.info(f"Checkpoint of step {step} saved in {seconds:.2f} s ({size / 2**20:.1f} MiB): {path}")
        row = {"step": step, "seconds": seconds, "bytes": size, "path": os.path.relpath(path, self.output_dir)}
        with self._room("checkpoints.jsonl"), open(self.output_dir / "checkpoints.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log({"checkpoint_seconds": seconds, "checkpoint_bytes": size}, step=step)

    def plan_changed(self, plan: dict, change: dict) -> None:
        """The plan changed mid-run (an out-of-memory step redone smaller): say so, and record it in plan.json."""
        from moai_recipes.checkpoint.output_dir import record_plan_change

        before, after = change["from"], change["to"]
        self.info(f"Step {change['step']} ran out of memory with micro-batches of up to "
                  f"{before['micro_batch_size'] * before['max_seq_len']} tokens ({change['error']}); it runs again, "
                  f"the same global batch, with micro_batch_size {after['micro_batch_size']} "
                  f"({after['micro_batch_size'] * after['max_seq_len']} tokens), and so does the rest of the run")
        record_plan_change(self.output_dir, plan, change)

    def info(self, text: str) -> None:
        self._bar.write(text, file=sys.stdout) if not self._bar.disable else print(text, flush=True)

    def step(self, metrics: StepMetrics) -> None:
        m = metrics.row()
        self.rows.append(m)
        with self._room("metrics.jsonl"):
            self._jsonl.write(json.dumps(m) + "\n")
        self.info(f"[Step {m['step']}/{self.total_steps}] | Loss: {m['loss']:.8g} | Duration: {m['step_time_s']:.2f} | "
                  f"Throughput: {m['tokens_per_sec']:.2f} tokens/sec | MFU: {100 * m['mfu']:.1f}%"
                  + (f" | Eval loss: {m['eval_loss']:.8g} ({m['eval_time_s']:.2f} s)" if "eval_loss" in m else "")
                  + "".join(f" | {name}: {value:.4g}" for name, value in m.get("tasks", {}).items())
                  + "".join(f" | {name}: {m[name]:.4g}" for name in LINE_METRICS if name in m)
                  + "".join(f" | {name}: {m[name]:.4f}" for name in ("aux_loss", "expert_load") if name in m)
                  + (" | memory traced: a slower step" if m.get("traced") else "")
                  + (" | profiled: a slower step" if m.get("profiled") else ""))
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{m['loss']:.4f}")
        if self._wandb is not None:
            with self._room("W&B's run files"):
                self._wandb.log({**{k: v for k, v in m.items() if k not in ("step", "tasks")},
                                 **{f"eval/{k}": v for k, v in m.get("tasks", {}).items()}}, step=m["step"])

    def summary(self, **values) -> None:
        if self._wandb is not None:
            self._wandb.summary.update(values)

    def _room(self, what: str):
        return room_for(self.output_dir, what, resumes_from=lambda: (complete_checkpoints(self.output_dir) or [None])[-1])

    def close(self) -> None:
        self._bar.close()
        with self._room("metrics.jsonl"):
            self._jsonl.close()
        if self.rows:
            with self._room("loss.png"):
                plot_loss(self.rows, self.output_dir / "loss.png")
        if self._wandb is not None:
            with self._room("W&B's run files"):
                self._wandb.finish()
            if self._wandb.settings.mode == "offline":
                self.info(f"W&B run saved offline; upload it with: wandb sync {self._wandb.dir.rsplit('/files', 1)[0]}")


def _start_wandb(output_dir: Path, *, config: dict, plan: dict, tracker: dict):
    import wandb

    mode = wandb_mode(tracker["mode"])
    run = wandb.init(project=tracker["project"], entity=tracker["entity"], name=tracker["run_name"],
                     dir=str(output_dir), mode=mode, config={**config, "plan": plan},
                     settings=wandb.Settings(silent=True, console="off"))
    return run


def wandb_summary(output_dir: Path, *, config: dict, tracker, values: dict) -> None:
    """A W&B run of its own holding `values` (an evaluation's metrics) as its summary."""
    import wandb

    run = wandb.init(project=tracker.project, entity=tracker.entity, name=tracker.run_name, dir=str(output_dir),
                     mode=wandb_mode(tracker.mode), config=config, settings=wandb.Settings(silent=True, console="off"))
    run.log(values)
    run.summary.update(values)
    run.finish()


def plot_loss(rows: list[dict], path: Path) -> None:
    """The loss curve, as in the reference tutorial, and the validation loss where measured; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color="tab:blue", linewidth=1.5, label="training")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], color="tab:orange", linewidth=1.5,
                marker="o", markersize=3, label="validation")
        ax.legend(loc="upper right")
    scored = [r for r in rows if r.get("tasks")]
    if scored:  # eval_tasks' metrics (accuracies, mostly in [0, 1]) on an axis of their own
        right = ax.twinx()
        colors = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
        for i, name in enumerate(scored[-1]["tasks"]):
            points = [(r["step"], r["tasks"][name]) for r in scored if name in r["tasks"]]
            right.plot(*zip(*points), linestyle="--", marker="s", markersize=3, label=name, color=colors[i % 8])
        if all(0 <= v <= 1 for r in scored for v in r["tasks"].values()):
            right.set_ylim(-0.02, 1.02)
        right.set_ylabel("eval_tasks")
        right.legend(loc="lower left", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(("training and validation loss" if evals else "training loss") + (", eval_tasks" if scored else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-drawn file
