"""recipes.dpo against TRL's DPOTrainer (trl from PyPI): on the same tiny checkpoint, the same preference rows (in
the same order) and the same hyper-parameters, each step's loss and rewards (chosen, rejected, accuracies,
margins) equal TRL's, full fine-tuning (conversational rows, the chat template applied) and LoRA (plain strings,
the reference the base with the adapters off); the same numbers on two and four processes, with the reference
cached in a first pass or run each step; and what cannot make a pair is refused by name.
Run: python -m pytest tests/test_dpo.py -q
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import FSDP, layout, make_hf_checkpoint, metrics, run_recipe, start_adapter

pytest.importorskip("trl")

PROMPTS = ["What color is the sky?", "Which animal barks?", "How many legs has a spider?", "What do bees make?",
           "Which is a planet?", "What is frozen water?", "Where do fish live?", "What is two plus two?"]
CHOSEN = [" Blue.", " A dog.", " Eight.", " Honey.", " Mars.", " Ice.", " In water.", " Four."]
REJECTED = [" Green, I think.", " The cat.", " Six legs.", " Milk.", " Paris is.", " Steam.", " Trees.", " Five!"]
STEPS, BATCH, LR, LORA_LR, SEED = 4, 4, 2e-3, 3e-2, 0
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _rows(conversational: bool) -> list[dict]:
    if conversational:
        turn = lambda role, text: [{"role": role, "content": text.strip()}]  # noqa: E731
        return [{"prompt": turn("user", p), "chosen": turn("assistant", c), "rejected": turn("assistant", r)}
                for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)]
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)]


def _ours(tmp_path: Path, name: str, model: Path, data: Path, *extra, lr: float = LR,
          isolated: bool | None = None) -> list[dict]:
    out = tmp_path / name
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.path={data}", f"batch_size={BATCH}",
                   "epochs=2", f"max_steps={STEPS}", f"optimizer.lr={lr}", "optimizer.warmup_steps=1", f"seed={SEED}",
                   "max_seq_len=128", "logger=stdout", f"output_dir={out}", *extra, module="recipes.dpo",
                   isolated=isolated)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return rows


def _order(n: int) -> list[int]:
    """The pairs in the order our steps take them (GlobalBatches, seeded): TRL reads them so, sequentially."""
    from moai_recipes.data.batches import GlobalBatches

    batches = GlobalBatches(num_samples=n, batch_size=BATCH, epochs=2, seed=SEED)
    return [i for step in range(STEPS) for i in batches.global_indices(step)]


def _trl(tmp_path: Path, model, rows: list[dict], tokenizer_dir: Path, *, lr: float = LR) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     max_steps=STEPS, learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0,
                     beta=0.1, loss_type=["sigmoid"], max_length=128, seed=SEED, train_sampling_strategy="sequential",
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                     gradient_checkpointing=False)
    ordered = [rows[i % len(rows)] for i in _order(len(rows))]
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(ordered),
                         processing_class=AutoTokenizer.from_pretrained(tokenizer_dir))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "rewards/chosen" in h]


def _same(ours: list[dict], theirs: list[dict], *, least_margin: float = 0.05, least_accuracy: float = 0.5) -> None:
    for mine, trl in zip(ours, theirs, strict=True):
        for key in KEYS:
            if key == "rewards/accuracies" and _all_margins_zero(mine, trl):
                continue
            # 1e-4 relative; rewards near zero are sums of ~40 log-probabilities times beta: fp32's 1e-6 absolute.
            assert abs(mine[key] - trl[key]) <= 1e-4 * abs(trl[key]) + 1e-6, (mine["step"], key, mine[key], trl[key])
    # It learned something: the chosen completions rewarded over the rejected ones.
    assert ours[-1]["rewards/margins"] > least_margin and ours[-1]["rewards/accuracies"] > least_accuracy


def _all_margins_zero(mine: dict, trl: dict) -> bool:
    """Whether a step's rewards are zero in exact arithmetic (its first, where the policy is the reference): each
    pair's margin is then 0 up to rounding, and which side of 0 it falls (the accuracy) is the rounding's, which
    differs between any two programs (seen: 0.25 against TRL's 0.0 on an AVX2-only CPU). The accuracy is compared on
    the steps where it is defined."""
    return all(abs(row[k]) <= 1e-6 for row in (mine, trl) for k in ("rewards/chosen", "rewards/rejected"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = make_hf_checkpoint(root / "model", "llama")
    files = {}
    for conversational in (False, True):
        path = root / f"pairs-{'chat' if conversational else 'plain'}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _rows(conversational)))
        files[conversational] = path
    return model, files


@pytest.mark.slow
def test_full_dpo_equals_trl_and_is_the_same_on_two_processes_with_the_reference_cached(setup, tmp_path):
    import transformers

    model, files = setup
    ours = _ours(tmp_path, "cpu", model, files[True], "reference=copy")
    theirs = _trl(tmp_path, transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                  _rows(True), model)
    _same(ours, theirs)
    # A fresh `python -m recipes.dpo` (not forked from tests/zygote.py, which imported every recipe first).
    two = _ours(tmp_path, "cpu-2", model, files[True], "flavor=cpu-2", *FSDP, "reference=cached", isolated=True)
    assert layout(tmp_path / "cpu-2") == "sharded"
    _same(two, theirs)
    config = json.loads((tmp_path / "cpu-2" / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_lora_dpo_equals_trl_with_the_adapters_off_as_reference_and_on_four_processes(setup, tmp_path):
    import transformers
    from peft import PeftModel

    model, files = setup
    lora = ["method=lora", "lora.rank=4", "lora.alpha=8", "lora.attn_modules=[q_proj,v_proj]"]
    ours = _ours(tmp_path, "cpu", model, files[False], *lora, "reference=copy", lr=LORA_LR)
    # TRL starts from our adapters (A as init_adapters draws it, B zero): a PeftModel with that adapter, whose
    # reference TRL takes as a frozen copy of it, which with B zero is the base.
    start_adapter(model, tmp_path / "start", SEED)
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    theirs = _trl(tmp_path, PeftModel.from_pretrained(base, tmp_path / "start", is_trainable=True), _rows(False), model,
                  lr=LORA_LR)
    _same(ours, theirs)
    # Four whole copies (the full test above runs FSDP2 shards): each rank's adapters' gradients summed once a step.
    four = _ours(tmp_path, "cpu-4", model, files[False], *lora, "flavor=cpu-4", "plan.replicate=true",
                 "plan.tensor_parallel=1", "plan.pipeline_stages=1", "reference=cached", lr=LORA_LR)
    assert layout(tmp_path / "cpu-4") == "replicated"
    _same(four, theirs)
    assert (tmp_path / "cpu-4" / "adapter" / "adapter_config.json").is_file()


def test_what_cannot_make_a_pair_is_refused_by_name(tmp_path):
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"prompt": "Hi", "chosen": " Hello.", "rejected": " Hello."}) + "\n")
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "Hi", "chosen": " Hello."}) + "\n")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "Hi", "chosen": " Hello.", "rejected": [{"role": "assistant",
                                                                                    "content": "Go."}]}) + "\n")
    for args, words in [((f"dataset.path={same}",), "same.jsonl:1: columns 'chosen' and 'rejected' hold the same"),
                        ((f"dataset.path={missing}",), "no 'rejected' column"),
                        ((f"dataset.path={mixed}",), "must all be strings or all be lists of messages"),
                        (("dataset=chat", f"dataset.path={same}"), "recipes.dpo trains on preference pairs"),
                        (("loss.type=simpo", "reference=copy"), "has no reference model"),
                        # A cut its step does not make is refused, not dropped (before anything is written).
                        (("flavor=cpu-2", "plan.tensor_parallel=2"), "plan.tensor_parallel=2: recipes.dpo runs each "
                                                                     "sample's sequences whole"),
                        (("plan.context_parallel_way=gather",), "Drop plan.context_parallel_way")]:
        r = run_recipe(*args, "max_steps=1", "logger=stdout", f"output_dir={tmp_path / 'out'}", module="recipes.dpo")
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (words, r.stderr)
        assert not (tmp_path / "out").exists()
    r = run_recipe("dataset=preference", f"dataset.path={same}", "max_steps=1", "logger=stdout",
                   f"output_dir={tmp_path / 'sft'}")
    assert r.returncode == 2 and "is what recipes.dpo trains on" in r.stderr, r.stderr


def test_the_losses_by_hand():
    from moai_recipes.models.preference_loss import PairScores, PreferenceLoss, pair_losses

    t = lambda x: torch.tensor([x])  # noqa: E731
    s = PairScores(chosen=t(-10.0), rejected=t(-14.0), chosen_tokens=t(4.0), rejected_tokens=t(7.0),
                   ref_chosen=t(-11.0), ref_rejected=t(-12.0))
    logsig = lambda x: -torch.nn.functional.softplus(-torch.tensor(x)).item()  # noqa: E731
    delta = (-10 + 11) - (-14 + 12)  # 3
    value, rewards = pair_losses(s, PreferenceLoss("sigmoid", beta=0.1, label_smoothing=0.2))
    assert value.item() == pytest.approx(-0.8 * logsig(0.3) - 0.2 * logsig(-0.3))
    assert rewards["chosen"].item() == pytest.approx(0.1) and rewards["margins"].item() == pytest.approx(0.3)
    value, _ = pair_losses(s, PreferenceLoss("ipo", beta=0.5))
    assert value.item() == pytest.approx((1 / 4 - (-2) / 7 - 1 / (2 * 0.5)) ** 2)
    value, _ = pair_losses(s, PreferenceLoss("hinge", beta=0.1))
    assert value.item() == pytest.approx(max(0.0, 1 - 0.1 * delta))
    value, rewards = pair_losses(s, PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5))
    assert value.item() == pytest.approx(-logsig(2.0 * (-10 / 4 - (-14 / 7) - 0.5 / 2.0)))
    assert rewards["chosen"].item() == pytest.approx(2.0 * -10 / 4)
    value, _ = pair_losses(s, PreferenceLoss("orpo", beta=0.1, orpo_alpha=1.0))
    pc, pr = torch.tensor(-2.5), torch.tensor(-2.0)
    log_odds = (pc - pr) - (torch.log1p(-pc.exp()) - torch.log1p(-pr.exp()))
    assert value.item() == pytest.approx(2.5 - 0.1 * logsig(log_odds.item()))


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_resumes_exactly(setup, tmp_path):
    """LoRA with the reference cached: the resumed run caches it again (the same numbers) and ends bit for bit as the
    uninterrupted one."""
    import signal

    from tests.helpers import start_forked, tensors

    model, files = setup
    common = [f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.path={files[False]}", "batch_size=4",
              "epochs=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "method=lora", "reference=cached",
              "checkpoint_every=2", "logger=stdout", "sample_max_new_tokens=0"]
    whole = tmp_path / "whole"
    assert run_recipe(*common, f"output_dir={whole}", module="recipes.dpo").returncode == 0
    out = tmp_path / "run"
    proc = start_forked(*common, f"output_dir={out}", module="recipes.dpo", env={"MOAI_FAULT_STEP_DELAY": "0.3"},
                        merged=True)
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, log
    stopped = len(metrics(out))
    r = run_recipe(*common, f"output_dir={out}", module="recipes.dpo")
    assert r.returncode == 0 and f"continuing at step {stopped + 1}" in r.stdout, r.stdout + r.stderr
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(whole)]
    assert [m["rewards/margins"] for m in metrics(out)] == [m["rewards/margins"] for m in metrics(whole)]
    ref, got = tensors(whole / "adapter"), tensors(out / "adapter")
    assert ref and ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_the_planner_prices_the_reference_and_picks_by_memory_and_time():
    """A full fine-tuning copy costs a second set of weights on each device and a forward each step; the first
    pass's cache costs that forward once per pair before step 1. Where the copy does not fit, the cache is chosen;
    the memory per device is not enough for the copy on a tight flavor."""
    from dataclasses import replace

    from moai_recipes.planner.memory import predict_memory
    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan, choose_reference
    from moai_recipes.planner.timing import predict_time
    from tests.helpers import setup

    _, spec, flavor = setup("model=llama3_8b", "flavor=xlarge")
    work = Workload(spec=spec, batch_size=64, seq_len=1024, lengths=(700,) * 640, steps=10)
    whole = {"pipeline_stages": 1, "tensor_parallel": 1, "packing": False}  # as recipes.dpo plans
    plan = choose_plan(work, flavor, forced=whole).chosen.plan
    base, copy, cached = (replace(work, reference=r) for r in ("none", "copy", "cached"))
    weights = spec.num_params() * 2 / plan.shards  # the frozen copy in the bf16 it computes in: no fp32 master
    extra = predict_memory(plan, copy, "gpu").params - predict_memory(plan, base, "gpu").params
    assert extra == pytest.approx(weights, rel=1e-6)
    assert predict_memory(plan, cached, "gpu").total == predict_memory(plan, base, "gpu").total
    t_base, t_copy, t_cached = (predict_time(plan, w, flavor.device) for w in (base, copy, cached))
    assert t_copy.total_s > t_base.total_s == t_cached.total_s and t_cached.once_s > t_base.once_s
    # A run of 10 steps over 640 pairs (one epoch of 10 steps): the first pass and the copies' forwards cost alike;
    # the cache holds no second model.
    choice, mode = choose_reference(work, flavor, forced=whole, modes=("copy", "cached"))
    assert mode == "cached" and choice.chosen.time.once_s > 0
    # Three epochs of the same pairs: the first pass is paid once, the copy's forward every step: the cache again.
    _, mode = choose_reference(replace(work, steps=30), flavor, forced=whole, modes=("copy", "cached"))
    assert mode == "cached"


def test_pairs_from_a_datasets_folder_with_a_column_map(setup, tmp_path):
    from datasets import Dataset

    model, _ = setup
    folder = tmp_path / "pairs"
    Dataset.from_list([{"question": p, "good": c, "bad": r} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED)]
                      ).save_to_disk(str(folder))
    out = tmp_path / "run"
    r = run_recipe(f"model.checkpoint_dir={model}", "dataset=preference", f"dataset.source={folder}",
                   "dataset.column_map.prompt=question", "dataset.column_map.chosen=good", "dataset.column_map.rejected=bad", "batch_size=4", "max_steps=2",
                   "logger=stdout", f"output_dir={out}", module="recipes.dpo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 samples" in r.stdout and len(metrics(out)) == 2 and (out / "model" / "config.json").is_file()


def test_a_pairs_sequences_packed_in_one_row_give_the_padded_rows_numbers(setup, tmp_path):
    from tests.helpers import plan_of

    model, files = setup
    padded = _ours(tmp_path, "padded", model, files[True], "plan.packing=false", "reference=copy")
    packed = _ours(tmp_path, "packed", model, files[True], "plan.packing=true", "reference=copy")
    assert plan_of(tmp_path / "packed")["packing"] and not plan_of(tmp_path / "padded")["packing"]
    for a, b in zip(padded, packed, strict=True):
        for key in KEYS:
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]) + 1e-6, (a["step"], key, a[key], b[key])


def test_qlora_dpo_learns_with_the_nf4_base_as_reference(tmp_path):
    model = make_hf_checkpoint(tmp_path / "model", "llama", hidden=256, intermediate=512, kv_heads=4)  # whole NF4 blocks
    out = tmp_path / "run"
    r = run_recipe(f"model.checkpoint_dir={model}", "method=lora", "lora.quantize_base=true", "reference=copy",
                   "batch_size=4", "max_steps=4", "optimizer.lr=1e-2", "optimizer.warmup_steps=0", "logger=stdout",
                   f"output_dir={out}", module="recipes.dpo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the base with the adapters off" in r.stdout and (out / "adapter" / "adapter_config.json").is_file()
    rows = metrics(out)
    assert rows[0]["rewards/margins"] == 0 and rows[-1]["rewards/margins"] > 0.5 and rows[-1]["rewards/accuracies"] == 1


def test_a_pairs_rows_padded_to_the_plans_sizes_give_the_same_log_probabilities():
    """The CPU in bf16 pads a row to one of a few sizes (Plan.padded_row): a padded-rows batch grows its width, a
    packed row gets a padding document; the completions' log-probabilities and token counts stay the unpadded ones."""
    from dataclasses import replace

    from moai_recipes.data.preferences import collate_pairs, completion_logps
    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.planner.plan import Workload
    from moai_recipes.planner.search import choose_plan
    from tests.helpers import setup as config

    _, spec, cpu = config("model=tiny", "flavor=cpu")
    plan = choose_plan(Workload(spec=spec, batch_size=4, seq_len=512, dtype="bf16"), cpu).chosen.plan
    assert plan.row_sizes == 8
    torch.manual_seed(0)
    pairs = [{"prompt": torch.randint(1, spec.vocab_size, (n,)).tolist(), "chosen": [5, 6, 7][:k], "rejected": [8, 9]}
             for n, k in ((20, 3), (47, 1))]
    model = build_model(spec, max_seq_len=512)
    init_buffers(model, device="cpu")
    for packed in (False, True):
        bare = collate_pairs(pairs, pad_id=0, packed=packed)
        padded = collate_pairs(pairs, pad_id=0, packed=packed, padded_row=replace(plan, packing=packed).padded_row)
        assert padded["tokens"].shape[1] == plan.padded_row(bare["tokens"].shape[1]) > bare["tokens"].shape[1]
        got, want = ([completion_logps(model(b["tokens"], **({"mask": b["documents"],
                                                                "input_pos": b["documents"].positions("cpu")}
                                                               if packed else {})), b) for b in (padded, bare)])
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1]) and len(got[0]) == 4


