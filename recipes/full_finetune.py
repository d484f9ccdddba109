"""Full fine-tuning with FSDP2 on any flavor, Hugging Face checkpoint in and out.

    python -m recipes.full_finetune                                  # the demo: tiny model, demo data, CPU
    python -m recipes.full_finetune flavor=cpu-2 model=qwen2_5_0_5b model.checkpoint_dir=DIR \
        dataset=chat dataset.path=chat.jsonl batch_size=32
    python -m recipes.full_finetune --cfg job                        # print the composed config

Reads top to bottom: compose config -> resolve flavor -> (launch processes) -> data -> plan ->
build on meta -> recompute -> shard -> load weights -> train loop -> save.
"""

import math
import sys

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from moai_recipes.batching import GlobalBatches
from moai_recipes.config import load_config
from moai_recipes.data import load_dataset
from moai_recipes.errors import exit_on_user_error
from moai_recipes.flavors import Flavor, resolve_flavor
from moai_recipes.hf_checkpoint import HFCheckpoint, load_weights, save_weights
from moai_recipes.hub import resolve_checkpoint_dir
from moai_recipes.launch import World, distributed, needs_launch, relaunch
from moai_recipes.metrics import RunLog
from moai_recipes.models import build_model, init_buffers
from moai_recipes.outputs import check_output_dir, write_config, write_json
from moai_recipes.parallel import apply_recompute, shard_model
from moai_recipes.plan import default_plan
from moai_recipes.tokenizer import Tokenizer
from moai_recipes.training import (StepTimer, build_optimizer, build_scheduler, greedy_continuation, max_over_ranks,
                                   peak_memory_bytes, train_step)

RECIPE = "full_finetune"


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(RECIPE, argv)
    flavor = resolve_flavor(**cfg.flavor)
    if needs_launch(flavor):
        # The user never types torchrun: start the flavor's processes, each running this same
        # command, with what must not differ between them (the output folder, the checkpoint) pinned.
        check_output_dir(cfg.output_dir)
        ckpt_dir = resolve_checkpoint_dir(**_model_source(cfg))
        return relaunch(flavor, f"recipes.{RECIPE}", [*argv, f"output_dir={cfg.output_dir}",
                                                      f"model.checkpoint_dir={ckpt_dir}"])
    with distributed(flavor) as world:
        train(cfg, flavor, world)
    return 0


def _model_source(cfg: DictConfig) -> dict:
    return dict(name=cfg.model.name, checkpoint_dir=cfg.model.checkpoint_dir, hf_repo=cfg.model.hf_repo)


