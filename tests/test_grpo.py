"""recipes.grpo against TRL 1.16's GRPOTrainer: the same tiny checkpoint, the same prompts and the same completions
given to both (TRL's generation replaced, ours by MOAI_TEST_COMPLETIONS), fp32: every step's loss, gradient norm,
reward, reward_std, kl, entropy and clip ratios within 1e-4 relative of TRL's, for each loss type, beta 0 and above
0, num_iterations 2 (the ratio moves off 1), full and LoRA. Sampled for real: the same completions and numbers on one
process and two (FSDP2), the KV cache the planner predicted; a run resumed mid-round on another flavor goes on as the
uninterrupted one; what cannot run is refused by name.
Run: python -m pytest tests/test_grpo.py -q
"""

import json
from pathlib import Path

import pytest
import torch

from tests.grpo_helpers import EOS, GROUP, LONGEST
from tests.helpers import make_hf_checkpoint, metrics, plan_of, run_recipe, start_adapter

pytest.importorskip("trl")

PROMPTS = ["hello there", "a b c", "the cat sat", "one two"]
TARGETS = [3, 5, 7, 11]
BATCH, STEPS, LR, LORA_LR, SEED = len(PROMPTS) * GROUP, 2, 3e-2, 1e-1, 0
# Where one process's steps are compared with several's past the first update: AdamW divides each moment by
# sqrt(v) + eps, so with the default eps (1e-8) a gradient at the level of rounding noise (1e-9: a weight the loss
# barely reaches, summed in another order over shards) moves its weight by about lr, one way or the other. By the
# second round the policies differed enough for one sampled token to fall the other way (cpu-2's completions at
# step 3, the same lengths, its KL 1% off; AVX2 kernels, 2026-11-29). eps 1e-6 keeps such steps proportional to their
# gradient (a noise gradient moves its weight by about lr / 1000) and barely changes one whose gradient is well above.
EPS = "optimizer.eps=1e-6"
KEYS = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/low_mean",
        "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
        "completions/mean_length", "completions/clipped_ratio", "num_tokens")
CASES = {  # name -> settings (TRL's names, both sides)
    "dapo, beta 0.04, two rewards": dict(loss_type="dapo", beta=0.04, num_iterations=1),
    "grpo, num_iterations 2, clip higher": dict(loss_type="grpo", beta=0.0, num_iterations=2, epsilon_high=0.28,
                                               mask_truncated_completions=True),
    "bnpo, beta 0.1, num_iterations 2, batch std": dict(loss_type="bnpo", beta=0.1, num_iterations=2,
                                                        scale_rewards="batch"),
    "dr_grpo, no std": dict(loss_type="dr_grpo", beta=0.0, num_iterations=1, scale_rewards="none"),
}
REWARDS = ["tests.grpo_helpers.length_reward", "tests.grpo_helpers.column_reward"]
WEIGHTS = [1.0, 0.5]


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    model = make_hf_checkpoint(root / "model", "llama")
    assert json.loads((model / "config.json").read_text())["eos_token_id"] == EOS
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in zip(PROMPTS, TARGETS)))
    return model, data


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """The prompts as TRL's conversational rows: one user turn each, the chat template applied by both."""
    data = tmp_path_factory.mktemp("grpo-chat") / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": _chat(p), "target": t}) + "\n" for p, t in zip(PROMPTS, TARGETS)))
    return data


def _ours(tmp_path: Path, name: str, model: Path, data: Path, case: dict, *extra, lr: float = LR) -> list[dict]:
    out = tmp_path / name.replace(" ", "_").replace(",", "")
    settings = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in case.items()]
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}", f"batch_size={BATCH}",
                   f"num_generations={GROUP}", f"max_completion_length={LONGEST}", "max_seq_len=32",
                   f"max_steps={STEPS}", f"epochs={STEPS}", f"optimizer.lr={lr}", "optimizer.warmup_steps=0",
                   "optimizer.betas=[0.9,0.999]", "optimizer.weight_decay=0.0", f"seed={SEED}", "dtype=fp32",
                   f"rewards=[{','.join(REWARDS)}]", f"reward_weights=[{','.join(map(str, WEIGHTS))}]",
                   "logger=stdout", f"output_dir={out}", *settings, *extra, module="recipes.grpo",
                   env={"MOAI_TEST_COMPLETIONS": "tests.grpo_helpers.fixed"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return rows


def _trl(tmp_path: Path, model, tokenizer_dir: Path, case: dict, *, lr: float = LR, chat: bool = False) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import tests.grpo_helpers as helpers

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, num_generations=GROUP,
                      max_completion_length=LONGEST, learning_rate=lr, logging_steps=1, max_steps=STEPS, seed=SEED,
                      gradient_checkpointing=False, reward_weights=WEIGHTS, **case)
    rewards = [helpers.length_reward, helpers.column_reward]
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, processing_class=AutoTokenizer.from_pretrained(
        tokenizer_dir), train_dataset=Dataset.from_dict({"prompt": [_chat(p) for p in PROMPTS] if chat else PROMPTS,
                                                         "target": TARGETS}))
    return helpers.trl_logs_on_fixed_completions(trainer)  # the same completions as ours