def test_a_mixture_of_experts_model_adds_each_sequences_balancing_loss_on_any_flavor(tmp_path):
    """recipes.dpo on Qwen3-MoE adds router_aux_loss_coef x the sequences' mean balancing loss, each sequence's as
    recipes.full_finetune counts a sample's: one process and two (FSDP2) log the same losses, aux_loss and
    expert_load, and the balancing loss (weighed 1 here, so that its gradient matters) changes the training against
    a run without it."""
    from tests.helpers import make_hf_checkpoint

    model = make_hf_checkpoint(tmp_path / "moe", "qwen3_moe", num_layers=2)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(conversational=False)))
    runs = {}
    for name, extra in (("one", ["flavor=cpu"]), ("two", ["flavor=cpu-2", *FSDP]),
                        ("none", ["flavor=cpu", "model.router_aux_loss_coef=0"])):
        coef = [] if name == "none" else ["model.router_aux_loss_coef=1.0"]
        runs[name] = _ours(tmp_path, name, model, data, *extra, *coef)
    assert layout(tmp_path / "two") == "sharded"
    for a, b in zip(runs["one"], runs["two"], strict=True):
        for key in ("loss", "aux_loss", "expert_load", "rewards/margins"):
            assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]) + 1e-6, (a["step"], key, a[key], b[key])
    assert all(r["aux_loss"] > 0 for r in runs["one"]) and not any("aux_loss" in r for r in runs["none"])
    assert abs(runs["one"][-1]["loss"] - runs["none"][-1]["loss"]) > 1e-4, (runs["one"], runs["none"])
