"""Full fine-tuning with FSDP2 on any flavor, Hugging Face checkpoint in and out.

    python -m recipes.full_finetune                                  # tiny model, demo data, CPU
    python -m recipes.full_finetune flavor=cpu-2 model=qwen2_5_0_5b model.checkpoint_dir=DIR \
        dataset=chat dataset.path=chat.jsonl batch_size=32
    python -m recipes.full_finetune --cfg job                        # print the composed config

Reads top to bottom: config -> flavor -> processes -> inputs -> plan -> build on meta -> recompute,
shard, memory -> weights -> optimizer -> train loop -> save. Its sibling lora_finetune.py shares
every library piece and differs only in what is built, what is trained and what is saved.
"""

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from moai_recipes.checkpoint.steps import TrainState
from moai_recipes.flavors import Flavor
from moai_recipes.inputs import read_inputs
from moai_recipes.models.build import build_model
from moai_recipes.models.hf_format import load_weights, save_weights
from moai_recipes.planner.search import choose_plan
from moai_recipes.train.answers import Answers
from moai_recipes.train.loop import LoopSettings, train_loop
from moai_recipes.train.mixed_precision import stored_as_planned
from moai_recipes.train.optim import build_optimizer, build_scheduler
from moai_recipes.train.out_of_memory import forced_plan
from moai_recipes.train.parallel import parallelize
from moai_recipes.train.plan_accuracy import report_accuracy
from moai_recipes.train.process import prepare_process
from moai_recipes.train.metrics_log import MetricsLog
from moai_recipes.train.world import World, decided_by_main


def train(cfg: DictConfig, flavor: Flavor, world: World) -> None:
    torch.manual_seed(cfg.seed)
    say = print if world.is_main else (lambda *a, **k: None)

    # 1. What the run reads: its folder (never an earlier run's), the checkpoint, tokenizer, data.
    inputs = read_inputs(cfg, flavor, restarting=world.restarts > 0)

    # 2. The plan, decided before the first step.
    # Decided once: step times rest on this machine's measured speed, and the ranks must agree.
    choice = decided_by_main(world, lambda: choose_plan(inputs.workload, flavor,
                                                        forced=forced_plan(cfg.plan, inputs.out_of_memory_hint)))
    plan = choice.chosen.plan
    world = world.laid_out(plan)  # the mesh the plan asks for (World.DIMS)
    say(f"Flavor {flavor.describe()}; {world.world_size} process(es), backend {flavor.backend}")
    say("\n".join(inputs.describe(cfg)))
    say("\n".join(choice.report()))
    say(f"Configuration for parallelism is selected: {plan.describe()}")

    # 3. Build on meta; recompute, shard and give memory in one place, one order; then the weights.
    with torch.device("meta"):
        model = build_model(inputs.spec, max_seq_len=plan.row_length)
    stored_as_planned(model, plan)  # fp32 master weights, or bf16 ones (precision=bf16)
    model = parallelize(model, plan, world, spec=inputs.spec)  # under pipeline parallelism, this device's stages only
    load_weights(model, inputs.hf)

    # 4. Every parameter is trained.
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, plan)
    state = TrainState(model, optimizer, build_scheduler(optimizer, cfg.optimizer, total_steps=inputs.total_steps))

    # 5. This process set up for the loop (threads, allocator, collector), then the loop: the same global batch,
    #    loss and gradients on any flavor; the measured against the planned at its end.
    process = prepare_process(plan, inputs.workload, flavor, world)
    log = MetricsLog.start(cfg, inputs, choice) if world.is_main else None
    answers = Answers.for_run(cfg, inputs.tokenizer, plan=plan, device=world.device, images=inputs.image_samples)
    answers.take_before(model)
    result = train_loop(state, inputs, choice, LoopSettings.from_config(cfg, process), world, log)
    if log and result.measured:
        report_accuracy(result.choice, result.measured, work=inputs.workload, model_name=inputs.model_name,
                        device_kind=flavor.device.kind, log=log)
    say("\n".join(answers.report_after(model)))

    # 6. The model in Hugging Face format, laid out as the input was. It is the run's last output (the log is
    #    closed, loss.png drawn, first): a folder with model/ holds a finished run, whatever happens to a worker
    #    afterwards (the launcher relies on it: launch/entry.py).
    if log:
        log.close()
    save_weights(model, inputs.hf, inputs.out / "model", rank=world.rank)
    say(f"Model saved in {inputs.out / 'model'}; metrics in {inputs.out / 'metrics.jsonl'}, "
        f"loss curve in {inputs.out / 'loss.png'}")
    dist.barrier()

