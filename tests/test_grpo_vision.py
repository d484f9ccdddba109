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

from tests.grpo_helpers import GROUP, LONGEST
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
    return helpers.trl_logs_on_fixed_completions(trainer)  # the same completions as ours


def test_grpo_on_pictures_equals_trl(tmp_path):
    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = picture_prompts(tmp_path / "data", PROMPTS)
    ours = _ours(tmp_path, "one", model, data, "flavor=cpu")
    _same(ours, _trl(tmp_path, model, data), KEYS + ("kl",))


@pytest.mark.parametrize("name", ["qwen2_5_vl", "gemma3_vl", "mllama"])
def test_the_sampler_continues_picture_prompts_as_transformers_generate(tmp_path, name):
    """Four picture prompts of different lengths (their pictures and questions differ) and one without a picture, in
    one left-padded batch with the KV cache, drawn greedily (top_k 1) by recipes.grpo's sampler: each completion is
    what transformers' `generate` gives that prompt alone (greedy, the image token suppressed as TRL suppresses it;
    Llama 3.2 Vision's decode steps seeing the tiles the prompt's last token saw).
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
    # Up to 16 image tokens: Qwen's positions 12 behind. Llama 3.2 Vision's pictures of one or two of its 4 tiles of
    # 28 pixels: the tiles a token sees are not all of them.
    data = picture_prompts(tmp_path / "data", 4, size=28 if name == "mllama" else 112)
    maker = image_samples(folder)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["prompt"][0]["content"][1]["text"] = "Look closely at the picture, then say: what colour is it?"
    rows[2]["prompt"][0]["content"][1]["text"] = "Tell me, in a word, its shape."
    if name != "mllama":  # Llama 3.2 Vision: a row without a picture in a batch with pictures reads the padding
        # picture's features (transformers' batch, unlike the row alone, which skips the cross-attention layers)
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
    head = next((k for k in weights if k.endswith("lm_head.weight")), None) or next(k for k in weights
                                                                                   if "embed_tokens" in k)
    weights[head][image_token] = 20 * weights[head][first]
    # Sharper attention (a random model's is nearly even, where positions barely matter): queries 8 x longer.
    for k in weights:
        if "q_proj" in k and "visual" not in k and "vision" not in k:
            weights[k] *= 8
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
    if name == "mllama":  # a prompt without a picture, alone: its cross-attention layers run on stand-ins that add
        # nothing (every device runs every layer, as FSDP2 needs), where generate skips them
        text = maker.rl_prompt({"prompt": [{"role": "user", "content": "Say a word."}]}, column_map={}, base=None)
        prompts, inputs = [text.tokens.tolist()], [None]
        with torch.no_grad():
            theirs = [generate(hf, 0, suppress=True)]
        ours = Sampler(greedy, never=(image_token,), **common).complete(model, prompts, [0], inputs).completions
        assert ours == theirs, (ours, theirs)


def test_sampled_on_pictures_and_resumed_mid_round_on_two_processes_as_on_one(tmp_path):
    """Sampled for real (temperature 1), num_iterations 2, three steps on one process; resumed from step 1's
    checkpoint on two (FSDP2, the completions packed in a row with their pictures: Qwen's positions per document).
    Step 2 trains again on step 1's completions, their pictures made again from the prompts (the checkpoint keeps no
    pixels); step 3 samples anew on two processes: the same completions, rewards, losses, KL and gradient norms."""
    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = picture_prompts(tmp_path / "data", PROMPTS)
    common = [f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}", f"batch_size={BATCH}",
              f"num_generations={GROUP}", f"max_completion_length={LONGEST}", "max_seq_len=128", "max_steps=3",
              "epochs=3", "optimizer.lr=3e-2", "optimizer.warmup_steps=0", "dtype=fp32", "beta=0.04",
              "num_iterations=2", "rewards=[tests.grpo_helpers.picture_reward]", "logger=stdout", "checkpoint_every=1",
              "checkpoint_keep=3"]
    r = run_recipe(*common, "flavor=cpu", "plan.packing=false", f"output_dir={tmp_path / 'one'}", module="recipes.grpo")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = run_recipe(*common, "flavor=cpu-2", "plan.replicate=false", "plan.packing=true",
                   f"resume={tmp_path / 'one' / 'checkpoints' / 'step-000001'}", f"output_dir={tmp_path / 'two'}",
                   module="recipes.grpo")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert plan_of(tmp_path / "two")["sharded"] and plan_of(tmp_path / "two")["packing"]
    assert not plan_of(tmp_path / "one")["packing"]
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [row["step"] for row in two] == [2, 3]
    for a, b in zip(one[1:], two, strict=True):
        for key in ("loss", "grad_norm", "kl", "reward", "reward_std", "completions/mean_length", "num_tokens"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]) + 1e-6, (a["step"], key, a[key], b[key])
    assert one[-1]["kl"] > 0 and one[-1]["reward_std"] > 0


def test_a_missing_picture_is_named_with_its_row_and_the_vision_tower_is_planned(tmp_path):
    """A prompt whose picture is missing: exit 2 before any step, the row and the file named; a string prompt with
    a picture column, which TRL refuses too. The planner prices the vision tower on the prompts' pictures, which each
    of a prompt's completions carries (data/prompts.PromptSet.image_load)."""
    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    data = picture_prompts(tmp_path / "data", PROMPTS)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    broken = tmp_path / "data" / "broken.jsonl"
    for change, said in ((lambda r: r.update(images=["pictures/404.png"]), f"{broken}:3: image pictures/404.png is not "
                          "a file"),
                         (lambda r: r.update(prompt="What shape is it?"), f"{broken}:3: column 'prompt' must be a "
                          "non-empty list of messages for an image-text model, got str")):
        wrong = [dict(r) for r in rows]
        change(wrong[2])
        broken.write_text("".join(json.dumps(r) + "\n" for r in wrong))
        r = run_recipe(f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={broken}", "max_seq_len=128",
                       "rewards=[tests.grpo_helpers.picture_reward]", f"output_dir={tmp_path / 'out'}",
                       module="recipes.grpo")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert said in r.stderr, r.stderr[-2000:]

    from moai_recipes.config.compose import load_config
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.inputs import read_inputs

    cfg = load_config("grpo", [f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}",
                               "max_seq_len=128", "output_dir=-"])
    work = read_inputs(cfg, resolve_flavor(**cfg.flavor), dry=True, output=False).workload
    assert work.images is not None and len(work.images.tokens) == PROMPTS and min(work.images.tokens) > 0
    assert max(work.images.tokens) == work.images.example_tokens