def _same(ours: list[dict], theirs: list[dict], keys=KEYS) -> None:
    assert len(ours) == len(theirs) == STEPS, (len(ours), len(theirs))
    assert "num_tokens" in theirs[0] and "loss" in theirs[0], theirs[0]  # TRL logs them each step it samples
    compared = set()
    for mine, trl in zip(ours, theirs):
        for key in keys:
            if key not in trl:  # TRL logs what it measures while sampling on the steps it samples only
                continue
            assert abs(mine[key] - trl[key]) <= 1e-4 * abs(trl[key]) + 1e-6, (mine["step"], key, mine[key], trl[key])
            compared.add(key)
    # Every key compared on some step: a key TRL renamed or stopped logging would otherwise drop out unseen.
    assert compared == set(keys), set(keys) - compared


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_full_grpo_equals_trl(setup, tmp_path, name):
    import transformers

    model, data = setup
    case = CASES[name]
    ours = _ours(tmp_path, name, model, data, case)
    theirs = _trl(tmp_path, transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), model, case)
    _same(ours, theirs, KEYS + (("kl",) if case.get("beta") else ()))


@pytest.mark.slow
def test_lora_grpo_equals_trl_with_the_adapters_off_as_reference(setup, tmp_path):
    import transformers
    from peft import PeftModel

    model, data = setup
    case = dict(loss_type="dapo", beta=0.04, num_iterations=2, epsilon_high=0.28)
    lora = ["method=lora", "lora.rank=4", "lora.alpha=8", "lora.attn_modules=[q_proj,v_proj]"]
    ours = _ours(tmp_path, "lora", model, data, case, *lora, lr=LORA_LR)
    # TRL starts from our adapters (A as init_adapters draws it, B zero), its reference the adapters switched off.
    start_adapter(model, tmp_path / "start", SEED)
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    theirs = _trl(tmp_path, PeftModel.from_pretrained(base, tmp_path / "start", is_trainable=True), model, case,
                  lr=LORA_LR)
    _same(ours, theirs, KEYS + ("kl",))
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_same_completions_and_numbers_on_two_and_four_processes(setup, tmp_path):
    """Sampled for real (no test completions): each completion seeded by its prompt and its place in the group, so
    two and four FSDP2 processes sample and score what one process does, step for step."""
    model, data = setup
    common = [f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}", f"batch_size={BATCH}",
              f"num_generations={GROUP}", "max_completion_length=5", "max_seq_len=32", "max_steps=3", "epochs=3",
              "optimizer.lr=3e-2", "optimizer.warmup_steps=0", "dtype=fp32", "beta=0.04", "num_iterations=2",
              "temperature=0.9", "top_p=0.95", "top_k=50", "rewards=[tests.grpo_helpers.length_reward]",
              "logger=stdout", EPS]
    runs = {}
    # Layers resharded after each forward: two processes gather each at every decode step, four gather it once for
    # the round (train/parallel.gathered).
    gathers = {"cpu": [], "cpu-2": ["plan.reshard_after_forward=true", "plan.gather_for_generation=false"],
               "cpu-4": ["plan.reshard_after_forward=true", "plan.gather_for_generation=true"]}
    for flavor in ("cpu", "cpu-2", "cpu-4"):
        out = tmp_path / flavor
        r = run_recipe(*common, f"flavor={flavor}", "plan.replicate=false", *gathers[flavor], f"output_dir={out}",
                       module="recipes.grpo")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[flavor] = metrics(out)
    assert plan_of(tmp_path / "cpu-2")["sharded"] and plan_of(tmp_path / "cpu-2")["data_parallel"] == 2
    assert not plan_of(tmp_path / "cpu-2")["gather_for_generation"] and plan_of(tmp_path / "cpu-4")["gather_for_generation"]
    assert plan_of(tmp_path / "cpu-2")["reshard_after_forward"] and plan_of(tmp_path / "cpu-4")["reshard_after_forward"]
    for flavor, rows in runs.items():  # the KV cache the planner priced is the one each process held
        assert rows[0]["generation/kv_cache_bytes"] == plan_of(tmp_path / flavor)["predicted_kv_cache_bytes"] > 0
    assert plan_of(tmp_path / "cpu-4")["sharded"] and plan_of(tmp_path / "cpu-4")["data_parallel"] == 4
    for other in ("cpu-2", "cpu-4"):
        for one, two in zip(runs["cpu"], runs[other], strict=True):
            for key in ("completions/mean_length", "completions/clipped_ratio", "reward", "reward_std"):
                assert one[key] == two[key], (other, one["step"], key, one[key], two[key])
            for key in ("loss", "grad_norm", "kl", "entropy"):
                assert abs(one[key] - two[key]) <= 1e-4 * abs(one[key]) + 1e-6, (other, one["step"], key, one[key],
                                                                                 two[key])
    assert len({row["completions/mean_length"] for row in runs["cpu"]}) > 1 or runs["cpu"][0]["reward_std"] > 0


