"""What a run reads before its first step, read and checked in one place for everyone who asks.

The training recipes, `moai validate` and `recipes.plan` all call `read_inputs`: the output folder,
the checkpoint (config.json, the weights' headers, never the weights), the tokenizer, the LoRA
settings and the data. What one refuses, all refuse, with the same message. A dry read
(validate, plan) downloads nothing, waits for no other process and writes nothing; a model that is
only on the Hub is then described from its config and noted as not checked.
`read_generate_inputs` does the same for recipes.generate and `moai validate generate`.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from moai_recipes.checkpoint.disk import CHECKPOINT_BYTES_PER_TRAINABLE, check_room
from moai_recipes.checkpoint.integrity import all_gathered
from moai_recipes.checkpoint.output_dir import (
    check_output_dir,
    check_same_identity,
    complete_checkpoints,
    read_hint,
    read_meta,
    read_skipped_steps,
    verified,
)
from moai_recipes.config.schema import DEFAULT_MODEL
from moai_recipes.data.images import image_samples
from moai_recipes.data.training_data import RunData, read_data
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor
from moai_recipes.inference.device_map import check_device_map
from moai_recipes.inference.sampling import Sampling, sampling_options
from moai_recipes.models.hf_format import HFFolder
from moai_recipes.models.lora import LoraOptions, lora_options
from moai_recipes.models.peft_adapter import PeftAdapter
from moai_recipes.models.sources import model_source, resolve_model_dir
from moai_recipes.models.spec import ModelSpec, check_context, spec_for, with_aux_loss_coef
from moai_recipes.planner.plan import ImageLoad, Rollout, Workload

if TYPE_CHECKING:
    from moai_recipes.inference.harness import Tasks


# An image-text model's parts that LoRA may adapt or train whole (lora.vision, lora.projector), as a run names them.
_IMAGE_PARTS = {"vision": "vision tower", "projector": "projector"}


@dataclass
class RunInputs:
    """A training run's inputs, checked. In a dry read of a model only on the Hub, `hf`, `tokenizer` and
    `data` are None (nothing to read them from yet)."""

    model_name: str
    spec: ModelSpec
    hf: HFFolder | None
    tokenizer: Tokenizer | None
    lora: LoraOptions | None  # the LoRA recipe's (and a LoRA plan's) adapters
    data: RunData | None
    total_steps: int | None
    out: Path | None  # the run folder (None: not checked, as for a plan)
    resume_from: Path | None  # a complete checkpoint to continue from
    workload: Workload  # what the planner plans: this model, this batch, these sequences
    out_of_memory_hint: dict | None = None  # the smaller plan an out-of-memory step of this run left (restarts)
    skipped_steps: frozenset[int] = frozenset()  # steps skipped whole when redone (errors.RedoSkipping)
    identity: dict | None = None  # what a checkpoint of this run belongs to: model, tokenizer, data, global batch
    eval_tasks: "Tasks | None" = None  # eval_tasks=, their data read (inference/harness.py)

    @property
    def image_samples(self):
        """An image-text model's processor, as its data was made with it (data/images.ImageSamples); else None."""
        return getattr(self.data.train, "maker", None) if self.data is not None else None

    @property
    def batches(self):
        return self.data.batches

    @property
    def val_dataset(self):
        return self.data.val

    @property
    def resume_step(self) -> int:
        return read_meta(self.resume_from)["step"] if self.resume_from else 0

    def describe(self, cfg: DictConfig) -> list[str]:
        """What was read, a line each, as a run prints it before its plan and `moai validate` after its checks."""
        spec = self.spec
        where = f"from {self.hf.folder}" if self.hf else f"on the Hugging Face Hub ({cfg.model.hf_repo})"
        experts = (f" ({spec.num_params(active=True) / 1e6:,.1f}M active: {spec.experts_per_token} of "
                   f"{spec.num_experts} experts a token)" if spec.is_moe else "")
        lines = [f"Model {self.model_name} {where}: {spec.family}, {spec.num_params() / 1e6:,.1f}M parameters{experts}"
                 + (f" in {len(self.hf.files)} safetensors file(s), tokenizer of {self.tokenizer.vocab_size} tokens"
                    if self.hf else "; the first run downloads it (not checked here: model.checkpoint_dir=DIR "
                    "checks a local copy)")]
        if spec.mxfp4:
            lines.append("Its experts are MXFP4 in the checkpoint (config.json's quantization_config): dequantized to "
                         "bf16 as they are read, trained and written in bf16 (the written config.json without "
                         "quantization_config)")
        if spec.code_dir:
            lines.append(f"Code from {spec.code_dir} (config.json's auto_map) builds this model: it runs because "
                         "model.trust_remote_code=true")
        if self.lora:
            o = self.lora
            targets = [*(o.target_modules or o.attn_modules), *(["the MLP"] if o.apply_to_mlp else []),
                       *(["every expert's projections"] if o.apply_to_experts else []),
                       *(["the output"] if o.apply_to_output else []),
                       *([f"the {name}'s linear modules" for part, name in _IMAGE_PARTS.items()
                          if getattr(o, part) == "lora"])]
            small = (f", but for {len(o.unquantized)} linear weights too small for whole NF4 blocks (kept in the "
                     "compute dtype)") if o.unquantized else ""
            whole = [name for part, name in _IMAGE_PARTS.items() if getattr(o, part) == "full"]
            lines.append(f"LoRA: rank {o.rank} on {', '.join(targets)}, alpha {o.alpha:g}; "
                         + (f"the base frozen in NF4 (QLoRA){small}" if o.quantize_base else "the base frozen")
                         + (f", but the {' and '.join(whole)} trained whole ({', '.join(o.trained_whole)})"
                            if whole else ""))
        if self.data is not None:
            lines += self.data.describe(cfg)
        pictures = self.workload.images
        if pictures is not None and pictures.assumed:
            height, width = pictures.assumed
            lines.append(f"Pictures assumed (no data read): one of {height} x {width} pixels a sample, "
                         f"{pictures.example_tokens:,} image tokens of its row (picture_size=[HEIGHT,WIDTH])")
        if self.out is not None:
            lines.append(f"Output {self.out}: " + (f"resumes from {self.resume_from}" if self.resume_from else "a new run"))
        return lines


