"""Data as users have it: Hugging Face dataset folders and Hub ids (offline, from the datasets cache), the
tokenisation cache, streaming, and the validation set.

Run: python -m pytest tests/test_hf_datasets.py -q
"""

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moai_recipes.config.compose import load_config
from moai_recipes.data.datasets import DataSource, load_dataset
from moai_recipes.data.hf_datasets import HFSplit
from moai_recipes.data.stream import StreamedBatches
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError
from tests.helpers import FSDP, layout, metrics, run_recipe

ROWS = [{"instruction": f"What is {i} plus {i}?", "input": "", "output": f"{i} plus {i} is {2 * i}."}
        for i in range(30)]
CHAT_TEMPLATE_WITH_TOOLS = ("{% for m in messages %}{% if m.role == 'tool' %}<tool>{{ m.content }}</tool>"
                            "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hub_layout(folder: Path, splits: dict[str, list[dict]]) -> Path:
    """A dataset folder as the Hub lays one out: data/<split>-00000-of-00001.parquet."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), folder / "data" / f"{split}-00000-of-00001.parquet")
    return folder


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def samples(ds) -> list[tuple]:
    return [(tuple(ds[i]["tokens"]), tuple(ds[i]["labels"])) for i in range(len(ds))]


def test_a_dataset_folder_reads_as_the_same_rows_in_a_file(tok, tmp_path):
    folder = hub_layout(tmp_path / "ds", {"train": ROWS[:20], "test": ROWS[20:]})
    from_folder = load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder))), tok, max_seq_len=64)
    from_file = load_dataset(DataSource(kind="instruct", path=str(jsonl(tmp_path / "t.jsonl", ROWS[:20]))), tok,
                             max_seq_len=64)
    assert samples(from_folder) == samples(from_file) and len(from_folder) == 20
    test = load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder), split="test")), tok, max_seq_len=64)
    assert len(test) == 10
    sliced = load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder), split="train[:5]")), tok, max_seq_len=64)
    assert samples(sliced) == samples(from_file)[:5]
    # data_files picks files of the folder; column_map renames as for a file.
    renamed = [{"question": r["instruction"], "answer": r["output"]} for r in ROWS[:4]]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "renamed.parquet")
    ds = load_dataset(DataSource(kind="instruct", column_map={"instruction": "question", "output": "answer"},
                                 hf=HFSplit(str(tmp_path), data_files="renamed.parquet")), tok, max_seq_len=64)
    assert samples(ds) == samples(from_file)[:4]


@pytest.mark.parametrize("split, name, data_files, expected", [
    ("validation", None, None, r"has no split 'validation'; its splits are train, test"),
    ("train", "nope", None, r"dataset.name=nope: .*nope"),
    ("train", None, "missing-*.parquet", r"dataset.source=.*cannot be read|Unable to find|doesn't match"),
])
def test_a_split_config_or_files_that_do_not_exist_say_what_does(tok, tmp_path, split, name, data_files, expected):
    folder = hub_layout(tmp_path / "ds", {"train": ROWS[:4], "test": ROWS[4:6]})
    with pytest.raises(UserError, match=expected):
        load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder), name=name, split=split, data_files=data_files)),
                     tok, max_seq_len=64)


def test_an_unknown_id_a_missing_column_and_an_empty_split(tok, tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="dataset.source=acme/no-such-data: no such local folder, and offline"):
        load_dataset(DataSource(kind="instruct", hf=HFSplit("acme/no-such-data")), tok, max_seq_len=64)
    folder = hub_layout(tmp_path / "ds", {"train": [{"question": "a", "output": "b"}]})
    with pytest.raises(UserError, match=r"ds \[train\] row 1: no 'instruction' column \(columns present: question, "
                                        r"output\); map it with dataset.column_map.instruction=NAME"):
        load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder))), tok, max_seq_len=64)
    with pytest.raises(UserError, match=r"is a file; a single file is read with dataset.path="):
        load_dataset(DataSource(kind="instruct", hf=HFSplit(str(jsonl(tmp_path / "t.jsonl", ROWS)))), tok, max_seq_len=64)
    with pytest.raises(UserError, match=r"dataset.split=train\[:0\]: .*no data!; choose a split"):
        load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder), split="train[:0]")), tok, max_seq_len=64)
    empty = tmp_path / "empty"
    (empty / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:1]).slice(0, 0), empty / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(UserError, match="a data file holds no rows"):
        load_dataset(DataSource(kind="instruct", hf=HFSplit(str(empty))), tok, max_seq_len=64)


@pytest.mark.parametrize("overrides, expected", [
    (["dataset.val_split=1.5"], "must be a fraction between 0 and 1"),
    (["dataset.val_split=0"], "must be a fraction between 0 and 1"),
    (["dataset.val_split=validation"], "names a split, and only dataset.source has splits"),
    (["dataset.val_split=0.1", "dataset.val_path=v.jsonl"], "both name a validation set"),
    (["dataset.streaming=true", "dataset.val_split=0.1"], "a fraction of a stream cannot be held out"),
    (["eval_every=0"], "eval_every=0 must be at least 1"),
])
def test_validation_settings_that_cannot_work_are_refused(overrides, expected):
    with pytest.raises(UserError, match=expected):
        load_config("full_finetune", overrides)


def test_chat_rows_with_a_system_turn_several_turns_and_the_templates_tool_role(tiny_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE_WITH_TOOLS}))
    tok = Tokenizer.from_checkpoint(folder)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me look."}, {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}]
    data = hub_layout(tmp_path / "ds", {"train": [{"messages": chat}]})
    (sample,) = samples(load_dataset(DataSource(kind="chat", hf=HFSplit(str(data))), tok, max_seq_len=128))
    trained = tok.decode([t for t in sample[1] if t >= 0], skip_special=False)
    assert "Let me look." in trained and "It is sunny." in trained
    assert "sunny</tool>" not in trained and "Weather" not in trained and "Be brief" not in trained
    # The tiny model's own template names no tool role: such a row is refused, named by where it is.
    with pytest.raises(UserError, match=r"ds \[train\] row 1: message 3 of 'messages' has role 'tool', which the chat "
                                        r"template of .* does not know; use system, user, assistant"):
        load_dataset(DataSource(kind="chat", hf=HFSplit(str(data))), Tokenizer.from_checkpoint(tiny_dir),
                     max_seq_len=128)


def test_tokens_are_cached_once_per_data_tokenizer_and_settings(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("MOAI_CACHE", str(tmp_path / "cache"))
    path = jsonl(tmp_path / "t.jsonl", ROWS)
    source = DataSource(kind="instruct", path=str(path))
    first = load_dataset(source, tok, max_seq_len=64, cache=True)
    again = load_dataset(source, tok, max_seq_len=64, cache=True)
    assert (first.origin, again.origin) == ("tokenised", "cache") and samples(first) == samples(again)
    assert samples(again) == samples(load_dataset(source, tok, max_seq_len=64))  # the same as in memory
    assert load_dataset(source, tok, max_seq_len=63, cache=True).origin == "tokenised"  # another setting
    jsonl(path, ROWS[:-1])  # the file edited in place is other data
    assert load_dataset(source, tok, max_seq_len=64, cache=True).origin == "tokenised"
    cached = sorted(p.name for p in (tmp_path / "cache" / "tokenized").iterdir() if not p.name.endswith(".lock"))
    assert len(cached) == 3
    # A dry read (a plan) writes nothing; a bad row leaves nothing half-written.
    jsonl(path, ROWS[:3])
    assert load_dataset(source, tok, max_seq_len=64, cache=True, write_cache=False).origin == "memory"
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(UserError, match=r"t.jsonl:4: not valid JSON"):
        load_dataset(source, tok, max_seq_len=64, cache=True)
    assert len([p for p in (tmp_path / "cache" / "tokenized").iterdir() if not p.name.endswith(".lock")]) == 3


def test_a_validation_fraction_is_held_out_the_same_way_every_time(tok):
    ds = load_dataset(DataSource(kind="demo"), tok, max_seq_len=64)
    train, val = ds.split_off(0.1, seed=3)
    again = ds.split_off(0.1, seed=3)
    assert len(val) == round(0.1 * len(ds)) and len(train) + len(val) == len(ds)
    assert samples(val) == samples(again[1]) and not set(samples(train)) & set(samples(val))


def streamed(tok, path, **kw):
    settings = dict(max_seq_len=64, batch_size=4, seed=1, shuffle_buffer=8, steps=20) | kw
    return StreamedBatches(DataSource(kind="instruct", path=str(path)), tok, **settings)


def test_a_stream_is_every_sample_once_a_pass_in_shuffled_blocks_and_resumes_at_the_exact_sample(tok, tmp_path):
    path = jsonl(tmp_path / "t.jsonl", ROWS[:18])  # 18 samples: passes end inside a batch and inside a block
    whole = samples(load_dataset(DataSource(kind="instruct", path=str(path)), tok, max_seq_len=64))
    stream = streamed(tok, path)
    batches, positions = [], []
    for step in range(9):
        batches.append([(tuple(s["tokens"]), tuple(s["labels"])) for s in stream.samples(step)])
        positions.append(stream.position(step + 1))
    flat = [s for b in batches for s in b]
    assert sorted(flat[:18]) == sorted(whole) and sorted(flat[18:36]) == sorted(whole)  # each pass: every sample
    assert flat[:8] != whole[:8] and sorted(flat[:8]) == sorted(whole[:8])  # shuffled within a block of 8 rows
    assert flat[:18] != flat[18:36]  # each pass shuffles anew
    assert [len(b) for b in batches] == [4] * 9
    for step in (2, 4, 5):  # resumed from a checkpoint after `step` steps, in a new process's stream
        again = streamed(tok, path)
        again.resume(step, positions[step - 1])
        rest = [[(tuple(s["tokens"]), tuple(s["labels"])) for s in again.samples(k)] for k in range(step, 9)]
        assert rest == batches[step:], step
    assert samples(load_dataset(DataSource(kind="instruct", path=str(path)), tok, max_seq_len=64)) == whole


def test_a_dataset_folder_streams_through_the_datasets_library_as_it_reads(tok, tmp_path):
    folder = hub_layout(tmp_path / "ds", {"train": ROWS[:12]})
    whole = samples(load_dataset(DataSource(kind="instruct", hf=HFSplit(str(folder))), tok, max_seq_len=64))
    stream = StreamedBatches(DataSource(kind="instruct", hf=HFSplit(str(folder))), tok, max_seq_len=64, batch_size=4,
                             seed=0, shuffle_buffer=5, steps=3)
    flat = [(tuple(s["tokens"]), tuple(s["labels"])) for step in range(3) for s in stream.samples(step)]
    assert sorted(flat) == sorted(whole) and flat != whole
    with pytest.raises(UserError, match=r"a slice of a split cannot be streamed"):
        DataSource(kind="instruct", hf=HFSplit(str(folder), split="train[:5]")).open(streaming=True)


def test_training_from_a_hub_id_in_the_datasets_cache_offline_with_a_validation_split(tmp_path):
    """What `load_dataset("acme/arith")` leaves in the datasets cache, read back with HF_DATASETS_OFFLINE=1."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    folder = hub_layout(tmp_path / "download", {"train": ROWS[:24], "test": ROWS[24:]})
    cache = tmp_path / "hf-datasets"
    files = {s: [str(folder / "data" / f"{s}-00000-of-00001.parquet")] for s in ("train", "test")}
    # Laid out as a Hub download leaves it: <namespace>___<name>/<config>/<version>/<commit>.
    Parquet(cache_dir=str(cache), dataset_name="arith", data_files=files, hash="0123abcd").download_and_prepare()
    (config,) = (cache / "arith").iterdir()
    (cache / "acme___arith").mkdir()
    os.rename(config, cache / "acme___arith" / "default")
    shutil.rmtree(folder)
    out = tmp_path / "run"
    r = run_recipe("logger=stdout", "dataset=instruct", "dataset.source=acme/arith", "dataset.val_split=test",
                   "eval_every=2", "batch_size=8", "max_steps=3", "sample_max_new_tokens=0", f"output_dir={out}",
                   env={"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)},
                   isolated=True)  # `datasets` reads its cache and offline settings when it is first imported
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Data instruct (acme/arith, split train): 24 samples" in r.stdout
    assert "Validation: 6 samples (split test), the loss every 2 steps and at the end" in r.stdout
    rows = metrics(out)
    assert [row["step"] for row in rows if "eval_loss" in row] == [2, 3] and (out / "loss.png").exists()


@pytest.mark.slow
def test_a_streamed_run_resumed_on_another_flavor_continues_at_the_exact_sample(tmp_path):
    """Streaming with a validation file: a cpu run checkpointed at step 3, resumed on cpu-2, gives the same
    training and validation losses as the uninterrupted run (the eval loss on cpu-2 equals cpu's)."""
    data = jsonl(tmp_path / "train.jsonl", ROWS[:22])
    val = jsonl(tmp_path / "val.jsonl", ROWS[22:])
    common = ["logger=stdout", "dataset=instruct", f"dataset.path={data}", "dataset.streaming=true",
              "dataset.shuffle_buffer=8", f"dataset.val_path={val}", "eval_every=3", "batch_size=6", "max_steps=6",
              "checkpoint_every=3", "sample_max_new_tokens=0", "optimizer.lr=3e-3", "optimizer.warmup_steps=1"]
    first = tmp_path / "first"
    r = run_recipe(*common, f"output_dir={first}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "streamed in blocks of 8 rows: global batch 6, 6 steps" in r.stdout
    second = tmp_path / "second"
    r = run_recipe(*common, "flavor=cpu-2", *FSDP, f"resume={first / 'checkpoints' / 'step-000003'}",
                   f"output_dir={second}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert layout(first) == "single" and layout(second) == "sharded"
    a, b = metrics(first), metrics(second)
    assert [row["step"] for row in b] == [4, 5, 6]
    for x, y in zip(a[3:], b):
        for key in ("loss", "eval_loss"):
            assert (key in x) == (key in y)
            if key in x:
                assert abs(x[key] - y[key]) <= 1e-4 * abs(x[key]), (key, x, y)
