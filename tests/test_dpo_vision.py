"""recipes.dpo on image+text pairs against TRL's DPOTrainer for an image-text model (its vision collator): the same
tiny random checkpoint (Qwen2.5-VL- and Gemma 3-shaped), the same rows of generated pictures with a question, the
right answer chosen and a wrong one rejected, in the same order, the same hyper-parameters: each step's loss and
rewards equal TRL's, under LoRA too; the same numbers on two processes (FSDP2), with the reference cached in a first
pass and the pairs' sequences packed in one row (Qwen2.5-VL, whose packed rows take their M-RoPE positions per
document).
Run: python -m pytest tests/test_dpo_vision.py -q"""

import json
from pathlib import Path

import pytest

from moai_recipes.data.images import load_processor
from tests.helpers import FSDP, layout, metrics, peak_error, plan_of, run_recipe
from tests.test_dpo import BATCH, LR, SEED, STEPS, _order, _same
from tests.vision_models import make_vision_checkpoint, picture_pairs

pytest.importorskip("trl")

def _ours(tmp_path: Path, name: str, model: Path, data: Path, *extra, peak: bool = False) -> list[dict]:
    """Our run's metrics; `peak`: the planner's peak of its measured step within 10% (the pictures twice a pair, a
    packed row's pairs' pictures all counted)."""
    out = tmp_path / name
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.path={data}", f"batch_size={BATCH}",
                   "epochs=2", f"max_steps={STEPS}", f"optimizer.lr={LR}", "optimizer.warmup_steps=1", f"seed={SEED}",
                   "max_seq_len=256", "logger=stdout", "sample_max_new_tokens=0", f"output_dir={out}", *extra,
                   module="recipes.dpo")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if peak:
        assert abs(peak_error(r.stdout)) <= 0.10, r.stdout[-2000:]
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return rows


def _trl(tmp_path: Path, model, data: Path, *, lr: float = LR) -> list[dict]:
    """TRL's DPOTrainer on the pairs in our order; `model`: the checkpoint's folder, or a model made of it."""
    import transformers
    from datasets import Dataset
    from PIL import Image
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows:
        row["images"] = [Image.open(data.parent / p).convert("RGB") for p in row["images"]]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     max_steps=STEPS, learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0,
                     beta=0.1, loss_type=["sigmoid"], max_length=256, seed=SEED, train_sampling_strategy="sequential",
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                     gradient_checkpointing=False, remove_unused_columns=False)
    ordered = [rows[i % len(rows)] for i in _order(len(rows))]
    folder = model if isinstance(model, Path) else Path(model.config._name_or_path)
    if isinstance(model, Path):
        model = transformers.AutoModelForImageTextToText.from_pretrained(model, dtype="float32")
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(ordered),
                         processing_class=load_processor(folder))  # AutoProcessor's, without torchvision
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "rewards/chosen" in h]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3_vl"])
def test_full_dpo_on_pictures_equals_trl_and_is_the_same_on_two_processes(name, tmp_path):
    model = make_vision_checkpoint(tmp_path / "model", name)
    data = picture_pairs(tmp_path / "data")
    ours = _ours(tmp_path, "one", model, data, "flavor=cpu", "reference=copy", "plan.packing=false", peak=True)
    _same(ours, _trl(tmp_path, model, data))
    if name != "qwen2_5_vl":  # the two-process run once: its images' inputs are the same kind of tensors
        return
    two = _ours(tmp_path, "two", model, data, "flavor=cpu-2", *FSDP, "reference=cached", "plan.packing=true",
                peak=True)
    assert layout(tmp_path / "two") == "sharded" and plan_of(tmp_path / "two")["packing"]
    _same(two, ours)
    # One process, the pairs packed: a row of four pairs carries eight sets of pictures (the planner priced one,
    # 34% under the measured peak, before it counted what a packed row holds).
    packed = _ours(tmp_path, "packed", model, data, "flavor=cpu", "reference=copy", "plan.packing=true", peak=True)
    assert plan_of(tmp_path / "packed")["packing"]
    _same(packed, ours)


def test_a_missing_picture_is_named_with_its_row_and_the_vision_tower_is_planned(tmp_path):
    """A pair whose picture is missing: exit 2 before any step, the row and the file named. The planner prices the
    vision tower on the pairs' pictures, which both sequences of a pair carry (data/preferences.image_load)."""
    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = picture_pairs(tmp_path / "data")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[5]["images"] = ["pictures/404.png"]
    broken = tmp_path / "data" / "broken.jsonl"
    broken.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.path={broken}", "max_seq_len=256",
                   f"output_dir={tmp_path / 'out'}", module="recipes.dpo")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{broken}:6: image pictures/404.png is not a file" in r.stderr, r.stderr[-2000:]

    from moai_recipes.config.compose import load_config
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.inputs import read_inputs

    cfg = load_config("dpo", [f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.path={data}",
                              "max_seq_len=256", "output_dir=-"])
    work = read_inputs(cfg, resolve_flavor(**cfg.flavor), dry=True, output=False).workload
    assert work.images is not None and len(work.images.tokens) == 8
    # Each pair's image tokens twice (its chosen and its rejected sequence); the example is the pair with the most.
    assert all(t % 2 == 0 and t > 0 for t in work.images.tokens)
    assert max(work.images.tokens) == 2 * work.images.example_tokens


def test_lora_dpo_on_pictures_equals_trl_with_the_adapters_off_as_reference(tmp_path):
    """LoRA on the language model (the vision tower frozen): TRL starts from our first adapter (a step at lr 0 writes
    it: A as init_adapters draws it, B zero), a PeftModel whose reference TRL takes with the adapters off, as ours."""
    import transformers
    from peft import PeftModel

    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = picture_pairs(tmp_path / "data")
    lora = ["method=lora", "reference=copy"]  # the default adapters: every projection of the language model
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.path={data}", f"batch_size={BATCH}",
                   "max_steps=1", "optimizer.lr=0", f"seed={SEED}", "max_seq_len=256", "sample_max_new_tokens=0",
                   f"output_dir={tmp_path / 'start'}", *lora, module="recipes.dpo")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ours = _ours(tmp_path, "lora", model, data, *lora, "optimizer.lr=3e-2")
    base = transformers.AutoModelForImageTextToText.from_pretrained(model, dtype="float32")
    peft_model = PeftModel.from_pretrained(base, tmp_path / "start" / "adapter", is_trainable=True)
    # Adapters of a random model move its margins little in 4 steps (full fine-tuning's move them 0.05 or more): at the
    # last step the chosen answers are rewarded over the rejected by 0.03 on average, on half the pairs.
    _same(ours, _trl(tmp_path, peft_model, data, lr=3e-2), least_margin=0.02, least_accuracy=0.4)
