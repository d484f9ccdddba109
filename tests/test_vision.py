"""Image-text models (Qwen2.5-VL, Gemma 3) trained on chat rows with images, read by the checkpoint's own processor.

Each model is a tiny random checkpoint written by transformers with a processor of its own (tests/vision_models.py);
the rows are generated pictures of coloured shapes.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from moai_recipes.data.datasets import DataSource, collate
from moai_recipes.data.images import image_samples, load_image_dataset
from moai_recipes.models.hf_format import HFFolder
from moai_recipes.models.loss import IGNORE_INDEX, token_loss_sum
from tests.helpers import FSDP, layout, metrics, peak_error, plan_of, run_recipe, tensors
from tests.test_architectures import _loaded
from moai_recipes.data.pictures import write_picture_rows
from tests.vision_models import VISION, make_vision_checkpoint

NAMES = list(VISION)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vision")
    return {name: make_vision_checkpoint(base / name, name) for name in NAMES}


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    # Pictures large enough that the vision tower's activations are a good part of a step's peak (Qwen2.5-VL: 16
    # image tokens of 64 patches each; the planner's prediction without them is 27-43% under the measured peak).
    return write_picture_rows(tmp_path_factory.mktemp("pictures"), 16, size=112)


def _unshifted(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels (the token at each position, shifted by the model) of our shifted ones."""
    return torch.cat([torch.full_like(labels[:, :1], IGNORE_INDEX), labels[:, :-1]], dim=1)


@pytest.mark.parametrize("name", NAMES)
def test_samples_are_the_processors_and_the_loss_is_transformers(checkpoints, pictures, name):
    from transformers import AutoModelForImageTextToText

    folder = checkpoints[name]
    hf = HFFolder.open(folder)
    # Llama 3.2 Vision's rows are padded, never packed: a text token before its picture attends to every tile of its
    # row (transformers' mask), which in a packed row would be other documents' pictures.
    assert hf.spec.reads_images and bool(hf.spec.parts.unpackable) == (name == "mllama")
    maker = image_samples(folder)
    data = load_image_dataset(DataSource(kind="chat", path=str(pictures)), maker, max_seq_len=128)
    rows = [json.loads(line) for line in pictures.read_text().splitlines()]
    tokenizer = maker.processor.tokenizer
    samples = [data[i] for i in range(3)]
    for row, sample in zip(rows, samples):
        # The tokens are the processor's own for the conversation and its picture; the targets its answer alone.
        messages = row["messages"]
        text = maker.processor.apply_chat_template(messages, tokenize=False)
        from PIL import Image

        image = Image.open(pictures.parent / row["images"][0]).convert("RGB")
        theirs = maker.processor(text=[text], images=[image], return_tensors="pt")
        assert sample["tokens"] == theirs["input_ids"][0].tolist()
        answer = messages[1]["content"][0]["text"]
        assert tokenizer.decode([t for t in sample["labels"] if t != IGNORE_INDEX]).startswith(answer)
        assert torch.equal(sample["images"]["pixel_values"], theirs["pixel_values"])

    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = _loaded(hf)
    batch = collate(samples, pad_id=tokenizer.pad_token_id)  # right-padded rows, as a micro-batch
    count = int((batch["labels"] != IGNORE_INDEX).sum())
    with torch.no_grad():
        theirs = float(reference(input_ids=batch["tokens"], labels=_unshifted(batch["labels"]),
                                 **batch["images"]).loss)
        for chunked in (False, True):
            ours = float(token_loss_sum(model, batch["tokens"], batch["labels"], chunked=chunked,
                                        images=batch["images"])) / count
            assert abs(ours - theirs) <= 1e-5, (chunked, ours, theirs)
        # The pictures matter: without them the loss is another, and ours is transformers' (Llama 3.2 Vision's
        # cross-attention layers run on stand-ins that change nothing, where transformers skips them).
        blind = float(reference(input_ids=batch["tokens"], labels=_unshifted(batch["labels"])).loss)
        assert abs(blind - theirs) > 1e-4
        ours = float(token_loss_sum(model, batch["tokens"], batch["labels"], chunked=False)) / count
        assert abs(ours - blind) <= 1e-5, (ours, blind)
        if name == "mllama":
            return
        # A packed row: the three samples end to end, each attending to itself with its own positions (Qwen's
        # multimodal rotary positions computed for it alone), against each alone through transformers.
        from moai_recipes.models.attention import Documents
        from moai_recipes.train.micro_batches import collate_images

        row = torch.tensor([[t for s in samples for t in s["tokens"]]])
        lengths = [len(s["tokens"]) for s in samples]
        logits = model(row, mask=Documents(tuple(lengths)), images=collate_images(samples, None))[0].split(lengths)
        for sample, ours in zip(samples, logits):
            alone = collate([sample], pad_id=tokenizer.pad_token_id)
            theirs = reference(input_ids=alone["tokens"], **alone["images"]).logits[0]
            assert (ours - theirs).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3_vl", "mllama"])  # Qwen3-VL computes as Qwen2.5-VL lays out
