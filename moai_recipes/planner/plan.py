"""What is planned (a Workload) and how it runs (a Plan). The planner (search.py) chooses the Plan before
the first step; training follows it: the Plan alone splits a global batch into ranks and micro-batches."""

import math
import random
from dataclasses import asdict, dataclass
from functools import cached_property

from moai_recipes.models.spec import ModelSpec


@dataclass(frozen=True)
class Rollout:
    """recipes.grpo's generation phase, which the planner prices beside training: each step's completions sampled
    (once every `num_iterations` steps), up to `completion_length` tokens after their prompts (the data's lengths are
    a prompt and completion_length each), then `extra_passes` forwards over them (the sampling policy's
    log-probabilities when num_iterations > 1, the reference's when beta > 0)."""

    completion_length: int
    extra_passes: int = 0
    num_iterations: int = 1


@dataclass(frozen=True)
class ImageLoad:
    """An image-text model's images in the data, as the planner prices them: one sample's image inputs (the vision
    tower is traced on them: `example`, each input's name, shape, dtype and, for an integer one such as Qwen's grid
    sizes, its values), the image tokens that sample makes, and every sample's image tokens."""

    example: tuple
    example_tokens: int
    tokens: tuple[int, ...]
    assumed: tuple[int, int] | None = None  # a plan without data: every sample's picture this high and wide
    # Of the data's samples (their lengths known): the most image tokens a token of any has (its image tokens over its
    # length), and the shortest's length; what a packed row can hold (planner/memory._image_tokens). 0: not known.
    densest: float = 0.0
    shortest: int = 0

    # A search prices tens of thousands of plans, each asking these: computed once.
    @cached_property
    def most(self) -> int:
        return max(self.tokens, default=0)

    @cached_property
    def mean(self) -> float:
        """A sample's image tokens on average."""
        return sum(self.tokens) / len(self.tokens) if self.tokens else 0.0


@dataclass(frozen=True)
class Workload:
    """A model (with its LoRA adapters, if any) trained on global batches of `batch_size` sequences of up to
    `seq_len` tokens, in the compute dtype the user asked for (auto: bf16 on GPUs, fp32 on the CPU)."""

    spec: ModelSpec
    batch_size: int
    seq_len: int
    lora: object = None  # models.lora.LoraOptions
    dtype: str = "auto"
    precision: str = "mixed"  # mixed | bf16: what the trained weights, gradients and moments are stored in
    states: str = "auto"  # AdamW's moments: auto (the trained weights' dtype) | fp32 | bf16 | int8
    lengths: tuple[int, ...] | None = None  # the data's samples' token counts (None: all seq_len long)
    steps: int | None = None  # optimizer steps of the run (None: unknown, a long run)
    # Preference tuning's reference model (recipes.dpo): "copy", a frozen copy (LoRA: the base, adapters off) run
    # each step; "cached", its log-probabilities computed in a first pass over the data; "none" (fine-tuning).
    reference: str = "none"
    clips: bool = True  # gradients clipped to a total norm (optimizer.max_grad_norm): then no optimizer in the backward
    rollout: Rollout | None = None  # recipes.grpo: the completions sampled before training on them
    images: ImageLoad | None = None  # an image-text model's images (their vision tower's activations priced)

    @cached_property
    def sizes(self):
        from moai_recipes.planner.memory import model_sizes

        return model_sizes(self.spec, self.lora)

    @cached_property
    def mean_length(self) -> float:
        lengths = self.lengths or (self.seq_len,)
        return sum(lengths) / len(lengths)

    def mean_longest(self, m: int) -> float:
        """The mean length of the longest of `m` samples drawn from the data: what a padded micro-batch of m
        samples pads them to. Estimated on up to 4096 samples in a fixed order: the same answer every time."""
        groups = [self._drawn[i:i + m] for i in range(0, len(self._drawn), m)]
        return sum(max(g) for g in groups) / len(groups)

    @cached_property
    def _drawn(self) -> list[int]:
        lengths = list(self.lengths or (self.seq_len,))
        random.Random(0).shuffle(lengths)
        return lengths[:4096]

    @cached_property
    def lora_key(self) -> tuple | None:
        """The adapters as a hashable key of the layer traces (activations.py caches them by it)."""
        if self.lora is None:
            return None
        items = sorted(self.lora.builder_kwargs().items())
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in items)


def stages_per_device(schedule: str) -> int:
    """Pipeline stages a device runs under `schedule`: interleaved 1F1B two, the others one."""
    return 2 if schedule == "interleaved_1f1b" else 1


