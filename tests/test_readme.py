"""What the README and docs tell users to type works as typed.

Every `key=value` the docs write in code (README.md and docs/*.md; placeholders such as N given a value, `a|b|c`
each alternative) composes as an override of a recipe. Every command of the README's shell blocks runs as written,
its placeholders (DIR, chats.jsonl, OUT/adapter...) made real on tiny checkpoints: `python -m recipes.plan`,
`recipes.generate`, `--cfg job`, `--help` and `moai ...` for real; a training command through `moai validate` (its
names, values, files and plan checked, no training: the README's own runs are 0.5B to 70B models, some on 32 GPUs).
"""

import importlib.util
import json
import re
import shlex

import pytest

from moai_recipes.config.compose import load_config
from moai_recipes.errors import UserError
from moai_recipes.tools import cli
from tests.helpers import ROOT, make_hf_checkpoint, make_quiz_tasks, run_recipe

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Code spans that quote another tool's settings, not ours (benchmarks.md compares against torchtune's).
NOT_OURS = {"benchmarks.md"}
PLACEHOLDERS = {"N": "2"}
# Commands a test cannot run as typed: an interactive prompt, and a cpu-2 training run (the suite trains elsewhere).
VALIDATED_INSTEAD = {"run"}
NOT_RUN = {"switch"}
# What a command answers, as typed, on a machine that has recorded no training run yet.
FRESH_MACHINE = {"calibrate": "calibrating needs 3 at least"}
# lm-eval's built-in tasks read their data from the Hub, which this machine cannot reach: refused by name, as typed.
OFFLINE = {"tasks=[arc_easy,hellaswag]": "'arc_easy' needs its data"}


def documented_overrides() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        if doc.name in NOT_OURS:
            continue
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            if re.fullmatch(r"\+{0,2}[a-z_][a-z0-9_.]*=\S+", span):
                found.add((doc.name, span))
    return sorted(found)


def _typed(span: str) -> list[list[str]]:
    """The command lines a span stands for: a placeholder given a value, each alternative of `a|b|c`."""
    key, value = span.split("=", 1)
    values = value.split("|") if "|" in value and not value.startswith("[") else [value]
    context = ["dataset.source=OWNER/NAME"] if key == "dataset.val_split" and not value[0].isdigit() else []
    return [[f"{key}={PLACEHOLDERS.get(v, v)}", *context] for v in values]


def _first_the_recipes_that_have(key: str) -> list[str]:
    """Every recipe (config/schema.SCHEMAS), those whose schema has `key`'s first part first (a compose takes 0.1 s,
    and a third of the docs' overrides were refused by full_finetune before a later recipe took them)."""
    from moai_recipes.config.compose import _schema_keys
    from moai_recipes.config.schema import SCHEMAS

    top = key.lstrip("+~").split(".")[0]
    return sorted(SCHEMAS, key=lambda recipe: top not in _schema_keys(None, recipe))


def test_every_override_the_docs_write_composes_as_typed():
    spans = documented_overrides()
    assert len(spans) > 40 and ("README.md", "dataset.column_map.output=response") in spans
    refused = []
    for doc, span in spans:
        for args in _typed(span):
            errors = []
            for recipe in _first_the_recipes_that_have(span.split("=", 1)[0]):
                try:
                    load_config(recipe, args)
                    break
                except UserError as e:
                    errors.append(str(e))
            else:
                refused.append(f"{doc}: `{span}` -> {errors[0]}")
    assert not refused, "\n".join(refused)