def test_one_and_two_processes_train_alike_and_lr_zero_writes_back_every_tensor_and_the_processor(
        checkpoints, pictures, name, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    common = [f"model.checkpoint_dir={checkpoints[name]}", "dataset=chat", f"dataset.path={pictures}", "max_steps=2",
              "batch_size=4", "max_seq_len=96", "logger=stdout", "sample_max_new_tokens=0"]
    curves, packed = {}, {}
    # cpu-2 packs its rows (each sample attending to itself, Qwen's positions computed for each), cpu pads them;
    # Llama 3.2 Vision's are padded on both (its rows cannot be packed).
    packs = name != "mllama"
    runs = [("cpu", ("optimizer.lr=1e-3", "plan.packing=false")),
            ("cpu-2", (*FSDP, "optimizer.lr=1e-3", f"plan.packing={str(packs).lower()}")),
            ("cpu-2-lr0", (*FSDP, "optimizer.lr=0", "max_steps=1", "measure_memory=false"))]
    if name == "qwen2_5_vl":  # and on four processes (a sample each, padded)
        runs.append(("cpu-4", (*FSDP, "optimizer.lr=1e-3", "plan.packing=false", "measure_memory=false")))
    for flavor, forced in runs:
        out = tmp_path / flavor
        r = run_recipe(*common, f"flavor={flavor.removesuffix('-lr0')}", *forced, f"output_dir={out}")
        assert r.returncode == 0, r.stdout + r.stderr
        assert layout(out) == ("single" if flavor == "cpu" else "sharded")
        packed[flavor] = plan_of(out)["packing"]
        if flavor in ("cpu", "cpu-2"):  # the planner's peak of a device, the vision tower's share included
            assert abs(peak_error(r.stdout)) <= 0.10, r.stdout
        curves[flavor] = metrics(out)
    assert len(curves["cpu"]) == len(curves["cpu-2"]) == 2
    assert (packed["cpu"], packed["cpu-2"], packed.get("cpu-4", False)) == (False, packs, False)
    for flavor, steps in (("cpu-2", 2), ("cpu-2-lr0", 1), ("cpu-4", 2)):  # at lr 0 the first step is before any update
        if flavor not in curves:
            continue
        assert len(curves[flavor]) >= steps, (flavor, curves[flavor])
        for one, other in zip(curves["cpu"][:steps], curves[flavor][:steps]):
            for key in ("loss", "grad_norm"):
                assert abs(one[key] - other[key]) <= 1e-4 * max(1.0, abs(one[key])), (flavor, key, curves)
    # The vision tower trained too: its weights moved in the full fine-tune.
    before, moved = tensors(checkpoints[name]), tensors(tmp_path / "cpu" / "model")
    vision = [k for k in before if "visual" in k or "vision" in k]
    assert vision and all(not torch.equal(before[k], moved[k]) for k in vision[:4])
    written = tmp_path / "cpu-2-lr0" / "model"
    after = tensors(written)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    # The processor's files beside it: transformers reads the folder as it reads the checkpoint, with the same logits.
    for f in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (written / f).read_bytes() == (checkpoints[name] / f).read_bytes(), f
    row = json.loads(pictures.read_text().splitlines()[0])
    image = Image.open(pictures.parent / row["images"][0]).convert("RGB")
    logits = []
    for folder in (checkpoints[name], written):
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        text = image_samples(folder).processor.apply_chat_template(row["messages"], tokenize=False)
        inputs = image_samples(folder).processor(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            logits.append(model(**inputs).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("name, vision, projector", [("gemma3_vl", "frozen", "frozen"),
                                                     ("qwen2_5_vl", "frozen", "frozen"),
                                                     ("gemma3_vl", "lora", "full"), ("qwen2_5_vl", "full", "lora"),
                                                     ("mllama", "lora", "full")])
def test_lora_loads_in_peft_with_our_logits_the_vision_tower_and_projector_as_asked(checkpoints, pictures, name,
                                                                                   vision, projector, tmp_path):
    """LoRA adapts the language model, and the vision tower and projector each stay frozen (the default), get
    adapters, or train whole (PEFT's modules_to_save); PEFT puts the adapters where we did, though SigLIP's attention
    has projections of the same names as the language model's, and computes our logits."""
    import peft
    from transformers import AutoModelForImageTextToText

    from moai_recipes.models.lora import freeze_base, gather_adapters, lora_options, save_adapter
    from moai_recipes.models.transformers_model import image_part

    hf = HFFolder.open(checkpoints[name])
    opts = lora_options({"apply_to_output": False, "rank": 4, "alpha": 8, "dropout": 0.0, "quantize_base": False,
                         "attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"], "apply_to_mlp": True,
                         "vision": vision, "projector": projector}, spec=hf.spec)
    model = _loaded(hf, lora=opts.builder_kwargs())
    freeze_base(model)
    trained = {part: [n for n, p in model.named_parameters() if p.requires_grad and image_part(model, n) == part]
               for part in ("vision", "projector", None)}
    for part, setting in (("vision", vision), ("projector", projector)):
        params = [n for n, _ in model.named_parameters() if image_part(model, n) == part and ".lora_" not in n]
        assert params  # the model has such a part
        if setting == "frozen":
            assert not trained[part]
        elif setting == "lora":
            assert trained[part] and all(".lora_" in n for n in trained[part])
        else:
            assert sorted(trained[part]) == sorted(params)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_b." in n:  # B starts at zero: make the adapters change something
                p.normal_(0, 0.1)
            elif p.requires_grad and ".lora_a." not in n:  # a module trained whole, as if trained
                p.add_(torch.randn_like(p) * 0.05)
    save_adapter(gather_adapters(model), opts=opts, out_dir=tmp_path / "adapter", base_model=str(hf.folder))
    batch = collate([load_image_dataset(DataSource(kind="chat", path=str(pictures)), image_samples(hf.folder),
                                        max_seq_len=128)[0]], pad_id=0)
    base = AutoModelForImageTextToText.from_pretrained(hf.folder, dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=batch["tokens"], **batch["images"]).logits
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    adapted_modules = [n for n, m in adapted.named_modules() if hasattr(m, "lora_A")]
    assert adapted_modules
    on_images = [n for n in adapted_modules if ".language_model." not in n]
    assert bool(on_images) == ("lora" in (vision, projector))
    with torch.no_grad():
        ours = model(batch["tokens"], images=batch["images"])
        theirs = adapted(input_ids=batch["tokens"], **batch["images"]).logits
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - before).abs().max() > 1e-3


def test_a_missing_or_damaged_image_or_a_miscounted_row_is_named_before_any_step(checkpoints, pictures, tmp_path):
    from moai_recipes.errors import UserError

    maker = image_samples(checkpoints["qwen2_5_vl"])
    rows = [json.loads(line) for line in pictures.read_text().splitlines()]

    def refusal(row) -> str:
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(row) + "\n")
        for image in rows[0]["images"] + rows[1]["images"]:
            (tmp_path / image).parent.mkdir(exist_ok=True)
            shutil.copy(pictures.parent / image, tmp_path / image)
        with pytest.raises(UserError) as e:
            load_image_dataset(DataSource(kind="chat", path=str(path)), maker, max_seq_len=128)
        assert f"{path}:2" in str(e.value)  # the file and the row
        return str(e.value)

    assert "pictures/404.png is not a file" in refusal({**rows[1], "images": ["pictures/404.png"]})
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    assert "broken.png cannot be read" in refusal({**rows[1], "images": ["broken.png"]})
    assert "holds 2 image(s) but the messages have 1 image part" in refusal(
        {**rows[1], "images": rows[1]["images"] * 2})
    assert "holds 0 image(s)" in refusal({**rows[1], "images": []})
    # Through a recipe: exit 2, one line, nothing written; and a text model given rows with images says so.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[1], "images": ["pictures/404.png"]}) + "\n")
    for checkpoint, said in ((checkpoints["qwen2_5_vl"], "404.png is not a file"), (None, "this model or recipe reads text only")):
        r = run_recipe(*([f"model.checkpoint_dir={checkpoint}"] if checkpoint else []), "dataset=chat",
                       f"dataset.path={pictures if checkpoint is None else bad}", "max_steps=1", "batch_size=2",
                       f"output_dir={tmp_path / 'out'}")
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "out").exists()


