"""recipes.grpo on image prompts: the prompts of an image-text model made by its processor as TRL's GRPOTrainer makes
them, each completion trained with its prompt's pictures, and sampled with them.

Against TRL 1.16's GRPOTrainer for a tiny random Qwen2.5-VL-shaped checkpoint on the same rows of generated pictures
(a question after its picture; the answer and the pictures columns read by the reward), given the same completions:
every step's loss, gradient norm, rewards, entropy and clip ratios within 1e-4 relative, with a KL term. Sampled for
real: the sampler's greedy continuations of picture prompts of different lengths, and a prompt without a picture, in
one left-padded batch with the KV cache, are transformers' `generate` of each prompt alone (Qwen's multimodal rotary
positions, Gemma 3's image tokens attending both ways), the image token never drawn; one process and two (FSDP2)
sample the same completions and log the same numbers.
Run: python -m pytest tests/test_grpo_vision.py -q"""

import json
from pathlib import Path

import pytest
import torch

from tests.grpo_helpers import GROUP, LONGEST, fixed
from tests.helpers import metrics, plan_of, run_recipe
from tests.test_grpo import KEYS, _same
from tests.vision_models import make_vision_checkpoint, picture_prompts

pytest.importorskip("trl")

PROMPTS, STEPS, LR, SEED = 4, 2, 3e-2, 0
BATCH = PROMPTS * GROUP  # every prompt a step
# AdamW's first step moves each weight by the learning rate in the sign of its gradient, however small: a few hundred
# weights whose gradient at step 1 is rounding noise (a group's advantages cancel; query and key weights barely matter
# at the start) move by the full rate in a direction the order of summation picks, and step 2's KL moves 5% with them.
# eps 1 makes the step proportional to the gradient (lr x g / (|g| + 1)): step 2 then checks step 1's gradient.
EPS = 1.0
CASE = dict(loss_type="grpo", beta=0.04, num_iterations=1)


def _ours(tmp_path: Path, name: str, model: Path, data: Path, *extra, fixed_completions: bool = True) -> list[dict]:
    out = tmp_path / name
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}", f"batch_size={BATCH}",
                   f"num_generations={GROUP}", f"max_completion_length={LONGEST}", "max_seq_len=128",
                   f"max_steps={STEPS}", f"epochs={STEPS}", f"optimizer.lr={LR}", "optimizer.warmup_steps=0",
                   "optimizer.betas=[0.9,0.999]", "optimizer.weight_decay=0.0", f"optimizer.eps={EPS}", f"seed={SEED}",
                   "dtype=fp32", "rewards=[tests.grpo_helpers.picture_reward]", "logger=stdout", f"output_dir={out}",
                   *[f"{k}={v}" for k, v in CASE.items()], *extra, module="recipes.grpo",
                   env={"MOAI_TEST_COMPLETIONS": "tests.grpo_helpers.fixed"} if fixed_completions else None)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return rows


def _trl(tmp_path: Path, folder: Path, data: Path) -> list[dict]:
    import transformers
    import trl.trainer.grpo_trainer as grpo_trainer
    from datasets import Dataset
    from PIL import Image
    from trl import GRPOConfig, GRPOTrainer

    import tests.grpo_helpers as helpers
    from moai_recipes.data.images import load_processor

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows:
        row["images"] = [Image.open(data.parent / p).convert("RGB") for p in row["images"]]
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, num_generations=GROUP,
                      max_completion_length=LONGEST, learning_rate=LR, logging_steps=1, max_steps=STEPS, seed=SEED,
                      gradient_checkpointing=False, remove_unused_columns=False, adam_epsilon=EPS, **CASE)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[helpers.picture_reward], args=args,
                          processing_class=load_processor(folder), train_dataset=Dataset.from_list(rows))
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (fixed(prompt_ids), None)
    original, grpo_trainer.shuffle_sequence_dict = grpo_trainer.shuffle_sequence_dict, lambda d: d
    try:
        trainer.train()
    finally:
        grpo_trainer.shuffle_sequence_dict = original
    return [h for h in trainer.state.log_history if "loss" in h and "reward" in h or "entropy" in h]


