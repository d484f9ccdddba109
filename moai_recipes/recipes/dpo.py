"""Preference tuning: DPO (and IPO, SLiC's hinge, SimPO, ORPO) of a model, full or LoRA, on any flavor.

    python -m recipes.dpo                                                    # tiny model, embedded pairs, CPU
    python -m recipes.dpo dataset=preference dataset.path=pairs.jsonl batch_size=32   # prompt, chosen, rejected
    python -m recipes.dpo method=lora model=llama3_8b model.checkpoint_dir=DIR flavor=cpu-2 reference=cached

Reads top to bottom as the fine-tuning recipes do: config -> inputs (the pairs, tokenised as TRL tokenises them)
-> plan -> build on meta (LoRA: adapters on the frozen base) -> shard -> weights -> the reference (a frozen copy,
the adapters switched off, or its log-probabilities cached in a first pass) -> optimizer -> the train loop with
the preference objective (train/preference_step.py) -> save: model/ (full), adapter/ and model/ merged (LoRA).
The loss, the rewards and the gradients of a step are those of its global batch of pairs, on any flavor.
"""

from dataclasses import replace

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from moai_recipes.checkpoint.steps import TrainState
from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor
from moai_recipes.inputs import read_inputs
from moai_recipes.models.preference_loss import PreferenceLoss
from moai_recipes.planner.search import choose_reference
from moai_recipes.train.answers import Answers
from moai_recipes.train.loop import LoopSettings, train_loop
from moai_recipes.train.metrics_log import MetricsLog
from moai_recipes.train.mixed_precision import in_compute_dtype
from moai_recipes.train.optim import build_optimizer, build_scheduler
from moai_recipes.train.out_of_memory import forced_plan
from moai_recipes.train.plan_accuracy import report_accuracy
from moai_recipes.train.policy import build_policy, save_policy, whole_on_each_device
from moai_recipes.train.preference_step import PreferenceObjective, Reference, cache_reference
from moai_recipes.train.process import prepare_process
from moai_recipes.train.world import World, decided_by_main


def train(cfg: DictConfig, flavor: Flavor, world: World) -> None:
    torch.manual_seed(cfg.seed)
    say = print if world.is_main else (lambda *a, **k: None)
    loss = PreferenceLoss(type=str(cfg.loss.type), beta=cfg.loss.beta, label_smoothing=cfg.loss.label_smoothing,
                          simpo_gamma=cfg.loss.simpo_gamma, orpo_alpha=cfg.loss.orpo_alpha)

    # 1. What the run reads: its folder, the checkpoint, tokenizer, LoRA settings, the pairs.
    inputs = read_inputs(cfg, flavor, restarting=world.restarts > 0)
    lora = inputs.lora if cfg.method == "lora" else None

    # 2. The plan: a pair's two sequences run together, in one piece per rank (no pipeline, tensor or context cut
    #    yet).
    #    Packed (a micro-batch's sequences end to end in one row, each attending to itself) where that is faster.
    #    The reference is part of the plan: a copy (memory; a forward each step) or a first pass (time before step 1).
    forced = whole_on_each_device(forced_plan(cfg.plan, inputs.out_of_memory_hint), "recipes.dpo")
    choice, reference = decided_by_main(world, lambda: choose_reference(
        inputs.workload, flavor, forced=forced, modes=_reference_modes(cfg, loss)))
    work = replace(inputs.workload, reference=reference)
    plan = choice.chosen.plan
    world = world.laid_out(plan)
    say(f"Flavor {flavor.describe()}; {world.world_size} process(es), backend {flavor.backend}")
    say("\n".join(inputs.describe(cfg)))
    say("\n".join(choice.report()))
    say(f"Configuration for parallelism is selected: {plan.describe()}")
    say(f"Preference loss {loss.type} (beta {loss.beta:g}"
        + (f", label smoothing {loss.label_smoothing:g}" if loss.label_smoothing else "") + "); reference: "
        + {"none": "none (reference-free)", "copy": "the base with the adapters off, each step" if lora else
           "a frozen copy in memory, each step", "cached": "log-probabilities cached in a first pass"}[reference])

    # 3. The policy, built on meta, sharded, its weights (LoRA: adapters on the frozen base).
    model = build_policy(inputs, plan, world, lora=lora, seed=cfg.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]

    # 4. The reference: a frozen copy, the adapters switched off, or log-probabilities cached before step 1.
    ref = Reference()
    if reference == "copy" and lora is None:
        ref.model = build_policy(inputs, plan, world, lora=None, seed=cfg.seed, frozen=True).eval()
    elif reference == "copy":
        ref.adapters_off = True
    elif reference == "cached":
        with in_compute_dtype(model, plan):
            ref.cached = cache_reference(model, inputs.data.train, micro_batch=plan.micro_batch_size, world=world,
                                         pad_id=inputs.tokenizer.pad_id, adapters_off=lora is not None)

    # 5. The optimizer over what trains, then the loop with the preference objective.
    optimizer = build_optimizer(trainable, cfg.optimizer, plan)
    state = TrainState(model, optimizer, build_scheduler(optimizer, cfg.optimizer, total_steps=inputs.total_steps))
    process = prepare_process(plan, work, flavor, world)
    log = MetricsLog.start(cfg, inputs, choice) if world.is_main else None
    answers = Answers.for_run(cfg, inputs.tokenizer, plan=plan, device=world.device, images=inputs.image_samples)
    answers.take_before(model)
    objective = PreferenceObjective(loss=loss, reference=ref, spec=inputs.spec)
    result = train_loop(state, inputs, choice, LoopSettings.from_config(cfg, process, objective), world, log)
    if log and result.measured:
        report_accuracy(result.choice, result.measured, work=work, model_name=inputs.model_name,
                        device_kind=flavor.device.kind, log=log)
    say("\n".join(answers.report_after(model)))

    # 6. Saved as the fine-tuning recipes save: model/ (full); adapter/ and, with save_merged, model/ (LoRA).
    if log:
        log.close()
    say(save_policy(model, inputs, cfg, world, lora=lora))
    dist.barrier()


def _reference_modes(cfg: DictConfig, loss: PreferenceLoss) -> tuple[str, ...]:
    """The ways of having the reference the planner weighs: the one the user forced, or both (auto)."""
    if not loss.uses_reference:
        if cfg.reference != "auto":
            raise UserError(f"loss.type={loss.type} has no reference model; leave reference=auto")
        return ("none",)
    return ("copy", "cached") if cfg.reference == "auto" else (str(cfg.reference),)