def test_lora_with_the_projector_trained_whole_and_the_vision_tower_adapted_trains_alike_on_two_processes(
        checkpoints, pictures, tmp_path):
    common = [f"model.checkpoint_dir={checkpoints['gemma3_vl']}", "dataset=chat", f"dataset.path={pictures}",
              "max_steps=2", "batch_size=4", "max_seq_len=96", "logger=stdout", "sample_max_new_tokens=0",
              "lora.vision=lora", "lora.projector=full", "optimizer.lr=1e-2"]
    curves = {}
    for flavor in ("cpu", "cpu-2"):
        out = tmp_path / flavor
        r = run_recipe(*common, f"flavor={flavor}", *(FSDP if flavor != "cpu" else ()), f"output_dir={out}",
                       module="recipes.lora_finetune")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "the vision tower's linear modules" in r.stdout and "the projector trained whole" in r.stdout
        assert abs(peak_error(r.stdout)) <= 0.10, r.stdout
        curves[flavor] = metrics(out)
    for one, other in zip(*curves.values()):
        for key in ("loss", "grad_norm"):
            assert abs(one[key] - other[key]) <= 1e-4 * max(1.0, abs(one[key])), (key, curves)
    config = json.loads((tmp_path / "cpu-2" / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.multi_modal_projector"]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "mllama"])
def test_the_answers_about_sample_pictures_are_what_transformers_generates_from_the_saved_model(
        checkpoints, pictures, tmp_path, name):
    """The before/after answers of an image-text run (dataset.sample_images) are greedy answers about each picture:
    those after training equal transformers' greedy `generate` on the saved model, given the same picture (Llama 3.2
    Vision: each token generated sees the pictures the prompt's last token saw, as generate's cross-attention mask
    goes on)."""
    import re

    from PIL import Image
    from transformers import AutoModelForImageTextToText

    folder = checkpoints[name]
    picture = pictures.parent / json.loads(pictures.read_text().splitlines()[0])["images"][0]
    out = tmp_path / "run"
    r = run_recipe(f"model.checkpoint_dir={folder}", "dataset=chat", f"dataset.path={pictures}", "max_steps=3",
                   "batch_size=4", "max_seq_len=96", "logger=stdout", "flavor=cpu", "optimizer.lr=1e-2",
                   "sample_max_new_tokens=5", "dataset.sample_prompts=[What colour is it?]",
                   f"dataset.sample_images=[{picture}]", f"output_dir={out}")
    assert r.returncode == 0, r.stdout + r.stderr
    after = re.search(r"Sample 'What colour is it\? \[\d+\.png\]'\n  before: .*\n  after:  '(.*)'", r.stdout)
    assert after, r.stdout
    processor = image_samples(folder).processor
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(picture).convert("RGB")], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(out / "model", dtype=torch.float32).eval()
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    theirs = processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert f"'{after.group(1)}'" == repr(theirs)  # the step line prints each answer's repr
    if name != "qwen2_5_vl":
        return
    # A text model given pictures to ask about says so.
    r = run_recipe("dataset.sample_prompts=[Hi]", f"dataset.sample_images=[{picture}]", "max_steps=1",
                   f"output_dir={tmp_path / 'text'}")
    assert r.returncode == 2 and "this model reads no images" in r.stderr, r.stderr


def test_processed_rows_are_cached_until_a_picture_or_the_processor_changes(checkpoints, tmp_path):
    from moai_recipes.data.pictures import draw
    from moai_recipes.errors import UserError

    rows = write_picture_rows(tmp_path / "rows", 6, size=56)
    maker = image_samples(checkpoints["qwen2_5_vl"])
    source = DataSource(kind="chat", path=str(rows))
    first = load_image_dataset(source, maker, max_seq_len=128, cache=True)
    again = load_image_dataset(source, maker, max_seq_len=128, cache=True)
    assert (first.origin, again.origin) == ("tokenised", "cache")
    assert [again[i]["tokens"] for i in range(6)] == [first[i]["tokens"] for i in range(6)]
    assert torch.equal(again[0]["images"]["pixel_values"], first[0]["images"]["pixel_values"])
    # A picture drawn larger makes more image tokens: the cache does not answer for it.
    before = len(first[0]["tokens"])
    path = json.loads(rows.read_text().splitlines()[0])["images"][0]
    draw("circle", "red", size=112).save(rows.parent / path)
    grown = load_image_dataset(source, maker, max_seq_len=256, cache=True)
    assert grown.origin == "tokenised" and len(grown[0]["tokens"]) > before
    with pytest.raises(UserError, match="changed during the run"):  # what was processed before no longer holds
        first[0]["images"]["pixel_values"]
    assert load_image_dataset(source, image_samples(checkpoints["qwen3_vl"]), max_seq_len=256,
                              cache=True).origin == "tokenised"  # another processor


def test_qlora_holds_the_language_models_linear_weights_in_nf4_and_leaves_the_vision_tower_alone(pictures, tmp_path):
    from moai_recipes.models.build import is_nf4
    from moai_recipes.models.lora import NF4_BLOCK, lora_options
    from moai_recipes.models.tiny_vision import write_tiny_vl

    # Four times as wide as the tests' others: the language model's projections hold whole NF4 blocks.
    hf = HFFolder.open(write_tiny_vl(tmp_path, scale=4))
    opts = lora_options({"attn_modules": ["q_proj", "v_proj"], "apply_to_mlp": False, "apply_to_output": False,
                         "rank": 4, "alpha": 8, "dropout": 0.0, "quantize_base": True}, spec=hf.spec)
    qlora = _loaded(hf, lora=opts.builder_kwargs(), quantize_base=True)
    plain = _loaded(hf)
    linears = {n: m.weight.shape for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)}
    held = dict(qlora.named_parameters())
    text = {n for n in linears if ".language_model.layers." in n}
    whole = {n for n in text if linears[n][0] % 2 == 0 and (linears[n][0] // 2 * linears[n][1]) % NF4_BLOCK == 0}
    assert whole and set(opts.unquantized) == text - whole
    for name in linears:
        assert is_nf4(held[f"{name}.weight"]) == (name in whole), name
    batch = collate([load_image_dataset(DataSource(kind="chat", path=str(pictures)), image_samples(hf.folder),
                                        max_seq_len=128)[0]], pad_id=0)
    with torch.no_grad():  # NF4 is 4 bits a weight: close to the model, not equal
        ours = qlora(batch["tokens"], images=batch["images"])
        assert (ours - plain(batch["tokens"], images=batch["images"])).abs().max() < 0.5


def test_a_ranks_pictures_are_made_only_for_its_own_share_of_the_batch(checkpoints, pictures):
    """Every rank reads a step's whole global batch (and splits it as the plan does): the pictures of the samples
    another rank trains on are never opened or processed here."""
    data = load_image_dataset(DataSource(kind="chat", path=str(pictures)), image_samples(checkpoints["qwen2_5_vl"]),
                              max_seq_len=128)
    batch = [data[i] for i in range(8)]
    assert data.processed == 0 and all(len(s["tokens"]) for s in batch)
    mine = collate(batch[:3], pad_id=0)  # this rank's micro-batch
    assert data.processed == 3 and mine["images"]["image_grid_thw"].shape[0] == 3


@pytest.mark.parametrize("name, size, tokens", [("qwen3_vl_8b", [768, 1024], 768), ("qwen3_vl_8b", [28, 28], 64),
                                                ("gemma3_27b_vl", [768, 1024], 256)])
def test_a_plan_without_data_prices_one_picture_a_sample_as_the_image_processor_sizes_it(name, size, tokens):
    """recipes.plan of an image-text model only on the Hub (no checkpoint, no data read): each sample holds one picture
    of picture_size, made into inputs by the model's image processor (its config entry's preprocessor settings), its
    image tokens those the vision tower hands the language model. Qwen3-VL: 768 x 1024 pixels are 24 x 32 tokens of 32
    pixels; a 28-pixel picture is enlarged to its 65,536-pixel least (8 x 8 tokens). Gemma 3: 256 tokens whatever
    the size. An image processor transformers does not know is refused by name."""
    from moai_recipes.config.compose import load_config
    from moai_recipes.errors import UserError
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.inputs import read_inputs

    common = [f"model={name}", "flavor=small", "flavor.device=h100", "flavor.memory_gb=640", "batch_size=64",
              "max_seq_len=4096", "output_dir=-"]
    cfg = load_config("plan", [*common, f"picture_size=[{size[0]},{size[1]}]"])
    inputs = read_inputs(cfg, resolve_flavor(**cfg.flavor), dry=True, output=False)
    images = inputs.workload.images
    assert images is not None and images.assumed == tuple(size)
    assert images.example_tokens == tokens and images.tokens == (tokens,)
    assert f"one of {size[0]} x {size[1]} pixels a sample, {tokens:,} image tokens" in "\n".join(inputs.describe(cfg))
    if name == "gemma3_27b_vl":
        cfg = load_config("plan", [*common, "model.image_processor.image_processor_type=NoSuchProcessor"])
        with pytest.raises(UserError, match="'NoSuchProcessor' is not an image processor"):
            read_inputs(cfg, resolve_flavor(**cfg.flavor), dry=True, output=False)


def test_a_prompts_cross_attention_mask_goes_on_over_its_completion_as_the_processor_makes_it(checkpoints, pictures):
    """Llama 3.2 Vision, recipes.dpo's and recipes.grpo's rows: a prompt's image inputs (its processor's, over the
    prompt) with a completion after it. Collated, the completion's tokens see the tiles the prompt's last token sees:
    the logits are transformers' on the whole conversation as the processor makes it (its mask over every token).
    (TRL 1.16's DPOTrainer and GRPOTrainer stop on this model: they give it the prompt's mask only.)"""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from moai_recipes.data.images import collate_images, open_image

    folder = checkpoints["mllama"]
    maker = image_samples(folder)
    row = json.loads(pictures.read_text().splitlines()[0])
    prompt, answer = row["messages"]
    made = maker.rl_prompt({"prompt": [prompt], "images": row["images"]}, column_map={}, base=pictures.parent)
    inputs = maker.image_inputs(made.text, [open_image(v, base=made.base) for v in made.images], made.tokens.tolist(),
                                special_tokens=made.special_tokens)
    whole = maker.processor.apply_chat_template([prompt, answer], tokenize=False)
    theirs_inputs = maker.processor(text=[whole], images=[Image.open(pictures.parent / row["images"][0]).convert("RGB")],
                                    return_tensors="pt", add_special_tokens=made.special_tokens)
    tokens = theirs_inputs["input_ids"][0].tolist()
    assert tokens[:len(made.tokens)] == made.tokens.tolist() and len(tokens) > len(made.tokens) + 3
    batch = collate_images([{"tokens": tokens, "images": inputs}], len(tokens))
    assert torch.equal(batch["cross_attention_mask"], theirs_inputs["cross_attention_mask"])
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = _loaded(HFFolder.open(folder))
    with torch.no_grad():
        ours = model(torch.tensor([tokens]), images=batch)
        theirs = reference(**theirs_inputs).logits
    assert (ours - theirs).abs().max() <= 1e-4