@dataclass(frozen=True)
class Plan:
    batch_size: int  # global, in sequences
    num_devices: int
    max_seq_len: int  # tokens of the longest sample
    micro_batch_size: int  # sequences per device per forward/backward; packed: a token budget of that many max_seq_len
    accumulation_steps: int  # micro-batches per device per optimizer step (packed: at most, with full-length samples)
    packing: bool  # a rank's samples end to end in rows of up to token_budget tokens, not padded to the longest
    recompute: str  # none | selective | full
    replicate: bool  # several processes each hold the whole model, gradients summed once a step (no FSDP2)
    reshard_after_forward: bool
    cpu_offload: bool
    chunked_loss: bool  # the output projection and the loss in chunks of tokens (models/loss.py)
    param_dtype: str  # compute dtype of parameters in forward/backward
    master_dtype: str  # dtype of the trained weights as stored (sharded) and of their gradients
    compile: bool = False  # each layer's forward and backward compiled by torch.compile (train/parallel.py)
    optimizer_states: str = "float32"  # AdamW's moments: float32 | bfloat16 | int8 (train/optim.py)
    # Ranks are balanced by the work of their documents, n x (1 + n / attention_length) for n tokens: attention
    # grows with the square of a document's length (ModelSpec.attention_length; 0: balanced by tokens alone).
    attention_length: int = 0
    # The model spread over a mesh of pipeline x data x tensor devices (their product is num_devices): `tensor`
    # devices cut each layer's heads and MLP (train/tensor_parallel.py), `pipeline_stages` hold consecutive
    # layers each (train/pipeline.py, run by `pipeline_schedule`), and the rest hold data-parallel copies (FSDP2
    # shards or replicas) that split the global batch between them.
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    pipeline_schedule: str = "none"  # none | gpipe | 1f1b | interleaved_1f1b (two stages a device)
    stage_layers: tuple[int, ...] = ()  # layers of each stage, in order (planner/layouts.split_layers)
    # A Mixture-of-Experts model's experts split over this many of the data-parallel devices (each holds E / this of
    # every sparse layer's experts; tokens reach them by all-to-all: train/expert_parallel.py). It divides the
    # experts and data_parallel.
    expert_parallel: int = 1
    # A packed row's tokens split over this many devices (train/context_parallel.py), attention computed over the
    # whole row by `context_parallel_way`: ulysses (heads exchanged by all-to-all) or gather (keys and values
    # all-gathered). The context devices share their samples, so they are not data-parallel copies; FSDP2 shards
    # over data x context devices.
    context_parallel: int = 1
    context_parallel_way: str = "none"  # none | ulysses | gather
    # Under full recomputation, each layer's saved input in host memory from its forward to its backward
    # (models/activation_offload.py), and each dense MLP computed in this many tiles of a row's tokens (0: whole;
    # models/tiled_mlp.py): for rows whose activations, or whose MLP's intermediate, a device cannot hold.
    offload_activations: bool = False
    tiled_mlp: int = 0
    # A row's tokens are padded up to one of this many sizes per doubling (0: not at all; Plan.padded_row). The CPU's
    # bf16 matmuls (oneDNN) JIT their kernels for each row count they have not seen, and keep them: without it a
    # step of new documents is a new row count (planner/search.ROW_SIZES_PER_DOUBLING).
    row_sizes: int = 0
    # AdamW applied to each weight in the backward as soon as its gradient of the step is complete, the gradient freed
    # at once (train/optimizer_in_backward.py): no clipping, and every gradient on this device's own model (no
    # pipeline, replicas or offloaded state).
    optimizer_in_backward: bool = False
    # recipes.grpo: completions a device samples at once (its KV cache's rows); 0: no generation phase.
    generation_batch: int = 0
    # recipes.grpo on FSDP2 shards: each layer gathered at its first forward of a round's sampling and kept until the
    # round's completions are all sampled (train/parallel.gathered), rather than gathered again for every decode step.
    gather_for_generation: bool = False

    def __post_init__(self):
        assert self.num_devices % (self.tensor_parallel * self.pipeline_stages) == 0, self
        assert (self.pipeline_stages > 1) == (self.pipeline_schedule != "none"), self
        assert len(self.stage_layers) == (self.pipeline_stages * self.stages_per_device if self.pipeline_stages > 1 else 0)
        assert self.data_parallel % self.expert_parallel == 0 and not (self.expert_parallel > 1 and self.replicate), self
        assert self.num_devices % (self.tensor_parallel * self.pipeline_stages * self.context_parallel) == 0, self
        assert (self.context_parallel > 1) == (self.context_parallel_way != "none"), self
        assert self.context_parallel == 1 or (self.packing and not self.replicate), self
        assert not self.offload_activations or self.recompute == "full", self
        assert self.tiled_mlp == 0 or (self.tiled_mlp > 1 and self.tensor_parallel == 1), self
        assert not self.optimizer_in_backward or not (self.pipeline_stages > 1 or self.replicate or self.cpu_offload), self

    @property
    def data_parallel(self) -> int:
        """How many copies of the model (each over tensor x pipeline x context devices) split the global batch."""
        return self.num_devices // (self.tensor_parallel * self.pipeline_stages * self.context_parallel)

    @property
    def stages_per_device(self) -> int:
        return stages_per_device(self.pipeline_schedule)

    def stage_ranges(self) -> list[range]:
        """The layers of each stage (stage s runs on the pipeline devices' s mod pipeline_stages)."""
        out, first = [], 0
        for n in self.stage_layers:
            out.append(range(first, first + n))
            first += n
        return out

    @staticmethod
    def device_share(batch_size: int, num_devices: int) -> int:
        """Sequences per device of a global batch of `batch_size` (the last ranks' shares padded to it)."""
        return math.ceil(batch_size / num_devices)

    @property
    def batch_per_device(self) -> int:
        """Sequences of a global batch per copy of the model (a device's own, without tensor or pipeline cuts)."""
        return self.device_share(self.batch_size, self.data_parallel)

    @property
    def token_budget(self) -> int:
        """Tokens of a micro-batch at most: what memory is planned for."""
        return self.micro_batch_size * self.max_seq_len

    @property
    def row_length(self) -> int:
        """Tokens of a row at most: a padded row's longest sample, a packed row's budget (the model's max_seq_len)."""
        return self.padded_row(self.token_budget if self.packing else self.max_seq_len)

    def padded_row(self, tokens: int) -> int:
        """A row of `tokens` padded: to a multiple of the tensor-parallel degree (sequence parallelism cuts a row
        into equal shares) and, with row_sizes = k, of 2^p / k for a row of 2^p to 2^(p+1) tokens (at most 1/k more
        tokens). Never less for more tokens, so row_length bounds every row. Context parallelism cuts a row into
        2 x context_parallel equal chunks, and each device's share again into tensor_parallel ones."""
        step = self.tensor_parallel
        if self.context_parallel > 1:
            step = math.lcm(2 * self.context_parallel, self.context_parallel * self.tensor_parallel)
        if self.row_sizes and tokens > 1:
            step = math.lcm(step, max(1, (1 << (tokens.bit_length() - 1)) // self.row_sizes))
        return -(-tokens // step) * step

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 wraps the model: where it shards over several devices, offloads to the CPU, or casts one
        copy to a lower compute dtype layer by layer (cut, or resharded after the forward). Otherwise one process
        keeps a plain module: there FSDP2's all-gathers and reduce-scatters are copies of every layer in and out, a
        fifth of a CPU step at 24M parameters in fp32 (measured); a lower compute dtype is cast by casts_copies.
        Replicated processes keep plain modules too."""
        lower = self.param_dtype != self.master_dtype
        # One uncut copy computing below its master dtype: FSDP2 casting layer by layer, resharded after the forward
        # (a layer or two in the compute dtype at a time), or casts_copies, the whole model's copies held through
        # the step (no reshard: faster, the memory of the whole model in the compute dtype).
        one_copy_cast = lower and (self.cut or self.reshard_after_forward)
        return not self.replicate and (self.data_parallel * self.context_parallel > 1 or self.cpu_offload
                                       or one_copy_cast)

    @property
    def cut(self) -> bool:
        """Whether the model is cut over devices: pipeline stages or tensor parallelism."""
        return self.pipeline_stages > 1 or self.tensor_parallel > 1

    @property
    def casts_copies(self) -> bool:
        """Whether a plain module computes on copies of its master weights in the lower compute dtype
        (train/mixed_precision.py): FSDP2 does that for a sharded or cut model."""
        return not self.sharded and self.param_dtype != self.master_dtype

    @property
    def shards(self) -> int:
        """How many pieces FSDP2 cuts a device's parameters, gradients and optimizer state into (1: none)."""
        return self.data_parallel * self.context_parallel if self.sharded else 1

    def rank_share(self, indices: list[int], lengths: list[int], rank: int) -> list[int]:
        """Data rank `rank`'s share of a step's global batch (dataset indices, with their lengths), in the global
        batch's order. The ranks' work is balanced, not their sample counts: the slowest rank sets the step's
        time. A sample's work is its tokens, with its attention's (attention_length). Longest first, each sample
        goes to the rank with the least work so far (ties: the lowest rank), so every rank computes the same
        split. The shares together are exactly the global batch."""
        work = [n * (1 + n / self.attention_length) if self.attention_length else n for n in lengths]
        loads, owner = [0.0] * self.data_parallel, [0] * len(indices)
        for pos in sorted(range(len(indices)), key=lambda p: (-lengths[p], p)):
            owner[pos] = min(range(self.data_parallel), key=lambda r: (loads[r], r))
            loads[owner[pos]] += work[pos]
        return [i for i, r in zip(indices, owner) if r == rank]

    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """A rank's share (its samples' lengths, in order) as micro-batches of positions in the share: up to
        micro_batch_size samples each, padded to their longest; packed, as many samples in order as fit the
        token budget in one row."""
        if not self.packing:
            m = self.micro_batch_size
            return [list(range(i, min(i + m, len(lengths)))) for i in range(0, len(lengths), m)]
        rows, used = [], self.token_budget
        for pos, n in enumerate(lengths):
            if used + n > self.token_budget:
                rows.append([])
                used = 0
            rows[-1].append(pos)
            used += n
        return rows

    def as_dict(self) -> dict:
        return {**asdict(self), "batch_per_device": self.batch_per_device, "sharded": self.sharded,
                "data_parallel": self.data_parallel}

    def describe(self) -> str:
        split = (f"packed rows of up to {self.token_budget} tokens (up to {self.accumulation_steps} a step)"
                 if self.packing else f"micro_batch_size {self.micro_batch_size}, num_micro_batches {self.accumulation_steps}")
        if self.row_sizes:
            split += f" (rows padded to one of {self.row_sizes} sizes per doubling)"
        return (f"batch {self.batch_size} over {self.num_devices} device(s): {self.layout()}, batch_per_device "
                f"{self.batch_per_device}, {split}, recomputation {self.recompute}, {self._distribution()}, cpu_offload "
                f"{str(self.cpu_offload).lower()}, chunked loss {str(self.chunked_loss).lower()}, {self.param_dtype} "
                f"compute, {self.master_dtype} master weights, {self.optimizer_states} AdamW states, "
                f"{'compiled' if self.compile else 'eager'} layers"
                + (", activations offloaded to the host" if self.offload_activations else "")
                + (f", MLP in {self.tiled_mlp} tiles" if self.tiled_mlp else "")
                + (", optimizer in the backward" if self.optimizer_in_backward else "")
                + (f", {self.generation_batch} completions sampled at once" if self.generation_batch else "")
                + (" on weights gathered once" if self.gather_for_generation else ""))

    def layout(self) -> str:
        """The reference's words for the mesh: `num_stages : 2 (1f1b), TP 2, DP 4` (and `EP 2` where the experts are
        split over two of the data-parallel devices)."""
        stages = f"num_stages {self.pipeline_stages}" + (f" ({self.pipeline_schedule})" if self.pipeline_stages > 1 else "")
        tensor = f"TP {self.tensor_parallel}" if self.tensor_parallel > 1 else "No TP"
        experts = f", EP {self.expert_parallel}" if self.expert_parallel > 1 else ""
        context = f", CP {self.context_parallel} ({self.context_parallel_way})" if self.context_parallel > 1 else ""
        return f"{stages}, {tensor}, DP {self.data_parallel}{experts}{context}"

    def _distribution(self) -> str:
        if self.replicate:
            return (f"distribute_param false (replicated: a plain module on each of the {self.num_devices} processes, "
                    "one all-reduce of the gradients a step)")
        if not self.sharded and self.num_devices > 1:
            return (f"distribute_param false (one copy of the model, cut over its {self.num_devices} devices by its "
                    "stages and heads, no FSDP2)")
        if not self.sharded:
            cast = f" computing on {self.param_dtype} copies of its weights" if self.casts_copies else ""
            return f"distribute_param false (one device: a plain module{cast}, no FSDP2)"
        copies = f" over {self.data_parallel} copies" if self.data_parallel < self.num_devices else ""
        if self.context_parallel > 1:  # context devices hold shards too
            copies = f" sharded over data {self.data_parallel} x context {self.context_parallel} devices"
        return (f"distribute_param true (FSDP2{copies}, reshard_after_forward "
                f"{str(self.reshard_after_forward).lower()})")
