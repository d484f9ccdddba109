"""Full fine-tuning with FSDP2 on any flavor, Hugging Face checkpoint in and out.

    python -m recipes.full_finetune                                  # tiny model, demo data, CPU
    python -m recipes.full_finetune flavor=cpu-2 model=qwen2_5_0_5b model.checkpoint_dir=DIR \
        dataset=chat dataset.path=chat.jsonl batch_size=32
    python -m recipes.full_finetune --cfg job                        # print the composed config

Reads top to bottom: config -> flavor -> processes -> data -> plan -> build on meta -> recompute
-> shard -> weights -> optimizer -> train loop -> save. Its sibling recipes/lora_finetune.py
shares every library piece and differs only in what is trained and what is saved.
"""

import sys

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from moai_recipes.errors import exit_on_user_error
from moai_recipes.flavors import Flavor
from moai_recipes.launch.entry import run_recipe
from moai_recipes.launch.world import World, decided_by_main
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.hf_format import load_weights, save_weights
from moai_recipes.planner import choose_plan
from moai_recipes.run_inputs import describe_inputs, read_inputs
from moai_recipes.train.answers import Samples
from moai_recipes.train.loop import train_loop
from moai_recipes.train.optim import build_optimizer, build_scheduler
from moai_recipes.train.parallel import apply_recompute, shard_model
from moai_recipes.train.peak_memory import mark_memory_baseline
from moai_recipes.train.run_log import RunLog

RECIPE = "full_finetune"


def train(cfg: DictConfig, flavor: Flavor, world: World) -> None:
    torch.manual_seed(cfg.seed)
    say = print if world.is_main else (lambda *a, **k: None)

    # 1. What the run reads: its folder (never an earlier run's), the checkpoint, tokenizer, data.
    inputs = read_inputs(cfg)

    # 2. The plan, decided before the first step.
    # Decided once: step times rest on this machine's measured speed, and the ranks must agree.
    choice = decided_by_main(world, lambda: choose_plan(spec=inputs.ckpt.spec, flavor=flavor, batch_size=cfg.batch_size,
                                                        seq_len=cfg.max_seq_len, dtype=cfg.dtype, forced=dict(cfg.plan)))
    plan = choice.chosen.plan
    say(f"Flavor {flavor.describe()}; {world.world_size} process(es), backend {flavor.backend}")
    say("\n".join(describe_inputs(inputs, cfg)))
    say("\n".join(choice.report()))
    say(f"Configuration for parallelism is selected: {plan.describe()}")

    # 3. Build on meta, recompute, shard, then give memory and weights: one place, one order.
    mark_memory_baseline()  # the measured peak counts what training allocates from here, as the plan predicts
    with torch.device("meta"):
        model = build_model(inputs.ckpt.spec, max_seq_len=cfg.max_seq_len)
    apply_recompute(model.layers, plan.recompute)
    shard_model(model, model.layers, mesh=world.mesh, param_dtype=getattr(torch, plan.param_dtype),
                reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload)
    model.to_empty(device="cpu" if plan.cpu_offload else world.device)
    init_buffers(model, device=world.device)
    load_weights(model, inputs.ckpt)

    # 4. Every parameter is trained.
    o = cfg.optimizer
    optimizer = build_optimizer(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                weight_decay=o.weight_decay, device=world.device)
    scheduler = build_scheduler(optimizer, warmup_steps=o.warmup_steps, total_steps=inputs.total_steps)

    # 5. The loop: the same global batch, loss and gradients on any flavor.
    log = RunLog.start(inputs.out, cfg, flavor=flavor.name, plan=choice.as_dict(), total_steps=inputs.total_steps,
                       resume_step=inputs.resume_step) if world.is_main else None
    samples = Samples(inputs.tokenizer, prompts=list(cfg.dataset.sample_prompts), chat=cfg.dataset.kind != "text",
                      max_new_tokens=cfg.sample_max_new_tokens, device=world.device)
    samples.take_before(model)
    train_loop(model, optimizer, scheduler, inputs, micro_batch_size=plan.micro_batch_size,
               chunked_loss=plan.chunked_loss, max_grad_norm=o.max_grad_norm, world=world, log=log,
               checkpoint_every=cfg.checkpoint_every, checkpoint_keep=cfg.checkpoint_keep,
               skip_nonfinite_steps=cfg.skip_nonfinite_steps, plan=choice.chosen.as_dict(), flavor=flavor.name)
    say("\n".join(samples.report_after(model)))

    # 6. The model in Hugging Face format, laid out as the input was.
    save_weights(model, inputs.ckpt, inputs.out / "model", rank=world.rank)
    if log:  # before the last barrier: a worker that crashes while exiting cannot cut it short
        log.close()
        say(f"Model saved in {inputs.out / 'model'}; metrics in {inputs.out / 'metrics.jsonl'}, "
            f"loss curve in {inputs.out / 'loss.png'}")
    dist.barrier()


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run_recipe(RECIPE, train, argv)


if __name__ == "__main__":
    sys.exit(main())
