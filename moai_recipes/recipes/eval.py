"""Measure a model on the benchmarks everyone quotes: EleutherAI's lm-evaluation-harness through our own model.

    python -m recipes.eval model.checkpoint_dir=OUT/model tasks=[arc_easy,hellaswag] num_fewshot=0
    python -m recipes.eval adapter_dir=OUT/adapter tasks=[my_task] tasks_dir=my_tasks/ limit=100

`eval` reads top to bottom: the checkpoint and the adapter, checked and matched -> the tasks, found and their
data read (a task whose data is neither here nor reachable is refused by name) -> the model built on this
machine's devices as recipes.generate builds it -> lm-eval's evaluator asks it (inference/harness.py) ->
the table printed, results.json and samples.jsonl written to output_dir, the metrics to W&B.
"""

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moai_recipes.config.compose import load_config
from moai_recipes.errors import UserError, exit_on_user_error
from moai_recipes.files import write_json, write_text
from moai_recipes.inference.loading import load_for_inference
from moai_recipes.inputs import checked_tokenizer, model_and_adapter

RECIPE = "eval"


def evaluate(cfg: DictConfig) -> dict:
    say = lambda *a: print(*a, file=sys.stderr, flush=True)

    # 1. The checkpoint, the adapter and the tasks, checked before a weight is read.
    if not cfg.tasks:
        raise UserError("tasks=[...] is required: lm-eval task names (tasks=[arc_easy,hellaswag]) or your own task "
                        "YAMLs (tasks_dir=FOLDER tasks=[my_task])")
    hf, adapter = model_and_adapter(cfg)
    tokenizer = checked_tokenizer(hf)
    tasks = load_tasks(list(cfg.tasks), tasks_dir=cfg.tasks_dir)
    max_length = cfg.max_length or min(hf.spec.max_position_embeddings, 4096)

    # 2. The model, on this machine's devices, as lm-eval's model.
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    from moai_recipes.inference.harness import MoaiLM

    loaded = load_for_inference(cfg, hf, adapter, max_seq_len=max_length)
    say(loaded.summary)
    lm = MoaiLM(loaded.model, tokenizer, device=loaded.device, batch_size=cfg.batch_size, max_length=max_length,
                add_bos_token=cfg.add_bos_token)

    # 3. The evaluation.
    out = simple_evaluate(model=lm, tasks=list(cfg.tasks), task_manager=tasks, num_fewshot=cfg.num_fewshot,
                          limit=cfg.limit, log_samples=True, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
                          torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    print(make_table(out), flush=True)

    # 4. Written down: the results, every scored sample, the metrics to W&B.
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    results = {"results": out["results"], "n-shot": out["n-shot"], "n-samples": out["n-samples"],
               "versions": out["versions"], "model": str(hf.folder), "adapter": str(adapter.folder) if adapter else None,
               "config": OmegaConf.to_container(cfg, resolve=True), "lm_eval_version": out.get("lm_eval_version")}
    write_json(run / "results.json", results)
    write_text(run / "samples.jsonl", "".join(
        json.dumps({"task": task, "doc_id": s["doc_id"], "arguments": s["arguments"], "resps": s["resps"],
                    "filtered_resps": s["filtered_resps"], "target": s["target"],
                    **{m: s[m] for m in s.get("metrics", []) if m in s}}, default=str) + "\n"
        for task, samples in out["samples"].items() for s in sorted(samples, key=lambda s: s["doc_id"])))
    say(f"Results: {run / 'results.json'}; every scored sample: {run / 'samples.jsonl'}")
    _to_wandb(cfg, run, out["results"])
    return results


def load_tasks(names: list[str], *, tasks_dir: str | None):
    """lm-eval's TaskManager with each named task's data read (from the datasets cache, or downloaded): an unknown
    name, or data neither here nor reachable, is a UserError naming the task."""
    from lm_eval.tasks import TaskManager

    if tasks_dir and not Path(tasks_dir).expanduser().is_dir():
        raise UserError(f"tasks_dir={tasks_dir} is not a folder; give the folder of your task YAML files")
    own = TaskManager(include_path=str(Path(tasks_dir).expanduser()), include_defaults=False) if tasks_dir else None
    # lm-eval's 15k built-in task files take 4 s to index: only when a name is not one of the user's own.
    manager = own if own and all(n in own.all_tasks for n in names) else TaskManager(
        include_path=str(Path(tasks_dir).expanduser()) if tasks_dir else None)
    for name in names:
        if name not in manager.all_tasks and not Path(name).is_file():
            where = f" or in tasks_dir={tasks_dir}" if tasks_dir else " (your own: tasks_dir=FOLDER of task YAMLs)"
            raise UserError(f"tasks: {name!r} is not an lm-eval task, group or tag{where}; `lm-eval ls tasks` lists "
                            "them")
        try:
            manager.load([name])
        except OSError as e:  # datasets' ConnectionError: neither in the local cache nor reachable
            source = (getattr(manager.task_index.get(name), "cfg", None) or {}).get("dataset_path", "its dataset")
            raise UserError(
                f"tasks: {name!r} needs its data ({source}), which is not in the local datasets cache and could not "
                f"be downloaded ({str(e).splitlines()[0]}). On a machine with network: python -c \"import datasets; "
                f"datasets.load_dataset('{source}')\" (with the task's subset name if it has one), then copy "
                "~/.cache/huggingface here (or set HF_DATASETS_CACHE to it)") from None
    return manager


def _to_wandb(cfg: DictConfig, run: Path, results: dict) -> None:
    if cfg.logger.kind != "wandb":
        return
    from moai_recipes.train.metrics_log import wandb_summary

    values = {f"eval/{task}/{key.split(',')[0]}": value for task, metrics in results.items()
              for key, value in metrics.items() if isinstance(value, (int, float)) and "stderr" not in key}
    wandb_summary(run, config=OmegaConf.to_container(cfg, resolve=True), tracker=cfg.logger, values=values)


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(RECIPE, sys.argv[1:] if argv is None else argv)
    evaluate(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
