"""recipes.eval: lm-evaluation-harness through our model class gives lm-eval's own Hugging Face backend's numbers
on the same checkpoint (each log-likelihood within 1e-4, the accuracies and the generations equal), for a model
and for an adapter on its base; a task that is not there, or whose data is not, is refused by name.
Run: python -m pytest tests/test_eval.py -q
"""

import json
from pathlib import Path

import pytest

from tests.helpers import make_hf_checkpoint, make_peft_adapter, run_recipe

pytest.importorskip("lm_eval")

QUESTIONS = [("What color is the sky on a clear day?", ["blue", "green", "red", "purple"], 0),
             ("Which animal barks?", ["cat", "dog", "fish"], 1),
             ("How many legs has a spider?", ["six", "eight", "four"], 1),
             ("What do bees make?", ["milk", "silk", "honey"], 2),
             ("Which is a planet?", ["Mars", "Paris", "Nile", "Everest"], 0),
             ("What is frozen water?", ["steam", "ice"], 1)]


def _tasks(folder: Path) -> Path:
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
    tasks = _tasks(tmp_path / "tasks")
    base = make_hf_checkpoint(tmp_path / "base", "qwen2")
    out = tmp_path / "eval-model"
    r = run_recipe(f"model.checkpoint_dir={base}", f"tasks_dir={tasks}", "tasks=[quiz_mc,quiz_gen]", "batch_size=4",
                   f"output_dir={out}", "logger=stdout", module="recipes.eval")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "quiz_mc" in r.stdout and "acc" in r.stdout  # the table
    _same_numbers(out, _hf_backend(base, tasks))

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
    tasks = _tasks(tmp_path / "tasks")
    for args, words in [(("tasks=[no_such_task]",), "'no_such_task' is not an lm-eval task"),
                        ((f"tasks_dir={tmp_path / 'nowhere'}", "tasks=[quiz_mc]"), "is not a folder"),
                        (("tasks=[]",), "tasks=[...] is required")]:
        r = run_recipe(*args, "logger=stdout", module="recipes.eval")
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    # A built-in task whose data is not in the datasets cache (no network to the Hub here, and offline anyway).
    r = run_recipe(f"tasks_dir={tasks}", "tasks=[quiz_mc,arc_easy]", "logger=stdout", module="recipes.eval",
                   env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, isolated=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "'arc_easy' needs its data (allenai/ai2_arc)" in r.stderr and "Traceback" not in r.stderr, r.stderr