@pytest.mark.slow
def test_a_run_resumed_mid_round_on_another_flavor_trains_on_what_it_sampled(setup, tmp_path):
    """num_iterations 2: the checkpoint of step 1 holds the round's completions (every rank's); resumed on two
    processes, steps 2-4 are the uninterrupted run's (step 2 trains on step 1's completions again, step 3 samples
    anew, seeded by its prompts)."""
    model, data = setup
    common = [f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}", f"batch_size={BATCH}",
              f"num_generations={GROUP}", "max_completion_length=5", "max_seq_len=32", "max_steps=4", "epochs=4",
              "optimizer.lr=3e-2", "optimizer.warmup_steps=0", "dtype=fp32", "beta=0.04", "num_iterations=2",
              "rewards=[tests.grpo_helpers.length_reward]", "logger=stdout", "checkpoint_every=1", "checkpoint_keep=4"]
    whole = tmp_path / "whole"
    r = run_recipe(*common, f"output_dir={whole}", module="recipes.grpo")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = tmp_path / "resumed"
    # A fresh `python -m recipes.grpo` (not forked from tests/zygote.py, which imported every recipe first).
    r = run_recipe(*common, "flavor=cpu-2", "plan.replicate=false", f"resume={whole / 'checkpoints' / 'step-000001'}",
                   f"output_dir={resumed}", module="recipes.grpo", isolated=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    before, after = metrics(whole), metrics(resumed)
    assert [row["step"] for row in after] == [2, 3, 4]
    for one, two in zip(before[1:], after, strict=True):
        assert one["reward"] == two["reward"] and one["completions/mean_length"] == two["completions/mean_length"]
        assert one["num_tokens"] == two["num_tokens"]  # counted from step 1's round, which the checkpoint carries
        for key in ("loss", "grad_norm", "kl"):
            assert abs(one[key] - two[key]) <= 1e-4 * abs(one[key]) + 1e-6, (one["step"], key, one[key], two[key])


def test_what_cannot_run_is_refused_by_name(setup, tmp_path):
    model, data = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "hi"}) + "\n")
    common = [f"model.checkpoint_dir={model}", "dataset=prompt", "max_steps=1", "logger=stdout", "max_seq_len=32",
              "max_completion_length=4"]
    for case, (args, words) in enumerate([((f"dataset.path={data}", "batch_size=6", "num_generations=4"),
                         "batch_size=6 (completions a step) is not a multiple of num_generations=4"),
                        ((f"dataset.path={data}", "num_generations=1", "batch_size=4"), "num_generations=1"),
                        ((f"dataset.path={bad}", "batch_size=8", "num_generations=4"), "no 'prompt' column"),
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4", "rewards=[nowhere.fn]"),
                         "cannot import 'nowhere'"),
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4", "loss_type=ppo"), "loss_type"),
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4", "temperature=0"),
                         "temperature=0.0 must be above 0"),
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4",
                          "rewards=[tests.grpo_helpers.broken_reward]"), "reward function broken_reward on the batch "
                                                                        "starting with prompt"),
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4",
                          "rewards=[tests.grpo_helpers.raising_reward]"), "raised KeyError: 'answer'"),
                        # One fp32 process holds a plain module: nothing to gather.
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4", "dtype=fp32",
                          "plan.gather_for_generation=true"), "hold a plain module (one process, or replicas)"),
                        # A cut its step does not make is refused, not dropped.
                        ((f"dataset.path={data}", "batch_size=8", "num_generations=4", "flavor=cpu-2",
                          "plan.pipeline_stages=2"), "plan.pipeline_stages=2: recipes.grpo runs each sample's "
                                                     "sequences whole")]):
        r = run_recipe(*common, *args, f"output_dir={tmp_path / str(case)}", module="recipes.grpo")
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (words, r.stderr[-2000:])
    # How recipes.grpo samples is no option of a recipe that samples nothing.
    r = run_recipe("max_steps=1", "plan.gather_for_generation=false", f"output_dir={tmp_path / 'sft'}")
    assert r.returncode == 2 and "plan.gather_for_generation: how recipes.grpo samples" in r.stderr, r.stderr