def readme_commands() -> list[list[str]]:
    """The README's shell commands, continuation lines joined, comments dropped, as argv lists."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:3] and (argv[0] == "moai" or argv[:2] == ["python", "-m"]):
                commands.append(argv)
    return commands


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    """The README's placeholders, made real: checkpoints of each family it names, a chat file, a trained model's
    folder and a PEFT adapter on it."""
    import peft
    import transformers

    root = tmp_path_factory.mktemp("readme")
    made = {family: str(make_hf_checkpoint(root / family, family)) for family in ("llama", "mistral", "qwen2")}
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                      {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
                             for i in range(40)))
    base = transformers.AutoModelForCausalLM.from_pretrained(made["llama"])
    adapter = root / "OUT" / "adapter"
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    tasks = make_quiz_tasks(root / "my_tasks")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": f" Answer {i}.", "rejected": " No."}) + "\n"
                             for i in range(40)))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + 2 =", "answer": str(i + 2)}) + "\n" for i in range(40)))
    from moai_recipes.data.pictures import write_picture_rows
    from tests.vision_models import make_vision_checkpoint, picture_pairs, picture_prompts

    vision = make_vision_checkpoint(root / "qwen2_5_vl", "qwen2_5_vl")
    invoices = write_picture_rows(root / "invoices", 20)
    return {"/data/Qwen2.5-0.5B": made["qwen2"], "chats.jsonl": str(chats), "OUT/adapter": str(adapter),
            "/data/Qwen2.5-VL-3B-Instruct": str(vision), "invoices.jsonl": str(invoices),
            "chart_pairs.jsonl": str(picture_pairs(root / "charts")),
            "invoice_questions.jsonl": str(picture_prompts(root / "questions")),
            "prompts.jsonl": str(prompts),
            "my_tasks": str(tasks), "[my_task]": "[quiz_mc]", "pairs.jsonl": str(pairs),
            "outputs/full_finetune/DATE/model": made["llama"], "OUT/model": made["llama"],
            **{f"DIR of {family}": folder for family, folder in made.items()}}


FAMILIES = {"qwen2_5_0_5b": "qwen2", "llama3_8b": "llama", "mistral": "mistral"}


def _real(argv: list[str], made: dict) -> list[str]:
    """`argv` with its placeholders replaced by what `made` made (DIR: a checkpoint of the model= family)."""
    models = [a.split("=", 1)[1] for a in argv if a.startswith("model=")]
    family = FAMILIES.get(models[0], "llama") if models else "llama"

    def real(arg: str) -> str:
        key, sep, value = arg.partition("=")
        value = made[f"DIR of {family}"] if value == "DIR" else made.get(value, value)
        return f"{key}={value}" if sep else arg

    return [real(a) for a in argv]


def test_the_readme_commands_run_as_typed(placeholders, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # `moai cp` writes here
    # A machine of its own: `moai calibrate` must neither see the suite's recorded runs nor refit the suite's planner.
    monkeypatch.setenv("MOAI_HOME", str(tmp_path / "home"))
    commands = readme_commands()
    assert any(c[2] == "recipes.lora_finetune" for c in commands if c[0] == "python")
    ran = []
    for typed in commands:
        argv = _real(typed, placeholders)
        if argv[0] == "moai":
            if argv[1] in NOT_RUN:
                continue
            if argv[1] in VALIDATED_INSTEAD:
                argv = ["moai", "validate", *argv[2:]]
            try:
                code = cli.main(argv[1:])
            except SystemExit as e:
                code = e.code
            output = capsys.readouterr()
            result = (code or 0, output.out, output.err)
            if argv[1] in FRESH_MACHINE:
                assert code == 2 and FRESH_MACHINE[argv[1]] in output.err, output.err
                result = (0, output.out, output.err)
        else:
            module, args = argv[2], argv[3:]
            if module in ("recipes.full_finetune", "recipes.lora_finetune", "recipes.dpo", "recipes.grpo") \
                    and not {"--cfg", "--help"} & set(args):
                try:
                    code = cli.main(["validate", module.split(".")[1], *args])
                except SystemExit as e:
                    code = e.code
                output = capsys.readouterr()
                result = (code or 0, output.out, output.err)
            elif offline := next((OFFLINE[a] for a in args if a in OFFLINE), None):
                r = run_recipe(*args, "logger=stdout", module=module, isolated=True,
                               env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
                assert r.returncode == 2 and offline in r.stderr, r.stderr
                result = (0, r.stdout, r.stderr)
            elif module == "recipes.export" and any(a.startswith("prompts=") for a in args) \
                    and importlib.util.find_spec("llama_cpp") is None:
                # Without llama-cpp-python (scripts/oldest_versions.sh builds no llama.cpp), refused by its name.
                r = run_recipe(*args, module=module)
                assert r.returncode == 2 and "llama-cpp-python is not installed" in r.stdout + r.stderr, r.stderr
                result = (0, r.stdout, r.stderr)
            else:
                r = run_recipe(*args, module=module)
                result = (r.returncode, r.stdout, r.stderr)
        assert result[0] == 0, f"{shlex.join(typed)}\n{result[1][-2000:]}\n{result[2][-2000:]}"
        ran.append(typed[:3])
    assert len(ran) >= 15, ran
