"""Online RL with rewards you compute: GRPO (and Dr. GRPO, DAPO by loss_type) of a model, full or LoRA, on any flavor.

    python -m recipes.grpo                                       # tiny model, embedded sums, exact-answer reward, CPU
    python -m recipes.grpo dataset=prompt dataset.path=prompts.jsonl rewards=[mypkg.rewards.exact] method=lora
    python -m recipes.grpo model=smollm2_135m method=lora beta=0.04 loss_type=grpo num_iterations=2 flavor=cpu-2

Reads top to bottom as recipes.dpo does: config -> inputs (the prompts, tokenised as TRL tokenises them) -> the reward
functions -> plan -> the policy built on meta (LoRA: adapters on the frozen base), sharded, its weights -> the
reference (beta > 0: the adapters switched off, or a frozen copy) -> optimizer -> the train loop with the GRPO
objective (train/grpo_step.py: generate, score, train) -> save: model/ (full), adapter/ and model/ merged (LoRA).
A step's completions, rewards, loss and gradients are those of its global batch, on any flavor; settings carry TRL's
GRPOConfig names, so a TRL config reads across. An image-text model's prompts hold pictures (docs/vision.md): sampled
and trained with them, the image token never drawn.
"""

import importlib
from dataclasses import replace

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from moai_recipes import env
from moai_recipes.checkpoint.steps import TrainState
from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor
from moai_recipes.inputs import read_inputs
from moai_recipes.models.grpo_loss import GRPOLoss
from moai_recipes.planner.search import choose_plan
from moai_recipes.train.answers import Answers
from moai_recipes.train.grpo_step import GRPOObjective
from moai_recipes.train.loop import LoopSettings, train_loop
from moai_recipes.train.metrics_log import MetricsLog
from moai_recipes.train.optim import build_optimizer, build_scheduler
from moai_recipes.train.out_of_memory import forced_plan
from moai_recipes.train.plan_accuracy import report_accuracy
from moai_recipes.train.policy import build_policy, save_policy, whole_on_each_device
from moai_recipes.train.preference_step import Reference
from moai_recipes.train.process import prepare_process
from moai_recipes.train.rewards import Rewards
from moai_recipes.train.rollouts import SamplingSettings
from moai_recipes.train.world import World, decided_by_main