def test_the_planner_keeps_the_weights_gathered_for_sampling_where_they_fit():
    """Layers resharded after their forward (to fit training) would be gathered again at every decode step on GPUs
    (Llama-3-8B's 15 GiB a token generated on 8 A100s): where the whole model fits beside the KV cache it is gathered
    once for the round, which the planner predicts faster; where it does not (70B), each layer is gathered at every
    step, as FSDP2 does."""
    from moai_recipes.inputs import read_inputs
    from moai_recipes.planner.search import choose_plan
    from tests.helpers import setup as compose

    runs = {}
    for model in ("llama3_8b", "llama3_70b"):
        cfg, _, flavor = compose(f"model={model}", "flavor=xlarge", "flavor.device=a100", "flavor.memory_gb=640", "batch_size=64",
                                 "max_seq_len=1024", "max_completion_length=512", "method=lora", recipe="grpo")
        work = read_inputs(cfg, flavor, dry=True, output=False).workload
        forced = {"tensor_parallel": 1, "pipeline_stages": 1, "reshard_after_forward": True}
        choice = choose_plan(work, flavor, forced=forced)
        each = choose_plan(work, flavor, forced={**forced, "gather_for_generation": False})
        runs[model] = choice, each
    gathered, each = runs["llama3_8b"]
    assert gathered.chosen.plan.gather_for_generation and gathered.chosen.plan.sharded
    # Each decode step's gather: 8B's bf16 weights, 7/8 of them over 300 GB/s, 512 steps a round.
    saved = each.chosen.time.terms["rollout"] - gathered.chosen.time.terms["rollout"]
    assert 512 * 16e9 * 7 / 8 / 300e9 * 0.9 < saved < 512 * 16e9 * 7 / 8 / 300e9 * 1.2, saved
    big, _ = runs["llama3_70b"]
    assert big.chosen.plan.sharded and not big.chosen.plan.gather_for_generation


@pytest.mark.slow
def test_qlora_grpo_runs_the_same_on_one_process_and_two(setup, tmp_path):
    """QLoRA: the adapters on an NF4 base (a checkpoint whose weights hold whole NF4 blocks), sampled and trained on
    one process and on two FSDP2 shards: the same numbers, and a PEFT adapter written."""
    _, data = setup
    model = make_hf_checkpoint(tmp_path / "qlora-model", "llama", hidden=256, num_layers=2, intermediate=512)
    qlora = ["method=lora", "lora.quantize_base=true", "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]",
             "lora.apply_to_mlp=true", "beta=0.04"]
    runs = {}
    for flavor in ("cpu", "cpu-2"):
        runs[flavor] = _ours(tmp_path, f"qlora-{flavor}", model, data, dict(loss_type="dapo"), *qlora,
                             f"flavor={flavor}", "plan.replicate=false", lr=LORA_LR)
    for one, two in zip(runs["cpu"], runs["cpu-2"], strict=True):
        for key in ("loss", "grad_norm", "kl", "reward"):
            assert abs(one[key] - two[key]) <= 1e-4 * abs(one[key]) + 1e-6, (one["step"], key, one[key], two[key])
    assert (tmp_path / "qlora-cpu-2" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_conversational_prompts_equal_trl_with_the_chat_template_applied(setup, chats, tmp_path):
    import transformers

    model, _ = setup
    case = dict(loss_type="grpo", beta=0.04, num_iterations=1)
    ours = _ours(tmp_path, "chat", model, chats, case)
    theirs = _trl(tmp_path, transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), model, case,
                  chat=True)
    _same(ours, theirs, KEYS + ("kl",))