def model_spec(cfg: DictConfig, folder: Path | None) -> ModelSpec:
    """The spec of the run's model, its checkpoint in `folder` (None: planned from its config entry alone)."""
    m = cfg.model
    return spec_for(architecture=m.architecture, checkpoint_dir=folder, any_family=m.name == DEFAULT_MODEL,
                    implementation=m.implementation, trust_remote_code=m.trust_remote_code, longest=cfg.max_seq_len)


def import_ahead(cfg: DictConfig) -> None:
    """Import now what reading the run's inputs will: the code that builds the model (torchtune's layers, its LoRA
    and its generation, and transformers' modules of the model's family where they build it) and the learning-rate
    schedule. The launcher calls it before it forks the workers (launch/elastic.prepare_workers), which then find it
    imported: cpu-4's 4 processes each imported it on 2 cores, 3.5 s of CPU apiece (7 of a tiny Phi-4's 10 s run).
    `cfg.model.checkpoint_dir` is resolved already."""
    import torchtune.modules  # noqa: F401 (models/build.py's layers and LoRA, with dynamo, which they import)
    import torchtune.training.lr_schedulers  # noqa: F401 (train/optim.build_scheduler's learning-rate schedule)

    spec = model_spec(cfg, cfg.model.checkpoint_dir)
    if not spec.native:
        # transformers' table of how checkpoints name each family's tensors, built at its first use in a process
        # (every family's patterns: 0.2 s of CPU) when a worker reads the weights: built here once instead.
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping(spec.family)
    if OmegaConf.select(cfg, "dataset.source"):
        import datasets  # noqa: F401 (data/hf_datasets.py reads the source with it: pandas and pyarrow, 0.9 s)
    if (OmegaConf.select(cfg, "plan.pipeline_stages") or 1) > 1:
        # A pipeline the user asked for: torch's pipelining, whose import in each worker (torch.library looking up
        # the source of the fake op it registers) took 12 CPU-seconds of the suite's pipelined runs (py-spy).
        import torch.distributed.pipelining  # noqa: F401


