"""Measure a model on the benchmarks everyone quotes: EleutherAI's lm-evaluation-harness through our own model.

    python -m recipes.eval model.checkpoint_dir=OUT/model tasks=[arc_easy,hellaswag] num_fewshot=0
    python -m recipes.eval adapter_dir=OUT/adapter tasks=[my_task] tasks_dir=my_tasks/ limit=100
    python -m recipes.eval model.checkpoint_dir=OUT/model dataset=chat dataset.path=chats.jsonl dataset.val_split=0.05

`eval` reads top to bottom: the checkpoint and the adapter, checked and matched -> the validation set (the
training run's dataset settings hold out the same samples) and the tasks, found and their data read (a task
whose data is neither here nor reachable is refused by name) -> the model built on this machine's devices as
recipes.generate builds it -> the validation loss and perplexity -> lm-eval's evaluator asks it
(inference/harness.py) -> the table printed, results.json and samples.jsonl written to output_dir, the metrics
to W&B.
"""

import json
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moai_recipes.config.compose import load_config
from moai_recipes.errors import UserError, exit_on_user_error
from moai_recipes.files import write_json, write_text
from moai_recipes.data.training_data import read_data
from moai_recipes.inference.loading import load_for_inference
from moai_recipes.inference.validation import validation_loss
from moai_recipes.inputs import checked_tokenizer, model_and_adapter

RECIPE = "eval"


def evaluate(cfg: DictConfig) -> dict:
    say = lambda *a: print(*a, file=sys.stderr, flush=True)

    # 1. The checkpoint, the adapter, the tasks and the validation set, checked before a weight is read.
    hf, adapter = model_and_adapter(cfg)
    tokenizer = checked_tokenizer(hf)
    held_out = validation_set(cfg, tokenizer)
    if not cfg.tasks and held_out is None:
        raise UserError("nothing to evaluate: name lm-eval tasks (tasks=[arc_easy,hellaswag], or your own: "
                        "tasks_dir=FOLDER tasks=[my_task]) and/or a validation set (dataset.val_split=0.05 or "
                        "dataset.val_path=FILE, with the training run's dataset settings)")
    tasks = None
    if cfg.tasks:  # lm-eval (an optional dependency): imported by the runs that use it
        from moai_recipes.inference.harness import Tasks, load_tasks

        tasks = Tasks(manager=load_tasks(list(cfg.tasks), tasks_dir=cfg.tasks_dir), names=list(cfg.tasks),
                      limit=cfg.limit, num_fewshot=cfg.num_fewshot)
    max_length = cfg.max_length or min(hf.spec.max_position_embeddings, 4096)  # tokens a scored input keeps

    # 2. The model on this machine's devices, as recipes.generate builds it.
    loaded = load_for_inference(cfg, hf, adapter, max_seq_len=max(max_length, cfg.max_seq_len))
    say(loaded.summary)

    # 3. The validation loss, then the tasks through lm-eval.
    results = {"model": str(hf.folder), "adapter": str(adapter.folder) if adapter else None,
               "config": OmegaConf.to_container(cfg, resolve=True)}
    metrics = {}
    if held_out is not None:
        results["validation"] = validation_loss(loaded.model, held_out, batch_size=cfg.batch_size,
                                                pad_id=tokenizer.pad_id, device=loaded.device)
        v = results["validation"]
        print(f"Validation: loss {v['eval_loss']:.6f}, perplexity {v['perplexity']:.4f} over {v['samples']} samples "
              f"({v['target_tokens']} target tokens)", flush=True)
        metrics.update(eval_loss=v["eval_loss"], perplexity=v["perplexity"])
    out = None
    if tasks is not None:
        from lm_eval.utils import make_table

        from moai_recipes.inference.harness import MoaiLM, Scoring, headline, run_tasks

        scoring = Scoring(batch_size=cfg.batch_size, max_length=max_length, add_bos_token=cfg.add_bos_token)
        out = run_tasks(MoaiLM(loaded.model, tokenizer, scoring, device=loaded.device), tasks)

        print(make_table(out), flush=True)
        results.update({k: out[k] for k in ("results", "n-shot", "n-samples", "versions")},
                       lm_eval_version=out.get("lm_eval_version"))
        metrics.update(headline(out["results"]))

    # 4. Written down: the results, every scored sample, the metrics to W&B.
    run = results_dir(cfg, adapter.folder if adapter else hf.folder)
    run.mkdir(parents=True, exist_ok=True)
    write_json(run / "results.json", results)
    if out is not None:
        write_text(run / "samples.jsonl", "".join(
            json.dumps({"task": task, "doc_id": s["doc_id"], "arguments": s["arguments"], "resps": s["resps"],
                        "filtered_resps": s["filtered_resps"], "target": s["target"],
                        **{m: s[m] for m in s.get("metrics", []) if m in s}}, default=str) + "\n"
            for task, samples in out["samples"].items() for s in sorted(samples, key=lambda s: s["doc_id"])))
    say(f"Results: {run / 'results.json'}" + (f"; every scored sample: {run / 'samples.jsonl'}" if out else ""))
    _to_wandb(cfg, run, metrics)
    return results


def results_dir(cfg: DictConfig, evaluated: Path) -> Path:
    """output_dir, else beside what is evaluated when it is a run's model/ or adapter/ (its folder has plan.json):
    RUN/eval-<date>, else outputs/eval/<date>."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    stamp = f"{datetime.now():%Y-%m-%d_%H-%M-%S}"
    return evaluated.parent / f"eval-{stamp}" if (evaluated.parent / "plan.json").is_file() else Path("outputs/eval") / stamp


def validation_set(cfg: DictConfig, tokenizer):
    """The held-out samples of `dataset`, as a training run with these dataset settings, max_seq_len and seed holds
    them out (data/training_data.py), or None where the dataset names no validation set."""
    d = cfg.dataset
    if d.val_split is None and not d.val_path:
        return None
    # read_data reads a training run's settings: the one global batch and epoch that decide nothing held out.
    run_view = OmegaConf.create({"dataset": OmegaConf.to_container(d), "max_seq_len": cfg.max_seq_len,
                                 "seed": cfg.seed, "batch_size": 1, "epochs": 1, "max_steps": None,
                                 "eval_every": None, "eval_tasks": []})
    return read_data(run_view, tokenizer, dry=False, progress=True).val


def _to_wandb(cfg: DictConfig, run: Path, metrics: dict[str, float]) -> None:
    if cfg.logger.kind != "wandb":
        return
    from moai_recipes.train.metrics_log import wandb_summary

    wandb_summary(run, config=OmegaConf.to_container(cfg, resolve=True), tracker=cfg.logger,
                  values={f"eval/{name}": value for name, value in metrics.items()})


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(RECIPE, sys.argv[1:] if argv is None else argv)
    evaluate(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