SAMPLED = {  # TRL's names -> what each changes of the first token's distribution
    "temperature 0.7": dict(temperature=0.7, top_p=1.0, top_k=0),
    "top_k 12": dict(temperature=1.0, top_p=1.0, top_k=12),
    "temperature 1.3, top_p 0.8": dict(temperature=1.3, top_p=0.8, top_k=0),
}


@pytest.mark.parametrize("name", SAMPLED)
def test_the_sampler_draws_as_transformers_generate_draws(tmp_path, name):
    """4,000 completions of one token from one prompt, drawn by recipes.grpo's sampler and by transformers'
    `generate` (do_sample, the same temperature, top-k and top-p), against the exact distribution of transformers'
    own logits processors on the model's logits: both pass a chi-square test at p > 1e-4 (cells of fewer than 5
    expected draws pooled), neither draws a token the processors rule out, and the exact distribution of a
    temperature 30% off is rejected (p < 1e-6: the test can tell a wrong setting). The checkpoint's output weights
    are scaled by 10 so that its logits spread (a random tiny model's are nearly flat, and any temperature would pass)."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file
    from scipy.stats import chi2
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan
    from moai_recipes.train.rollouts import Sampler, SamplingSettings
    from tests.helpers import model_of, setup as setup_of

    folder = make_hf_checkpoint(tmp_path / "hf", "llama")
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] *= 10.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    s, n, prompt = SAMPLED[name], 4000, [5, 17, 42, 9]

    def exact(temperature: float) -> torch.Tensor:
        processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                         + ([TopKLogitsWarper(s["top_k"])] if s["top_k"] else [])
                                         + ([TopPLogitsWarper(s["top_p"])] if s["top_p"] < 1 else []))
        ids = torch.tensor([prompt])
        return torch.softmax(processors(ids, hf(ids).logits[:, -1].double()), dim=-1)[0]

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = exact(s["temperature"])
        wrong = exact(s["temperature"] * 1.3)
        torch.manual_seed(0)
        theirs = hf.generate(torch.tensor([prompt] * n), attention_mask=torch.ones(n, len(prompt), dtype=torch.long),
                             do_sample=True, max_new_tokens=1, min_new_tokens=1, pad_token_id=0, **s)[:, -1]
    _, spec, flavor = setup_of("flavor=cpu", f"model.checkpoint_dir={folder}")
    plan = replace(choose_plan(Workload(spec=spec, batch_size=8, seq_len=32), flavor).chosen.plan, generation_batch=n)
    sampler = Sampler(SamplingSettings(**s, max_completion_length=1), stop_ids=(), pad_id=0, plan=plan,
                      device=torch.device("cpu"), max_length=32)
    ours = torch.tensor([c[0] for c in sampler.complete(model_of(folder)[0], [prompt] * n, seeds=list(range(n)))
                         .completions])

    def p_value(drawn: torch.Tensor, probs: torch.Tensor) -> float:
        counts = torch.bincount(drawn, minlength=probs.numel()).double()
        want = probs * n
        big = want >= 5
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        cells = torch.cat([want[big], want[~big].sum()[None]])
        keep = cells > 0
        stat = float(((observed[keep] - cells[keep]) ** 2 / cells[keep]).sum())
        return float(chi2.sf(stat, int(keep.sum()) - 1))

    for who, drawn in (("ours", ours), ("transformers", theirs)):
        assert bool((expected[drawn] > 0).all()), (who, "drew a token the processors rule out")
        assert p_value(drawn, expected) > 1e-4, (who, p_value(drawn, expected))
    assert p_value(ours, wrong) < 1e-6, p_value(ours, wrong)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_decode_step_waits_on_the_device_once(tmp_path, family):
    """recipes.grpo's sampler copies the drawn tokens to the host once a chunk, and waits once a decode step (whether
    every row is done): counted as PyTorch's own reads of a device scalar (`aten._local_scalar_dense`, what `int()`,
    `bool()` and `.item()` of a tensor run), 8 rows x 6 tokens, on our layers (torchtune's KV cache, whose update read
    its position back once a layer) and on transformers' modules (Gemma 3: whether the prompts are padded, read once).
    (It read two per row and token, 96 here, each a stall of the GPU's queue, and one a layer.) The completions are
    those drawn, each cut after its first stop token."""
    from dataclasses import replace

    from torch.utils._python_dispatch import TorchDispatchMode

    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan
    from moai_recipes.train.rollouts import Sampler, SamplingSettings
    from tests.helpers import model_of, setup as setup_of

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    from tests.architectures import make_checkpoint

    folder = (make_hf_checkpoint(tmp_path / "hf", "llama") if family == "llama" else
              make_checkpoint(tmp_path / "hf", family))
    _, spec, flavor = setup_of("flavor=cpu", f"model.checkpoint_dir={folder}")
    plan = replace(choose_plan(Workload(spec=spec, batch_size=8, seq_len=32), flavor).chosen.plan, generation_batch=8)
    model = model_of(folder)[0]
    common = dict(pad_id=0, plan=plan, device=torch.device("cpu"), max_length=32)
    free = Sampler(SamplingSettings(max_completion_length=6), stop_ids=(), **common)
    with Reads():
        drawn = free.complete(model, [[5, 17, 42]] * 8, seeds=list(range(8))).completions
    assert [len(c) for c in drawn] == [6] * 8
    assert Reads.count <= 6 + 2, Reads.count  # a decode step's "all done?" (the last step asks nothing)
    # With a stop token: each completion as drawn, up to and with its first stop.
    stop = drawn[0][2]
    stopped = Sampler(SamplingSettings(max_completion_length=6), stop_ids=(stop,), **common).complete(
        model, [[5, 17, 42]] * 8, seeds=list(range(8))).completions
    for whole, cut in zip(drawn, stopped):
        assert cut == (whole[:whole.index(stop) + 1] if stop in whole else whole), (whole, cut)


def test_a_mixture_of_experts_model_adds_each_completions_balancing_loss_on_any_flavor(tmp_path):
    """recipes.grpo on Qwen3-MoE adds router_aux_loss_coef x the completions' mean balancing loss, each completion's
    as recipes.full_finetune counts a sample's: one process and two (FSDP2) sample the same completions and log the
    same losses, aux_loss and expert_load, and the balancing loss (weighed 1 here) is in the step's gradient (its norm
    against a run without it)."""
    model = make_hf_checkpoint(tmp_path / "moe", "qwen3_moe", num_layers=2)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in zip(PROMPTS, TARGETS)))
    # lr 3e-3 and EPS: at 3e-2 the third step's norm differed by 1e-3 between one process and two with AVX2 kernels,
    # at 3e-3 by 1.2e-4 (the policy loss is 0 there, all rewards equal, and the norm is the balancing loss's alone).
    common = [f"model.checkpoint_dir={model}", "dataset=prompt", f"dataset.path={data}", f"batch_size={BATCH}",
              f"num_generations={GROUP}", "max_completion_length=5", "max_seq_len=32", "max_steps=3", "epochs=3",
              "optimizer.lr=3e-3", "optimizer.warmup_steps=0", "dtype=fp32", "beta=0.0",
              "rewards=[tests.grpo_helpers.length_reward]", "logger=stdout", EPS]
    runs = {}
    for name, extra in (("one", ["flavor=cpu", "model.router_aux_loss_coef=1.0"]),
                        ("two", ["flavor=cpu-2", "plan.replicate=false", "model.router_aux_loss_coef=1.0"]),
                        ("none", ["flavor=cpu", "model.router_aux_loss_coef=0"])):
        r = run_recipe(*common, *extra, f"output_dir={tmp_path / name}", module="recipes.grpo")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[name] = metrics(tmp_path / name)
    assert plan_of(tmp_path / "two")["sharded"]
    for a, b in zip(runs["one"], runs["two"], strict=True):
        for key in ("loss", "aux_loss", "expert_load", "reward", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]) + 1e-6, (a["step"], key, a[key], b[key])
    assert all(r["aux_loss"] > 0 for r in runs["one"]) and not any("aux_loss" in r for r in runs["none"])
    # Its gradient is in the step's (the policy loss is the same at step 1, before any update).
    first, without = runs["one"][0], runs["none"][0]
    assert first["loss"] == pytest.approx(without["loss"], rel=1e-6)
    assert abs(first["grad_norm"] - without["grad_norm"]) > 1e-2 * without["grad_norm"], (first, without)