def test_the_shipped_answer_reward_finds_the_answer_in_the_completion():
    """moai_recipes.rewards.contains_answer, as the README's command uses it: the answer column's text anywhere in the
    completion, case and spacing aside; a conversational completion read from its content."""
    from moai_recipes.rewards import contains_answer

    completions = ["It is  RED.", [{"role": "assistant", "content": "Total: 1,234.50 EUR"}], "a circle", "blue"]
    assert contains_answer(completions, answer=["red", "1,234.50", "A square.", ""]) == [1.0, 1.0, 0.0, 0.0]


def test_the_planner_prices_the_prompts_pictures_in_the_sampling_round(tmp_path):
    """A round's prefill runs each prompt's pictures through the vision tower (forward only): the planner's sampling
    time of picture prompts exceeds the same prompts' without pictures by that tower's forward FLOPs at the prefill's
    efficiency, and grows with the pictures' image tokens (56 against 112 pixels: 4 times the tokens)."""
    from dataclasses import replace

    from moai_recipes.config.compose import load_config
    from moai_recipes.flavors import resolve_flavor
    from moai_recipes.inputs import read_inputs
    from moai_recipes.planner.rollouts import picture_flops
    from moai_recipes.planner.search import choose_plan

    model = make_vision_checkpoint(tmp_path / "model", "qwen2_5_vl")
    rounds = {}
    for size in (56, 112):
        data = picture_prompts(tmp_path / f"data{size}", PROMPTS, size=size)
        cfg = load_config("grpo", [f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}",
                                   "max_seq_len=512", f"batch_size={BATCH}", "output_dir=-"])
        flavor = resolve_flavor(**cfg.flavor)
        work = read_inputs(cfg, flavor, dry=True, output=False).workload
        chosen = choose_plan(work, flavor).chosen
        blind = choose_plan(replace(work, images=None), flavor, forced={
            k: getattr(chosen.plan, k) for k in ("micro_batch_size", "packing", "generation_batch")}).chosen
        assert picture_flops(chosen.plan, work) > 0 and picture_flops(chosen.plan, replace(work, images=None)) == 0
        rounds[size] = (chosen.time.terms["rollout"], blind.time.terms["rollout"], work.images.most)
        assert rounds[size][0] > rounds[size][1], rounds
    (small, small_blind, small_tokens), (large, large_blind, large_tokens) = rounds[56], rounds[112]
    assert large_tokens > 2 * small_tokens
    assert (large - large_blind) > 2 * (small - small_blind), rounds
