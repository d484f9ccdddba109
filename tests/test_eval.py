"""recipes.eval: lm-evaluation-harness through our model class gives lm-eval's own Hugging Face backend's numbers
on the same checkpoint (each log-likelihood within 1e-4, the accuracies and the generations equal), for a model
and for an adapter on its base; a task that is not there, or whose data is not, is refused by name.
Run: python -m pytest tests/test_eval.py -q
"""

import contextlib
import json
from pathlib import Path

import pytest

from tests.helpers import (FSDP, layout, make_hf_checkpoint, make_peft_adapter, make_quiz_tasks, metrics, run_recipe,
                           wandb_records, without_packages)

pytest.importorskip("lm_eval")

def _hf_backend(folder: Path, tasks_dir: Path) -> dict:
    """The same tasks through lm-eval's own Hugging Face backend."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(folder), dtype="float32", batch_size=3, device="cpu")
    return simple_evaluate(model=lm, tasks=["quiz_mc", "quiz_gen"], log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))


def _samples(path: Path) -> dict:
    return {(s["task"], s["doc_id"]): s for s in map(json.loads, path.read_text().splitlines())}


def _same_numbers(out: Path, reference: dict) -> None:
    ours = json.loads((out / "results.json").read_text())["results"]
    samples = _samples(out / "samples.jsonl")
    for task in ("quiz_mc", "quiz_gen"):
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in reference["results"][task]:
                assert ours[task][metric] == reference["results"][task][metric], (task, metric)
        for ref in reference["samples"][task]:
            mine = samples[(task, ref["doc_id"])]
            if task == "quiz_mc":
                for (a, a_greedy), (b, b_greedy) in zip(mine["filtered_resps"], ref["filtered_resps"]):
                    assert abs(a - b) <= 1e-4 * abs(b) and a_greedy == b_greedy, (a, b)
            else:
                assert mine["filtered_resps"] == ref["filtered_resps"]


def test_eval_equals_lm_eval_hf_backend_for_a_model_and_an_adapter(tmp_path):
    tasks = make_quiz_tasks(tmp_path / "tasks")
    base = make_hf_checkpoint(tmp_path / "base", "qwen2")
    out = tmp_path / "eval-model"
    r = run_recipe(f"model.checkpoint_dir={base}", f"tasks_dir={tasks}", "tasks=[quiz_mc,quiz_gen]", "batch_size=4",
                   f"output_dir={out}", "logger=wandb", module="recipes.eval", env={"WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "quiz_mc" in r.stdout and "acc" in r.stdout  # the table
    _same_numbers(out, _hf_backend(base, tasks))
    (run,) = (out / "wandb").glob("offline-run-*")
    results = json.loads((out / "results.json").read_text())["results"]
    assert wandb_records(run)["summary"]["eval/quiz_mc/acc"] == results["quiz_mc"]["acc,none"]

    # An adapter on its base: our merge against peft's merged model in the HF backend.
    lora = make_peft_adapter(base, tmp_path / "adapter", ["q_proj", "v_proj"], std=0.3)
    merged = tmp_path / "merged"
    lora.merge_and_unload().save_pretrained(merged)
    for f in base.glob("tokenizer*"):
        (merged / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "eval-adapter"
    r = run_recipe(f"adapter_dir={tmp_path / 'adapter'}", f"tasks_dir={tasks}", "tasks=[quiz_mc,quiz_gen]",
                   f"output_dir={out}", "logger=stdout", module="recipes.eval")
    assert r.returncode == 0, r.stdout + r.stderr
    reference = _hf_backend(merged, tasks)
    _same_numbers(out, reference)
    plain = json.loads((tmp_path / "eval-model" / "samples.jsonl").read_text().splitlines()[0])
    assert plain["filtered_resps"] != _samples(out / "samples.jsonl")[("quiz_mc", 0)]["filtered_resps"]


def test_a_task_that_is_not_there_or_whose_data_is_not_is_refused_by_name(tmp_path):
    tasks = make_quiz_tasks(tmp_path / "tasks")
    for args, words in [((f"tasks_dir={tmp_path / 'nowhere'}", "tasks=[quiz_mc]"), "is not a folder"),
                        (("tasks=[]",), "nothing to evaluate")]:
        r = run_recipe(*args, "logger=stdout", module="recipes.eval")
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    # A name lm-eval does not know, and a built-in task whose data is not in the datasets cache (no network to the
    # Hub here, and the suite is offline: tests/conftest.py): both named in one message (lm-eval's index of its
    # built-in tasks read once).
    r = run_recipe(f"tasks_dir={tasks}", "tasks=[quiz_mc,no_such_task,arc_easy]", "logger=stdout",
                   module="recipes.eval")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "tasks: 'no_such_task' is not an lm-eval task" in r.stderr, r.stderr
    assert "tasks: 'arc_easy' needs its data (allenai/ai2_arc)" in r.stderr, r.stderr
    assert "quiz_mc" not in r.stderr.replace("tasks=[quiz_mc", ""), r.stderr


def test_without_lm_eval_tasks_say_how_to_get_it_and_the_held_out_loss_needs_none(tmp_path):
    """lm-eval is an optional dependency (`make demo` installs none): tasks, in recipes.eval and while training, are
    refused with how to get it; the validation loss and perplexity are computed without it."""
    gone = without_packages(tmp_path / "site", "lm_eval")
    for module, args in (("recipes.eval", ["tasks=[quiz_mc]"]),
                         ("recipes.full_finetune", ["eval_tasks=[quiz_mc]", "max_steps=1", "batch_size=4"])):
        r = run_recipe(f"tasks_dir={make_quiz_tasks(tmp_path / 'tasks')}" if module == "recipes.eval" else
                       f"eval_tasks_dir={tmp_path / 'tasks'}", *args, "logger=stdout",
                       f"output_dir={tmp_path / module}", module=module, env=gone, isolated=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert "lm-evaluation-harness, which is not installed: pip install 'moai-recipes[eval]'" in r.stderr, r.stderr
    r = run_recipe("dataset.val_split=0.25", "logger=stdout", f"output_dir={tmp_path / 'held-out'}",
                   module="recipes.eval", env=gone, isolated=True)
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_eval_tasks_while_training_on_two_sharded_ranks_equal_recipes_eval_on_the_saved_model(tmp_path):
    """Each rank scores its share (FSDP2: in step, every forward with both ranks); rank 0 combines. The last eval's
    numbers, and the validation loss, are those recipes.eval gives the model the run wrote, in one process."""
    tasks = make_quiz_tasks(tmp_path / "tasks")
    out = tmp_path / "run"
    r = run_recipe("flavor=cpu-2", *FSDP, "max_steps=4", "batch_size=8", "optimizer.lr=3e-3", "eval_every=2",
                   f"eval_tasks_dir={tasks}", "eval_tasks=[quiz_mc,quiz_gen]", "dataset.val_split=0.25", "max_seq_len=128",
                   "seed=3", "logger=stdout", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert layout(out) == "sharded"
    rows = metrics(out)
    assert [row["step"] for row in rows if "tasks" in row] == [2, 4]
    assert set(rows[-1]["tasks"]) == {"quiz_mc/acc", "quiz_mc/acc_norm", "quiz_gen/exact_match"}
    assert "quiz_mc/acc:" in r.stdout and (out / "loss.png").is_file()

    r = run_recipe(f"model.checkpoint_dir={out / 'model'}", f"tasks_dir={tasks}", "tasks=[quiz_mc,quiz_gen]",
                   "dataset.val_split=0.25", "max_seq_len=128", "seed=3", "logger=stdout", module="recipes.eval")
    assert r.returncode == 0, r.stdout + r.stderr
    (after,) = out.glob("eval-*")  # the results go to the run's folder
    written = json.loads((after / "results.json").read_text())
    # The same held-out samples, the same loss, from the model the run wrote, in one process.
    assert abs(written["validation"]["eval_loss"] - rows[-1]["eval_loss"]) < 1e-5 * rows[-1]["eval_loss"]
    assert "Validation: loss" in r.stdout
    results = written["results"]
    assert rows[-1]["tasks"] == {"quiz_mc/acc": results["quiz_mc"]["acc,none"],
                                 "quiz_mc/acc_norm": results["quiz_mc"]["acc_norm,none"],
                                 "quiz_gen/exact_match": results["quiz_gen"]["exact_match,none"]}


def test_eval_of_a_model_of_transformers_modules_equals_lm_eval_hf_backend(tmp_path):
    """Gemma 3 (sliding windows, soft-capping, tied embeddings) through transformers' own modules in our loop: the
    scores and every sample's responses are lm-eval's HF backend's."""
    from tests.architectures import make_checkpoint

    tasks = make_quiz_tasks(tmp_path / "tasks")
    base = make_checkpoint(tmp_path / "gemma3", "gemma3")
    out = tmp_path / "eval"
    r = run_recipe(f"model.checkpoint_dir={base}", f"tasks_dir={tasks}", "tasks=[quiz_mc,quiz_gen]", "batch_size=4",
                   f"output_dir={out}", "logger=stdout", module="recipes.eval")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gemma3_text" in r.stdout + r.stderr
    _same_numbers(out, _hf_backend(base, tasks))