def train(cfg: DictConfig, flavor: Flavor, world: World) -> None:
    torch.manual_seed(cfg.seed)
    say = print if world.is_main else (lambda *a, **k: None)

    # 1. The run's folder: an earlier run is never overwritten.
    out = check_output_dir(cfg.output_dir)
    dist.barrier()  # every rank has checked before rank 0 writes anything

    # 2. Checkpoint (described, not loaded), tokenizer and data, tokenised before the first step.
    ckpt = HFCheckpoint.open(resolve_checkpoint_dir(**_model_source(cfg)))
    cfg.model.checkpoint_dir = str(ckpt.folder)
    tokenizer = Tokenizer.from_checkpoint(ckpt.folder)
    dataset = load_dataset(kind=cfg.dataset.kind, path=cfg.dataset.path, tokenizer=tokenizer,
                           max_seq_len=cfg.max_seq_len, column_map=dict(cfg.dataset.column_map),
                           train_on_input=cfg.dataset.train_on_input)
    if dataset.dropped:
        say(f"warning: {dataset.dropped} samples had no target token within max_seq_len={cfg.max_seq_len} and were dropped")
    batches = GlobalBatches(num_samples=len(dataset), batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed)
    total_steps = min(batches.total_steps, cfg.max_steps or math.inf)

    # 3. The plan, decided before the first step.
    plan = default_plan(flavor=flavor, batch_size=cfg.batch_size, dtype=cfg.dtype,
                        micro_batch_size=cfg.plan.micro_batch_size, recompute=cfg.plan.recompute)
    say(f"Flavor {flavor.describe()}; {world.world_size} process(es), backend {flavor.backend}")
    say(f"Model {cfg.model.name} from {ckpt.folder}: {ckpt.spec.family}, {ckpt.spec.num_params() / 1e6:.1f}M parameters")
    say(f"Data: {len(dataset)} samples, {batches.steps_per_epoch} steps per epoch, {total_steps} steps")
    say(f"Configuration for parallelism is selected: {plan.describe()}")

    # 4. Build on meta, recompute, shard, then give memory and weights: one place, one order.
    with torch.device("meta"):
        model = build_model(ckpt.spec, max_seq_len=cfg.max_seq_len)
    apply_recompute(model.layers, plan.recompute)
    shard_model(model, model.layers, mesh=world.mesh, param_dtype=getattr(torch, plan.param_dtype),
                reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload)
    model.to_empty(device="cpu" if plan.cpu_offload else world.device)
    init_buffers(model, device=world.device)
    load_weights(model, ckpt)

    # 5. Optimizer and schedule.
    o = cfg.optimizer
    optimizer = build_optimizer(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                weight_decay=o.weight_decay, device=world.device)
    scheduler = build_scheduler(optimizer, warmup_steps=o.warmup_steps, total_steps=total_steps)

    log = None
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_config(out, cfg)
        write_json(out / "plan.json", {"flavor": flavor.name, "chosen": plan.as_dict()})
        log = RunLog(out, total_steps=total_steps, config=OmegaConf.to_container(cfg, resolve=True),
                     plan=plan.as_dict(), tracker=dict(cfg.logger))
    prompts = {p: _encode_prompt(tokenizer, p, cfg.dataset.kind) for p in cfg.dataset.sample_prompts}
    before = {p: _sample(model, tokenizer, ids, cfg, world) for p, ids in prompts.items()}

    # 6. The loop: the same global batch, loss and gradients on any flavor.
    model.train()
    for step in range(total_steps):
        with StepTimer(world.device) as timer:
            result = train_step(model, optimizer, dataset, batches, step, micro_batch_size=plan.micro_batch_size,
                                max_grad_norm=o.max_grad_norm, world=world, pad_id=tokenizer.pad_id)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        peak = max_over_ranks(peak_memory_bytes(world.device), world)
        if log:
            log.step(step=step + 1, loss=result.loss, lr=lr, tokens=result.tokens,
                     tokens_per_sec=result.tokens / timer.seconds, step_time_s=timer.seconds,
                     grad_norm=result.grad_norm, peak_memory_bytes=int(peak), target_tokens=result.target_tokens)

    # 7. What it learned, and the model in Hugging Face format.
    model.eval()
    for p, ids in prompts.items():
        say(f"Sample {p!r}\n  before: {before[p]!r}\n  after:  {_sample(model, tokenizer, ids, cfg, world)!r}")
    save_weights(model, ckpt, out / "model", rank=world.rank)
    dist.barrier()
    if log:
        log.close()
        say(f"Model saved in {out / 'model'}; metrics in {out / 'metrics.jsonl'}, loss curve in {out / 'loss.png'}")


def _encode_prompt(tokenizer: Tokenizer, prompt: str, kind: str) -> list[int]:
    if kind == "text":
        return tokenizer.encode(prompt, add_eos=False)
    return tokenizer.encode_prompt([{"role": "user", "content": prompt}])


def _sample(model, tokenizer: Tokenizer, prompt: list[int], cfg: DictConfig, world: World) -> str:
    ids = greedy_continuation(model, prompt, max_new_tokens=cfg.sample_max_new_tokens,
                              stop_ids=tokenizer.stop_ids, device=world.device)
    return tokenizer.decode(ids)


if __name__ == "__main__":
    sys.exit(main())