def test_grpo_on_pictures_equals_trl(tmp_path):
    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = picture_prompts(tmp_path / "data", PROMPTS)
    ours = _ours(tmp_path, "one", model, data, "flavor=cpu")
    _same(ours, _trl(tmp_path, model, data), KEYS + ("kl",))


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3_vl"])
def test_the_sampler_continues_picture_prompts_as_transformers_generate(tmp_path, name):
    """Four picture prompts of different lengths (their pictures and questions differ) and one without a picture, in
    one left-padded batch with the KV cache, drawn greedily (top_k 1) by recipes.grpo's sampler: each completion is
    what transformers' `generate` gives that prompt alone (greedy, the image token suppressed as TRL suppresses it).
    The image token's output weights are made its first choice after the first prompt: drawn unless suppressed (seen
    below, so the suppression is tested)."""
    from dataclasses import replace

    import transformers
    from safetensors.torch import load_file, save_file

    from moai_recipes.data.images import image_samples, open_image
    from moai_recipes.models.hf_format import HFFolder
    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan
    from moai_recipes.train.rollouts import Sampler, SamplingSettings
    from tests.helpers import model_of, setup as setup_of

    folder = make_vision_checkpoint(tmp_path / "model", name)
    data = picture_prompts(tmp_path / "data", 4)
    maker = image_samples(folder)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["prompt"][0]["content"][1]["text"] = "Look closely at the picture, then say: what colour is it?"
    rows.append({"prompt": [{"role": "user", "content": "Say a word."}]})
    made = [maker.rl_prompt(row, column_map={}, base=data.parent) for row in rows]
    prompts = [m.tokens.tolist() for m in made]
    inputs = [maker.image_inputs(m.text, [open_image(v, base=m.base) for v in m.images], m.tokens.tolist(),
                                 special_tokens=m.special_tokens) if m.images else None for m in made]
    assert len({len(p) for p in prompts}) >= 3, [len(p) for p in prompts]
    image_token, eos, pad = maker.image_token_id, 1, 2

    def generate(hf, i: int, suppress: bool) -> list[int]:
        extra = {k: torch.tensor([v]) if isinstance(v, list) else v for k, v in (inputs[i] or {}).items()}
        out = hf.generate(input_ids=torch.tensor([prompts[i]]), attention_mask=torch.ones(1, len(prompts[i]),
                          dtype=torch.long), **extra, do_sample=False, max_new_tokens=LONGEST, eos_token_id=eos,
                          pad_token_id=pad, **({"suppress_tokens": [image_token]} if suppress else {}))
        return out[0, len(prompts[i]):].tolist()

    # The image token made the likeliest first token of the first prompt: its output row 20 x the first choice's.
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    first = generate(hf, 0, suppress=True)[0]
    weights = load_file(folder / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else next(k for k in weights if "embed_tokens" in k)
    weights[head][image_token] = 20 * weights[head][first]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = [generate(hf, i, suppress=True) for i in range(len(prompts))]
    assert theirs[0][0] != image_token

    spec = HFFolder.open(folder).spec
    flavor = setup_of("flavor=cpu")[2]
    plan = replace(choose_plan(Workload(spec=spec, batch_size=8, seq_len=128), flavor).chosen.plan,
                   generation_batch=len(prompts))
    model = model_of(folder)[0]
    common = dict(stop_ids=(eos,), pad_id=pad, plan=plan, device=torch.device("cpu"), max_length=128)
    greedy = SamplingSettings(temperature=1.0, top_k=1, max_completion_length=LONGEST)
    ours = Sampler(greedy, never=(image_token,), **common).complete(model, prompts, list(range(len(prompts))),
                                                                    inputs).completions
    assert ours == theirs, (ours, theirs)
    unsuppressed = Sampler(greedy, **common).complete(model, prompts, list(range(len(prompts))), inputs).completions
    assert unsuppressed[0][0] == image_token, unsuppressed