def test_the_index_of_lm_evals_own_tasks_is_kept_in_the_cache_and_read_back_as_lm_eval_builds_it(tmp_path, monkeypatch,
                                                                                                caplog):
    """moai_recipes/inference/task_index.py, on a small folder standing for lm-eval's own (its 14k files take 4 s):
    the index a TaskManager gets is lm-eval's, the built-in part read from the cache once a process stored it (a value
    planted in the stored file is what the next manager sees), a user's task of a built-in name overrides it as
    lm-eval overrides it (its warning), a damaged file is indexed again, and lm-eval is left as it was."""
    from lm_eval.tasks import TaskManager

    from moai_recipes.inference.task_index import builtin_tasks_cached

    # lm-eval before 0.4.10 indexes otherwise, and is left to do so (task_index.py).
    TaskIndex = pytest.importorskip("lm_eval.tasks._index", reason="lm-eval < 0.4.10 has no TaskIndex").TaskIndex

    monkeypatch.setenv("MOAI_CACHE", str(tmp_path / "cache"))
    builtin, own = make_quiz_tasks(tmp_path / "builtin"), tmp_path / "own"
    (builtin / "quiz_tagged.yaml").write_text((builtin / "quiz_mc.yaml").read_text().replace(
        "task: quiz_mc", "task: quiz_tagged\ntag: [quizzes]"))
    (builtin / "quiz_group.yaml").write_text("group: quiz_all\ntask: [quiz_mc, quiz_gen]\n")
    own.mkdir()
    (own / "quiz_gen.yaml").write_text((builtin / "quiz_gen.yaml").read_text().replace("max_gen_toks: 12",
                                                                                     "max_gen_toks: 3"))
    folders = [str(builtin), str(own)]
    original = TaskIndex.__dict__["build"]

    def manager(cached: bool):
        with builtin_tasks_cached(builtin) if cached else contextlib.nullcontext():
            return TaskManager(include_path=folders, include_defaults=False)

    theirs = manager(cached=False)
    assert TaskIndex.__dict__["build"] is original
    caplog.clear()
    first = manager(cached=True)
    assert TaskIndex.__dict__["build"] is original
    assert first.task_index == theirs.task_index and first.all_tasks == theirs.all_tasks
    assert {"quiz_mc", "quiz_gen", "quiz_tagged", "quizzes", "quiz_all"} == set(first.all_tasks)
    assert first.task_index["quiz_gen"].yaml_path == own / "quiz_gen.yaml"  # the user's, over the built-in one
    assert "Task 'quiz_gen' from" in caplog.text and "overrides existing task" in caplog.text
    (stored,) = (tmp_path / "cache" / "lm-eval-tasks").glob("*.json")
    planted = json.loads(stored.read_text())
    assert set(planted) == {"quiz_mc", "quiz_gen", "quiz_tagged", "quizzes", "quiz_all"}  # the built-in folder's alone
    planted["quiz_mc"][2]["doc_to_target"] = "planted"
    stored.write_text(json.dumps(planted))
    assert manager(cached=True).task_index["quiz_mc"].cfg["doc_to_target"] == "planted"
    for damaged in (stored.read_text()[:100], "[]"):  # indexed again, and stored whole
        stored.write_text(damaged)
        assert manager(cached=True).task_index == theirs.task_index
    assert json.loads(stored.read_text())["quiz_mc"][2]["doc_to_target"] == "label"
    (builtin / "quiz_mc.yaml").write_text((builtin / "quiz_mc.yaml").read_text().replace("doc_to_target: label",
                                                                                       "doc_to_target: 0"))
    assert manager(cached=True).task_index["quiz_mc"].cfg["doc_to_target"] == 0  # an edited file: indexed again