def read_inputs(cfg: DictConfig, flavor: Flavor, *, dry: bool = False, output: bool = True,
                restarting: bool = False) -> RunInputs:
    """Check the output folder (unless `output` is false), describe the checkpoint, read the tokenizer and
    the LoRA settings, tokenise the data. `dry`: download nothing, wait for no other process. `restarting`: the
    processes of this very run started again (by our launcher or torchrun), which may find their own folder
    without a checkpoint."""
    out = resume_from = None
    if output:
        if not dry and dist.is_initialized() and dist.get_world_size() > 1:
            # Checked once, on rank 0, before it writes anything (a UserError there ends the group: the launcher
            # stops the others); then the checkpoint is read back against its checksums by all, each its share.
            box = [check_output_dir(cfg, restarting=restarting, verify=False) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            out, resume_from = box[0]
            resume_from = verified(cfg, resume_from, share=(dist.get_rank(), dist.get_world_size()),
                                   agree=all_gathered)
        else:
            out, resume_from = check_output_dir(cfg, restarting=not dry and restarting)
    folder = resolve_model_dir(**model_source(cfg), download=not dry)
    spec = model_spec(cfg, folder)
    hf = HFFolder.open(folder, spec=spec) if folder else None
    spec = with_aux_loss_coef(spec, cfg.model.get("router_aux_loss_coef"))
    check_context(spec, cfg.max_seq_len, what=f"max_seq_len={cfg.max_seq_len}",
                  fix=f"use max_seq_len={spec.sliding_window} or less")
    tokenizer = checked_tokenizer(hf) if hf else None
    lora = None
    if "lora" in cfg and cfg.get("method", "lora") == "lora":
        lora = lora_options(cfg.lora, spec=spec, world_size=flavor.num_devices)
    data = None
    if tokenizer is not None:
        main = not dist.is_initialized() or dist.get_rank() == 0
        data = read_data(cfg, tokenizer, dry=dry, progress=main and not dry,
                         images=image_samples(hf.folder) if spec.reads_images else None)
    workload = Workload(spec=spec, batch_size=cfg.batch_size, seq_len=cfg.max_seq_len, lora=lora, dtype=cfg.dtype,
                        precision=str(cfg.precision), states=str(cfg.optimizer.states),
                        clips=cfg.optimizer.max_grad_norm is not None, rollout=_rollout(cfg),
                        lengths=data.lengths if data is not None else None,
                        steps=data.total_steps if data is not None else cfg.max_steps,
                        images=_image_load(data) or (_assumed_pictures(cfg, spec) if data is None else None))
    eval_tasks = None
    if cfg.eval_tasks and not dry:  # their data read now: a task missing is said before step 1, not at its first eval
        from moai_recipes.inference.harness import Tasks, load_tasks  # lm-eval: imported by the runs that use it

        eval_tasks = Tasks(manager=load_tasks(list(cfg.eval_tasks), tasks_dir=cfg.eval_tasks_dir, key="eval_tasks"),
                           names=list(cfg.eval_tasks), limit=cfg.eval_limit, stderr=False)
    identity = None
    if out is not None and hf is not None and data is not None:
        _check_room(cfg, out, hf=hf, workload=workload, resume_from=resume_from)
        identity = {"model": hf.fingerprint(), "tokenizer": tokenizer.fingerprint(),
                    "data": data.train.fingerprint() if data.train is not None else None, "batch_size": cfg.batch_size}
        if resume_from is not None:
            check_same_identity(resume_from, identity, force=cfg.resume_force)
    return RunInputs(model_name=cfg.model.name, spec=spec, hf=hf, tokenizer=tokenizer, lora=lora, data=data,
                     total_steps=data.total_steps if data else None, out=out, resume_from=resume_from,
                     workload=workload, out_of_memory_hint=read_hint(out),
                     skipped_steps=read_skipped_steps(out), identity=identity, eval_tasks=eval_tasks)


def _check_room(cfg: DictConfig, out: Path, *, hf: HFFolder, workload: Workload, resume_from: Path | None) -> None:
    """Before the first step: the checkpoints this run keeps at once and its export must fit the disk of `out`."""
    first = read_meta(resume_from)["step"] if resume_from else 0
    every = cfg.checkpoint_every
    saves = sum(1 for s in range(first + 1, workload.steps or 0) if s % every == 0) if every else 0
    model_bytes = sum((hf.folder / f).stat().st_size for f in hf.files)
    trainable = workload.sizes.trainable
    export = model_bytes if workload.lora is None else trainable * 4 + (model_bytes if cfg.get("save_merged", True) else 0)
    reclaimable = sum(f.stat().st_size for c in complete_checkpoints(out) for f in c.iterdir()) if saves else 0
    check_room(out, checkpoint=trainable * CHECKPOINT_BYTES_PER_TRAINABLE, saves=saves, keep=cfg.checkpoint_keep,
               export=export, reclaimable=reclaimable)


@dataclass
class GenerateInputs:
    """What recipes.generate reads before a weight: its sampling settings, the checkpoint, the adapter."""

    sampling: Sampling
    hf: HFFolder | None  # None: a dry read of a model (or an adapter's base) only on the Hub
    tokenizer: Tokenizer | None
    adapter: PeftAdapter | None

    def describe(self, cfg: DictConfig) -> list[str]:
        s = self.sampling
        how = "greedy" if s.temperature == 0 else (f"temperature {s.temperature:g}, top_p {s.top_p:g}"
                                                    + (f", top_k {s.top_k}" if s.top_k else ""))
        lines = [f"Sampling: {how}, up to {s.max_new_tokens} new tokens; device_map {cfg.device_map}"]
        a = self.adapter
        if self.hf is None:
            what = (f"Adapter {a.folder}: r={a.rank} on the base {a.base_model}, which" if a else
                    f"Model {cfg.model.name} ({cfg.model.hf_repo}), which")
            return lines + [f"{what} the first run downloads from the Hugging Face Hub (not checked here; "
                            "model.checkpoint_dir=DIR checks a local copy)"]
        spec = self.hf.spec
        lines.append(f"Model from {self.hf.folder}: {spec.family}, {spec.num_params() / 1e6:.1f}M parameters in "
                     f"{len(self.hf.files)} safetensors file(s), tokenizer of {self.tokenizer.vocab_size} tokens")
        if a:
            lines.append(f"Adapter {a.folder}: r={a.rank}, alpha={a.alpha:g} on {len(a.weights)} weights of this base")
        return lines


def read_generate_inputs(cfg: DictConfig, *, dry: bool = False) -> GenerateInputs:
    """Check the sampling settings, open the adapter and the checkpoint it goes on (model.checkpoint_dir, the
    model's default, or the base adapter_config.json names) and match them. Like transformers, generate
    builds whatever family config.json says."""
    sampling = sampling_options(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    check_device_map(cfg.device_map, cfg.max_memory_gb)
    hf, adapter = model_and_adapter(cfg, dry=dry)
    return GenerateInputs(sampling=sampling, hf=hf, tokenizer=checked_tokenizer(hf) if hf else None, adapter=adapter)


def model_and_adapter(cfg: DictConfig, *, dry: bool = False) -> tuple[HFFolder | None, PeftAdapter | None]:
    """The checkpoint (model.checkpoint_dir, the model's default, or the base the adapter's config names) and the
    adapter_dir adapter on it, opened and matched; the checkpoint is None on a dry read of a model only on the Hub."""
    adapter = PeftAdapter.open(cfg.adapter_dir) if cfg.adapter_dir else None
    if adapter and not cfg.model.checkpoint_dir:
        folder = adapter.base_model_dir(download=not dry)
    else:
        folder = resolve_model_dir(**model_source(cfg), download=not dry)
    if folder is None:
        return None, adapter
    hf = HFFolder.open(folder, implementation=cfg.model.get("implementation", "auto"),
                       trust_remote_code=cfg.model.get("trust_remote_code", False))
    if adapter:
        adapter.check_base(hf)
    return hf, adapter


def checked_tokenizer(hf: HFFolder) -> Tokenizer:
    """The checkpoint's tokenizer, refused when it has ids the model's embedding has no row for (a tokenizer
    of another model). Fewer is common: embeddings are padded to a round size."""
    tokenizer = Tokenizer.from_checkpoint(hf.folder)
    if tokenizer.vocab_size > hf.spec.vocab_size:
        raise UserError(f"{hf.folder / 'tokenizer.json'} has {tokenizer.vocab_size} tokens, but config.json's "
                        f"vocab_size is {hf.spec.vocab_size}: the tokenizer belongs to another model. Put the "
                        "model's own tokenizer files in the folder")
    return tokenizer


def _rollout(cfg: DictConfig) -> Rollout | None:
    """recipes.grpo's generation phase, for the planner (None for the other recipes)."""
    if "num_generations" not in cfg:
        return None
    # The reference's forward with LoRA (the adapters off); full fine-tuning's frozen copy is priced as recipes.dpo's
    # (Workload.reference, set by the recipe).
    return Rollout(completion_length=cfg.max_completion_length, num_iterations=cfg.num_iterations,
                   extra_passes=int(cfg.num_iterations > 1) + int(cfg.beta != 0 and cfg.method == "lora"))


def _assumed_pictures(cfg: DictConfig, spec) -> ImageLoad | None:
    """An image-text model planned without its data (recipes.plan without a checkpoint folder): one picture of
    `picture_size` a sample, made into inputs by the model's image processor (its config entry's image_processor), its
    image tokens those the vision tower makes of it. None for a text model, or where the entry has no image processor."""
    if not spec.reads_images or "picture_size" not in cfg or not cfg.model.get("image_processor"):
        return None
    import torch

    from moai_recipes.data.images import assumed_picture, image_example
    from moai_recipes.planner.activations import trace_images

    settings = OmegaConf.to_container(cfg.model.image_processor, resolve=True)
    example = image_example(assumed_picture(settings, tuple(cfg.picture_size)))
    tokens = trace_images(spec, example, dtype=torch.bfloat16, lora=None).tokens
    return ImageLoad(example=example, example_tokens=tokens, tokens=(tokens,), assumed=tuple(cfg.picture_size))


def _image_load(data: RunData | None) -> ImageLoad | None:
    """An image-text model's images as the planner prices them (data/images.ImageTextDataset.image_load), with what a
    packed row of the data's samples can hold of them (each sample's length beside its image tokens)."""
    load = data.train.image_load() if data is not None and hasattr(data.train, "image_load") else None
    if not load:
        return None
    lengths = data.lengths
    if lengths is not None and len(lengths) == len(load["tokens"]):
        load.update(densest=max(t / max(n, 1) for t, n in zip(load["tokens"], lengths)),
                    shortest=max(min(lengths), 1))
    return ImageLoad(**load)
