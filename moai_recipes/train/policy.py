"""The model a preference or RL recipe trains (recipes.dpo, recipes.grpo), built as the plan lays it out: the
policy (LoRA: adapters on its frozen base), or a frozen copy of it for a reference; and saved at the end."""

import torch

from moai_recipes.errors import UserError

from moai_recipes.models.build import build_model
from moai_recipes.models.hf_format import load_weights, save_weights
from moai_recipes.models.lora import freeze_base, gather_adapters, init_adapters, merge_into, save_adapter
from moai_recipes.models.sources import base_model_name
from moai_recipes.planner.plan import Plan
from moai_recipes.train.mixed_precision import stored_as_planned
from moai_recipes.train.parallel import parallelize
from moai_recipes.train.world import World


# What would cut a sample's sequences or the model's layers apart, which these recipes' steps do not do.
_UNCUT = ("pipeline_stages", "tensor_parallel", "context_parallel")


def whole_on_each_device(forced: dict, recipe: str) -> dict:
    """The plan fields the user forced for `recipe` (recipes.dpo, recipes.grpo), with no pipeline, tensor or
    context cut: its step runs a sample's sequences (a pair, a group of completions) whole on each device. A cut the
    user forced is refused by name rather than dropped."""
    for name in (*_UNCUT, "context_parallel_way"):
        value = forced.get(name)
        if value is not None and (name == "context_parallel_way" or value > 1):
            raise UserError(f"plan.{name}={value}: {recipe} runs each sample's sequences whole on every device, over "
                            "FSDP2's data-parallel shards (and experts split over them); pipeline stages, tensor and "
                            f"context parallelism are for recipes.full_finetune and recipes.lora_finetune. Drop "
                            f"plan.{name}")
    return {**forced, **dict.fromkeys(_UNCUT, 1)}


def build_policy(inputs, plan: Plan, world: World, *, lora, seed: int, frozen: bool = False) -> torch.nn.Module:
    """The policy (LoRA: adapters on its frozen base), or with `frozen` the reference copy, nothing of it trained."""
    with torch.device("meta"):
        model = build_model(inputs.spec, max_seq_len=plan.row_length, lora=lora.builder_kwargs() if lora else None,
                            quantize_base=bool(lora and lora.quantize_base))
    if lora:
        freeze_base(model)  # before sharding: FSDP2 keeps requires_grad per parameter
    if frozen:
        model.requires_grad_(False)
    stored_as_planned(model, plan)  # what never changes in the compute dtype (no fp32 master), what trains as planned
    model = parallelize(model, plan, world, spec=inputs.spec)
    load_weights(model, inputs.hf, allow_missing=(".lora_a.", ".lora_b.") if lora else ())
    if lora:
        init_adapters(model, seed=seed)
    return model


def save_policy(model: torch.nn.Module, inputs, cfg, world: World, *, lora) -> str:
    """The trained policy as the fine-tuning recipes save theirs: model/ (full); adapter/ (PEFT) and, with
    save_merged, model/ with the adapters merged (LoRA). Every rank calls it; returns what was saved, to say."""
    if lora is None:
        save_weights(model, inputs.hf, inputs.out / "model", rank=world.rank)
        return f"Model saved in {inputs.out / 'model'}"
    adapters = gather_adapters(model)
    save_adapter(adapters, opts=lora, out_dir=inputs.out / "adapter",
                 base_model=base_model_name(inputs.hf.folder, cfg.model.hf_repo), rank=world.rank)
    if cfg.save_merged:
        save_weights(model, inputs.hf, inputs.out / "model", rank=world.rank, transform=merge_into(adapters, lora.scale))
    return f"Adapter saved in {inputs.out / 'adapter'}"
