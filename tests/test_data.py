"""Tests of the tokenizer boundary and the datasets: real files, real tokenizers, exact masks.

Run: python -m pytest tests/test_data.py -q
"""

import csv
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moai_recipes.data.datasets import IGNORE_INDEX, DataSource, collate, load_dataset
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError
from moai_recipes.models.tiny import DEMO_DATA, EOS, IM_END

INSTRUCT = [
    {"instruction": "What is the opposite of open?", "input": "", "output": "The opposite of open is closed."},
    {"instruction": "Name the sound.", "input": "A cow.", "output": "A cow says moo."},
    {"instruction": "What sound does a bee make?", "input": "", "output": "A bee says buzz."},
]
CHAT = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"},
                  {"role": "assistant", "content": "It is closed."}, {"role": "user", "content": "And a cow?"},
                  {"role": "assistant", "content": "A cow says moo."}]},
    {"messages": [{"role": "user", "content": "What sound does a dog make?"}, {"role": "assistant", "content": "Woof."}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
]
TEXT = [{"text": "The opposite of open is closed."}, {"text": "A cow says moo."}, {"text": "A bee says buzz."}]
ROWS = {"instruct": INSTRUCT, "chat": CHAT, "text": TEXT}


def write(path, rows):
    """Write rows in the format the file extension names; CSV cells hold lists as JSON text."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    return path


def targets(sample) -> list[int]:
    return [t for t in sample["labels"] if t != IGNORE_INDEX]


def load(tok, path, kind, *, max_seq_len=256, **kw):
    return load_dataset(DataSource(kind=kind, path=str(path), **kw), tok, max_seq_len=max_seq_len)


# --- loading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv"])
@pytest.mark.parametrize("kind", ["instruct", "chat", "text"])
def test_each_kind_loads_from_each_format(tok, tmp_path, kind, ext):
    ds = load(tok, write(tmp_path / f"data.{ext}", ROWS[kind]), kind)
    assert len(ds) == 3 and ds.dropped == 0
    reference = load(tok, write(tmp_path / "ref.jsonl", ROWS[kind]), kind)
    assert [ds[i] for i in range(3)] == [reference[i] for i in range(3)]


def test_demo_is_instruct_on_the_embedded_file(tok):
    ds = load_dataset(DataSource(kind="demo"), tok, max_seq_len=256)
    rows = [line for line in DEMO_DATA.read_text().splitlines() if line.strip()]
    assert len(ds) == len(rows) and ds.num_target_tokens(0) > 0


def test_json_lines_in_a_json_file_and_blank_lines_are_skipped(tok, tmp_path):
    path = tmp_path / "data.json"
    path.write_text("\n".join(json.dumps(r) for r in INSTRUCT[:2]) + "\n\n\n" + json.dumps(INSTRUCT[2]) + "\n")
    assert len(load(tok, path, "instruct")) == 3


# --- masking and labels ------------------------------------------------------------------------


def test_instruct_trains_only_the_answer_and_its_end_of_turn(tok, tmp_path):
    ds = load(tok, write(tmp_path / "data.jsonl", INSTRUCT), "instruct")
    sample = ds[1]
    assert tok.decode(targets(sample), skip_special=False) == "A cow says moo." + IM_END + "\n"
    # Every position before the answer predicts nothing; the last prompt position predicts its first token.
    prompt = tok.encode_prompt([{"role": "user", "content": "Name the sound.\n\nA cow."}])
    assert sample["tokens"][: len(prompt)] == prompt
    assert set(sample["labels"][: len(prompt) - 1]) == {IGNORE_INDEX}
    assert sample["labels"][len(prompt) - 1] == sample["tokens"][len(prompt)]
    assert ds.num_target_tokens(1) == len(targets(sample))


def test_chat_trains_every_assistant_turn_and_nothing_else(tok, tmp_path):
    ds = load(tok, write(tmp_path / "data.jsonl", CHAT), "chat")
    assert tok.decode(targets(ds[0]), skip_special=False) == f"It is closed.{IM_END}\nA cow says moo.{IM_END}\n"


def test_sharegpt_rows_and_column_match_openai(tok, tmp_path):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in r["messages"]]} for r in CHAT]
    ds = load(tok, write(tmp_path / "sharegpt.jsonl", sharegpt), "chat")
    reference = load(tok, write(tmp_path / "openai.jsonl", CHAT), "chat")
    assert [ds[i] for i in range(3)] == [reference[i] for i in range(3)]


def test_train_on_input_trains_the_prompt_too(tok, tmp_path):
    ds = load(tok, write(tmp_path / "data.jsonl", INSTRUCT), "instruct", train_on_input=True)
    sample = ds[1]
    assert sample["labels"] == sample["tokens"][1:] + [IGNORE_INDEX]


def test_text_trains_every_token_with_bos_and_eos(tok, tmp_path):
    sample = load(tok, write(tmp_path / "data.jsonl", TEXT), "text")[1]
    assert sample["tokens"] == tok.encode("A cow says moo.")
    assert sample["tokens"][0] == tok.bos_id and sample["tokens"][-1] == tok.eos_id
    assert sample["labels"] == sample["tokens"][1:] + [IGNORE_INDEX]  # shifted: labels[j] is tokens[j + 1]


def test_truncation_keeps_the_start_and_drops_rows_left_without_targets(tok, tmp_path):
    rows = [INSTRUCT[0], {"instruction": "word " * 100, "output": "ok"}]
    full = load(tok, write(tmp_path / "data.jsonl", rows), "instruct")[0]
    short = load(tok, tmp_path / "data.jsonl", "instruct", max_seq_len=len(full["tokens"]) - 3)
    assert len(short) == 1 and short.dropped == 1
    assert short[0]["tokens"] == full["tokens"][:-3]
    assert short[0]["labels"] == full["labels"][:-4] + [IGNORE_INDEX]
    with pytest.raises(UserError, match="max_seq_len=4"):
        load(tok, tmp_path / "data.jsonl", "instruct", max_seq_len=4)


def test_column_map_renames_columns(tok, tmp_path):
    rows = [{"prompt": r["instruction"], "context": r["input"], "response": r["output"]} for r in INSTRUCT]
    ds = load(tok, write(tmp_path / "data.csv", rows), "instruct",
              column_map={"instruction": "prompt", "input": "context", "output": "response"})
    reference = load(tok, write(tmp_path / "ref.jsonl", INSTRUCT), "instruct")
    assert [ds[i] for i in range(3)] == [reference[i] for i in range(3)]


def test_collate_right_pads(tok):
    batch = collate([{"tokens": [5, 6, 7], "labels": [6, 7, -100]}, {"tokens": [8], "labels": [-100]}], pad_id=tok.pad_id)
    assert batch["tokens"].dtype == torch.long
    assert batch["tokens"].tolist() == [[5, 6, 7], [8, tok.pad_id, tok.pad_id]]
    assert batch["labels"].tolist() == [[6, 7, -100], [-100, -100, -100]]


# --- errors name the file and the line -----------------------------------------------------------

GOOD = json.dumps(INSTRUCT[0])
BAD_JSONL = {  # line 1 and 2 good, the bad row on line 3 (after a blank line, which still counts)
    "missing column": ('{"instruction": "a", "response": "b"}', ["data.jsonl:4", "no 'output' column",
                       "columns present: instruction, response", "dataset.column_map.output=NAME"]),
    "invalid json": ('{"instruction": "a", ', ["data.jsonl:4", "not valid JSON"]),
    "non-string": ('{"instruction": "a", "output": 3}', ["data.jsonl:4", "'output' must be a string, got int"]),
    "not an object": ('["a", "b"]', ["data.jsonl:4", "expected an object"]),
}


@pytest.mark.parametrize("case", BAD_JSONL)
def test_bad_jsonl_row_names_file_and_line(tok, tmp_path, case):
    line, expected = BAD_JSONL[case]
    path = tmp_path / "data.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n\n{line}\n{GOOD}\n")
    with pytest.raises(UserError) as e:
        load(tok, path, "instruct")
    for text in expected:
        assert text in str(e.value)


BAD_CHAT = {
    "content not a string": ([{"role": "user", "content": ["a"]}], "message 0 of 'messages' must have string content"),
    "messages not a list": ({"role": "user"}, "must be a list of messages, got dict"),
    "unknown role": ([{"role": "robot", "content": "a"}], "role 'robot'"),
    "tool role": ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "message 1 .* role 'tool'"),
    "no messages": ([], "holds no messages"),
}


@pytest.mark.parametrize("case", BAD_CHAT)
def test_bad_chat_row_names_file_and_line(tok, tmp_path, case):
    messages, expected = BAD_CHAT[case]
    path = write(tmp_path / "data.jsonl", [CHAT[1], {"messages": messages}])
    with pytest.raises(UserError, match=f"data.jsonl:2: .*{expected}"):
        load(tok, path, "chat")


def test_json_list_error_names_the_line_of_the_row(tok, tmp_path):
    path = write(tmp_path / "data.json", [INSTRUCT[0], {"instruction": "a"}])
    with pytest.raises(UserError, match=r"data.json:7: no 'output' column"):  # [ + 5 lines of row 1 + },
        load(tok, path, "instruct")
    path.write_text('[\n {"instruction": "a",\n  "output": }\n]')
    with pytest.raises(UserError, match=r"data.json:3: not valid JSON"):
        load(tok, path, "instruct")


def test_parquet_error_names_the_row(tok, tmp_path):
    path = write(tmp_path / "data.parquet", [INSTRUCT[0], {**INSTRUCT[1], "output": None}])
    with pytest.raises(UserError, match=r"data.parquet row 2: column 'output' must be a string, got null"):
        load(tok, path, "instruct")


def test_csv_error_names_the_line_past_multiline_cells(tok, tmp_path):
    cell = json.dumps(CHAT[1]["messages"], indent=2)  # one cell over several lines
    path = tmp_path / "data.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["messages"], [cell], ["[not json"]])
    with pytest.raises(UserError, match=rf"data.csv:{3 + cell.count(chr(10))}: column 'messages' holds text that is not"):
        load(tok, path, "chat")


@pytest.mark.parametrize("name, content, expected", [
    ("missing.jsonl", None, "dataset.path=.*missing.jsonl does not exist"),
    ("data.txt", "hello", r"'.txt' files; use one of .json, .jsonl, .parquet, .csv"),
    ("empty.jsonl", "\n\n", "empty.jsonl is empty"),
    ("empty.csv", "", "empty.csv is empty"),
])
def test_file_level_errors(tok, tmp_path, name, content, expected):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=expected):
        load(tok, tmp_path / name, "instruct")


def test_path_and_column_map_mistakes(tok, tmp_path):
    with pytest.raises(UserError, match="set dataset.path=FILE"):
        DataSource(kind="chat")
    with pytest.raises(UserError, match="dataset.column_map.answer is not a column"):
        load(tok, DEMO_DATA, "instruct", column_map={"answer": "x"})
    with pytest.raises(UserError, match="dataset.kind=qa is not"):
        load(tok, DEMO_DATA, "qa")


def test_relative_path_is_from_the_current_directory(tok, tmp_path, monkeypatch):
    write(tmp_path / "data.jsonl", INSTRUCT)
    monkeypatch.chdir(tmp_path)
    assert len(load(tok, "data.jsonl", "instruct", max_seq_len=64)) == 3


# --- the tokenizer -------------------------------------------------------------------------------


def test_tokenizer_ids_and_round_trip(tok):
    ids = {t: tok._hf.token_to_id(t) for t in ("<|begin_of_text|>", EOS, "<|pad|>", IM_END)}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ids["<|begin_of_text|>"], ids[EOS], ids["<|pad|>"])
    assert tok.stop_ids == [ids[EOS], ids[IM_END]] and tok.has_chat_template and tok.vocab_size == 512
    assert tok.decode(tok.encode("A cow says moo.")) == "A cow says moo."
    assert tok.encode("moo", add_bos=False, add_eos=False) == tok.encode("moo")[1:-1]


def test_encode_prompt_matches_the_training_prefix(tok):
    messages = CHAT[1]["messages"]
    tokens, masked = tok.tokenize_messages(messages)
    prompt = tok.encode_prompt(messages[:1])
    assert tokens[: len(prompt)] == prompt and masked.index(False) == len(prompt)


def test_missing_tokenizer_file_names_folder_and_file(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path} has no tokenizer.json"):
        Tokenizer.from_checkpoint(tmp_path)


def test_bos_and_eos_are_inferred_as_torchtunes_wrapper_infers_them(hf_checkpoints, tmp_path):
    """BOS and EOS from the tokens tokenizer_config.json names, else generation_config.json's ids (a list: its first),
    as torchtune's HuggingFaceBaseTokenizer infers them, which data/tokenizer.py no longer imports; where no BOS is
    named, none is added; where no EOS can be found, or a file is damaged, the user is told which and how to fix it."""
    from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer

    source = hf_checkpoints["llama"]
    config = json.loads((source / "tokenizer_config.json").read_text())
    bos, eos = config["bos_token"], config["eos_token"]
    cases = {"named": ({"bos_token": bos, "eos_token": {"content": eos, "lstrip": False}}, None),
             "generation's": ({}, {"bos_token_id": 5, "eos_token_id": [7, 8]}),
             "an unknown name": ({"bos_token": "<nothing>", "eos_token": eos}, {"bos_token_id": 9})}
    for name, (tokens, generation) in cases.items():
        folder = tmp_path / name
        shutil.copytree(source, folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": None, "eos_token": None,
                                                                 **tokens}))
        (folder / "generation_config.json").unlink(missing_ok=True)
        if generation:
            (folder / "generation_config.json").write_text(json.dumps(generation))
        theirs = HuggingFaceBaseTokenizer(str(folder / "tokenizer.json"),
                                          tokenizer_config_json_path=str(folder / "tokenizer_config.json"),
                                          generation_config_path=str(folder / "generation_config.json")
                                          if generation else None) if tokens else None
        ours = Tokenizer.from_checkpoint(folder)
        expected = (theirs.bos_id, theirs.eos_id) if theirs else (5, 7)
        assert (ours.bos_id, ours.eos_id) == expected, name
        first = ours.encode("moo")[0]
        assert (first == expected[0]) if "bos_token" in tokens else (first != 5)  # no BOS where none is named
        assert ours.stop_ids[0] == expected[1] and ours.encode("moo")[-1] == expected[1]

    (tmp_path / "generation's" / "generation_config.json").write_text(json.dumps({"bos_token_id": 5}))
    with pytest.raises(UserError, match="could not infer the EOS token.*set eos_token in its tokenizer_config.json"):
        Tokenizer.from_checkpoint(tmp_path / "generation's")
    (tmp_path / "named" / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(UserError, match=f"cannot read the tokenizer in {tmp_path / 'named'}: .*damaged"):
        Tokenizer.from_checkpoint(tmp_path / "named")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_matches_transformers_chat_template(hf_checkpoints, family):
    transformers = pytest.importorskip("transformers")
    folder = hf_checkpoints[family]
    ours, theirs = Tokenizer.from_checkpoint(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = CHAT[0]["messages"]
    text = theirs.apply_chat_template(messages, tokenize=False)
    tokens, masked = ours.tokenize_messages(messages)
    assert tokens == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(tokens, skip_special=False) == text
    prompt = theirs.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert ours.encode_prompt(messages[:2]) == theirs(prompt, add_special_tokens=False)["input_ids"]


def _variant(tiny_dir, tmp_path, **config):
    """A copy of the tiny checkpoint with tokenizer_config.json changed; a value of ... removes the key."""
    folder = tmp_path / "variant"
    shutil.copytree(tiny_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not ...}))
    return folder


def test_base_model_without_template_uses_plain_text(tiny_dir, tmp_path):
    tok = Tokenizer.from_checkpoint(_variant(tiny_dir, tmp_path, chat_template=...))
    assert not tok.has_chat_template and tok.stop_ids == [tok.eos_id]
    ds = load(tok, write(tmp_path / "data.jsonl", INSTRUCT), "instruct")
    assert tok.decode(ds[1]["tokens"], skip_special=False) == (
        "<|begin_of_text|>Name the sound.\n\nA cow.\n\nA cow says moo.<|end_of_text|>")
    assert tok.decode(targets(ds[1]), skip_special=False) == "A cow says moo." + EOS
    messages = [{"role": "user", "content": "Name the sound.\n\nA cow."}]
    assert tok.encode_prompt(messages) == ds[1]["tokens"][: len(tok.encode_prompt(messages))]


def test_template_that_moves_text_between_turns(tiny_dir, tmp_path):
    # Like Mistral's: the system prompt goes into the last user turn, so earlier renderings are no prefixes.
    template = (
        "{{ bos_token }}{% set system = messages | selectattr('role', 'eq', 'system') | list %}"
        "{% set chat = messages | rejectattr('role', 'eq', 'system') | list %}{% for m in chat %}"
        "{% if m.role == 'user' %}<|im_start|>{% if loop.last or loop.revindex == 2 %}{% for s in system %}"
        "{{ s.content }}\n\n{% endfor %}{% endif %}{{ m.content }}<|im_end|>"
        "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
    tok = Tokenizer.from_checkpoint(_variant(tiny_dir, tmp_path, chat_template=template))
    tokens, masked = tok.tokenize_messages(CHAT[0]["messages"])
    trained = tok.decode([t for t, m in zip(tokens, masked) if not m], skip_special=False)
    assert trained == f" It is closed.{EOS} A cow says moo.{EOS}"
    assert tok.stop_ids == [tok.eos_id]


def test_template_with_bos_and_model_without_bos(tiny_dir, tmp_path):
    # Qwen: bos_token null, and the template emits no BOS; nothing must be prepended.
    tok = Tokenizer.from_checkpoint(_variant(tiny_dir, tmp_path, bos_token=None,
                                             chat_template=json.loads((tiny_dir / "tokenizer_config.json").read_text())
                                             ["chat_template"].removeprefix("{{ bos_token }}")))
    tokens, _ = tok.tokenize_messages(CHAT[1]["messages"])
    assert tok.decode(tokens[:1], skip_special=False) == "<|im_start|>"
    assert tok.encode("moo") == tok.encode("moo", add_bos=False)
    assert isinstance(tok.bos_id, int)


def test_template_rejection_names_file_and_line(tiny_dir, tmp_path):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}ok"
    tok = Tokenizer.from_checkpoint(_variant(tiny_dir, tmp_path, chat_template=template))
    path = write(tmp_path / "data.jsonl", [CHAT[1], {"messages": CHAT[1]["messages"][::-1]}])
    with pytest.raises(UserError, match="data.jsonl:2: the chat template of .* rejects this conversation: start with"):
        load(tok, path, "chat")


LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_llama3_template_and_a_tokenizer_that_adds_bos_itself(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from moai_recipes.models.tiny import demo_texts

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.train_from_iterator(demo_texts(), trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[(special[0], 0)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": special[0], "eos_token": special[1], "chat_template": LLAMA3_TEMPLATE}))
    tok = Tokenizer.from_checkpoint(tmp_path)
    assert tok.stop_ids == [1, 4] and tok.pad_id == tok.eos_id
    assert tok.encode("moo", add_bos=False, add_eos=False) == tok.encode("moo")[1:-1]  # no BOS from the post-processor
    tokens, masked = tok.tokenize_messages(CHAT[0]["messages"])
    assert tokens.count(0) == 1 and tokens[0] == 0
    trained = tok.decode([t for t, m in zip(tokens, masked) if not m], skip_special=False)
    assert trained == "It is closed.<|eot_id|>A cow says moo.<|eot_id|>"