def train(cfg: DictConfig, flavor: Flavor, world: World) -> None:
    torch.manual_seed(cfg.seed)
    say = print if world.is_main else (lambda *a, **k: None)
    loss = GRPOLoss(loss_type=str(cfg.loss_type), beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    delta=cfg.delta, max_completion_length=cfg.max_completion_length,
                    use_bias_correction_kl=cfg.use_bias_correction_kl)
    sampling = SamplingSettings(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                max_completion_length=cfg.max_completion_length)
    _check(cfg)

    # 1. What the run reads: its folder, the checkpoint, tokenizer, LoRA settings, the prompts; the rewards.
    inputs = read_inputs(cfg, flavor, restarting=world.restarts > 0)
    lora = inputs.lora if cfg.method == "lora" else None
    rewards = Rewards.named(list(cfg.rewards), list(cfg.reward_weights) if cfg.reward_weights is not None else None)

    # 2. The plan: a completion in one piece per rank (no pipeline, tensor or context cut yet); full fine-tuning with a
    #    KL term holds a frozen copy of the model (LoRA: the base with the adapters off costs nothing).
    forced = whole_on_each_device(forced_plan(cfg.plan, inputs.out_of_memory_hint), "recipes.grpo")
    work = replace(inputs.workload, reference="copy" if loss.beta and lora is None else "none")
    choice = decided_by_main(world, lambda: choose_plan(work, flavor, forced=forced))
    plan = choice.chosen.plan
    world = world.laid_out(plan)
    say(f"Flavor {flavor.describe()}; {world.world_size} process(es), backend {flavor.backend}")
    say("\n".join(inputs.describe(cfg)))
    say("\n".join(choice.report()))
    say(f"Configuration for parallelism is selected: {plan.describe()}")
    say(f"GRPO: {cfg.batch_size // cfg.num_generations} prompts x {cfg.num_generations} completions a step, each "
        f"generation trained on {cfg.num_iterations} time(s); loss {loss.loss_type}, beta {loss.beta:g}, epsilon "
        f"{loss.epsilon:g}/{loss.high:g}; rewards {', '.join(rewards.names)}")

    # 3. The policy, built on meta, sharded, its weights (LoRA: adapters on the frozen base).
    model = build_policy(inputs, plan, world, lora=lora, seed=cfg.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]

    # 4. The reference, for the KL term: the adapters switched off, or a frozen copy.
    reference = Reference()
    if loss.beta and lora is not None:
        reference.adapters_off = True
    elif loss.beta:
        reference.model = build_policy(inputs, plan, world, lora=None, seed=cfg.seed, frozen=True).eval()

    # 5. The optimizer over what trains, then the loop with the GRPO objective (its kept completions are part of a
    #    step checkpoint: a run resumed mid-round trains on what it sampled).
    objective = GRPOObjective(loss=loss, sampling=sampling, rewards=rewards, num_generations=cfg.num_generations,
                              num_iterations=cfg.num_iterations, scale_rewards=str(cfg.scale_rewards),
                              mask_truncated_completions=cfg.mask_truncated_completions, seed=cfg.seed,
                              tokenizer=inputs.tokenizer, reference=reference, max_length=cfg.max_seq_len,
                              completions_hook=_test_completions(), spec=inputs.spec,
                              never=_image_tokens(inputs.image_samples))
    optimizer = build_optimizer(trainable, cfg.optimizer, plan)
    state = TrainState(model, optimizer, build_scheduler(optimizer, cfg.optimizer, total_steps=inputs.total_steps),
                       objective=objective)
    process = prepare_process(plan, work, flavor, world)
    log = MetricsLog.start(cfg, inputs, choice) if world.is_main else None
    answers = Answers.for_run(cfg, inputs.tokenizer, plan=plan, device=world.device, images=inputs.image_samples)
    answers.take_before(model)
    result = train_loop(state, inputs, choice, LoopSettings.from_config(cfg, process, objective), world, log)
    if log and result.measured:
        report_accuracy(result.choice, result.measured, work=work, model_name=inputs.model_name,
                        device_kind=flavor.device.kind, log=log)
    # A round's sampling and scoring against planner/rollouts.py's (which spreads it over the round's steps); on the
    # CPU the first two steps follow their tensors (train/peak_memory.py), slower: the later rounds, where there are.
    say("\n".join(answers.report_after(model)))
    rounds = [s for step, s in objective.sampled_s if step > 2] or [s for _, s in objective.sampled_s]
    if rounds:
        predicted, measured = result.choice.chosen.time.terms["rollout"] * cfg.num_iterations, sorted(rounds)[len(rounds) // 2]
        say(f"Sampling a round: predicted {predicted:.3g} s, measured {measured:.3g} s (the median of {len(rounds)} "
            f"round(s), {100 * (predicted / measured - 1):+.1f}%); KV cache predicted {result.choice.chosen.kv_cache:,} "
            "bytes")

    # 6. Saved as the fine-tuning recipes save: model/ (full); adapter/ and, with save_merged, model/ (LoRA).
    if log:
        log.close()
    say(save_policy(model, inputs, cfg, world, lora=lora))
    dist.barrier()


def _test_completions():
    """MOAI_TEST_COMPLETIONS (env.py): tests give TRL and this recipe the same completions (tests/test_grpo.py)."""
    path = env.test_completions()
    if not path:
        return None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _image_tokens(images) -> tuple[int, ...]:
    """An image-text model's image token (data/images.ImageSamples): never sampled, as TRL suppresses it."""
    return (images.image_token_id,) if images is not None and images.image_token_id is not None else ()


def _check(cfg: DictConfig) -> None:
    """The sampling settings a run cannot start with, refused by name before anything is read."""
    if not cfg.temperature > 0:
        raise UserError(f"temperature={cfg.temperature} must be above 0: the log-probabilities trained on are "
                        "divided by it (as TRL's)")
    if not 0 < cfg.top_p <= 1 or cfg.top_k < 0:
        raise UserError(f"top_p={cfg.top_p} must be in (0, 1] and top_k={cfg.top_k} >= 0 (0: no top-k)")
    if cfg.max_completion_length < 1:
        raise UserError(f"max_completion_length={cfg.max_completion_length} must be at least 1")
