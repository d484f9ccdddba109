"""LoRA and QLoRA fine-tuning with FSDP2 on any flavor: a PEFT adapter (and the merged model) out.

    python -m recipes.lora_finetune flavor=cpu-2 model=tiny max_steps=20 optimizer.lr=3e-4
    python -m recipes.lora_finetune model=llama3_8b model.checkpoint_dir=DIR lora.rank=16 lora.apply_to_mlp=true
    python -m recipes.lora_finetune lora.quantize_base=true ...       # QLoRA: the frozen base in NF4

The sibling of recipes/full_finetune.py: the same story and the same library pieces; it differs in
what is built (torchtune's LoRA builders), what is trained (the adapters only: only they get
gradients and optimizer state) and what is saved (adapter/ in PEFT format, model/ merged).
"""

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from moai_recipes.checkpoint.steps import TrainState
from moai_recipes.flavors import Flavor
from moai_recipes.inputs import read_inputs
from moai_recipes.models.build import build_model
from moai_recipes.models.hf_format import load_weights, save_weights
from moai_recipes.models.lora import (
    freeze_base,
    gather_adapters,
    init_adapters,
    merge_into,
    save_adapter,
)
from moai_recipes.models.sources import base_model_name
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

    # 1. What the run reads: its folder (never an earlier run's), the checkpoint, tokenizer, LoRA settings, data.
    inputs = read_inputs(cfg, flavor, restarting=world.restarts > 0)
    lora = inputs.lora

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

    # 3. Build with adapters on meta, freeze the base; recompute, shard and give memory; base weights, adapters.
    with torch.device("meta"):
        model = build_model(inputs.spec, max_seq_len=plan.row_length, lora=lora.builder_kwargs(),
                            quantize_base=lora.quantize_base)
    freeze_base(model)  # before sharding: FSDP2 keeps requires_grad per parameter
    stored_as_planned(model, plan)  # the base in the compute dtype (no fp32 master of it), the adapters as planned
    model = parallelize(model, plan, world, spec=inputs.spec)  # under pipeline parallelism, this device's stages only
    load_weights(model, inputs.hf, allow_missing=(".lora_a.", ".lora_b."))
    init_adapters(model, seed=cfg.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    whole = f", and {', '.join(lora.trained_whole)} whole" if lora.trained_whole else ""
    say(f"Trainable: {sum(p.numel() for p in trainable) / 1e6:.3f}M parameters (adapters{whole})")

    # 4. Only the adapters are trained: only they get gradients and optimizer state.
    optimizer = build_optimizer(trainable, cfg.optimizer, plan)
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

    # 6. The adapter in PEFT format, and the base with the adapters merged in Hugging Face format
    #    (QLoRA: the base it was trained with, dequantized from NF4).
    #    The log is closed (loss.png drawn) first: the last output written marks a finished run, whatever
    #    happens to a worker afterwards (launch/entry.py relies on it).
    if log:
        log.close()
    adapters = gather_adapters(model)
    save_adapter(adapters, opts=lora, out_dir=inputs.out / "adapter",
                 base_model=base_model_name(inputs.hf.folder, cfg.model.hf_repo), rank=world.rank)
    if cfg.save_merged:
        save_weights(model, inputs.hf, inputs.out / "model", rank=world.rank, transform=merge_into(adapters, lora.scale))
    say(f"Adapter saved in {inputs.out / 'adapter'}" + (f", merged model in {inputs.out / 'model'}"
                                                         if cfg.save_merged else ""))
    dist.barrier()

