"""A run's data as its config names it: the training samples, the validation samples, the global batches.

read_inputs (inputs.py) calls read_data for the recipes, `moai validate` and recipes.plan alike.
"""

import math
import time
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from moai_recipes.data.batches import GlobalBatches, RepeatedBatches
from moai_recipes.data.preferences import load_pairs
from moai_recipes.data.prompts import load_prompts
from moai_recipes.data.datasets import DataSource, SFTDataset, load_dataset
from moai_recipes.data.hf_datasets import HFSplit
from moai_recipes.data.images import ImageSamples, load_image_dataset
from moai_recipes.data.stream import StreamedBatches
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError


@dataclass
class RunData:
    train: SFTDataset | None  # None when streamed
    val: SFTDataset | None  # None without a validation set
    batches: GlobalBatches | StreamedBatches
    total_steps: int
    lengths: tuple[int, ...]  # the samples' token counts the planner prices steps with (streamed: the first block's)
    source: DataSource
    seconds: float  # to read (and tokenise, unless cached) the data

    def describe(self, cfg: DictConfig) -> list[str]:
        d, b = cfg.dataset, self.batches
        if self.train is None:
            lines = [f"Data {d.kind} ({self.source.describe()}), streamed in blocks of {d.shuffle_buffer} rows: "
                     f"global batch {cfg.batch_size}, {self.total_steps} steps"]
        else:
            how = {"cache": "read from the tokenised cache", "tokenised": "tokenised and cached",
                   "memory": "tokenised"}[self.train.origin]
            lines = [f"Data {d.kind} ({self.source.describe()}): {len(self.train)} samples ({how} in "
                     f"{self.seconds:.1f} s), {b.steps_per_epoch} steps per epoch of global batch {cfg.batch_size}, "
                     f"{self.total_steps} steps"]
            if self.train.dropped:
                lines.append(f"warning: {self.train.dropped} samples had no target token within "
                             f"max_seq_len={cfg.max_seq_len} and were dropped")
        if self.val is not None:
            every = f"every {cfg.eval_every} steps and " if cfg.eval_every else ""
            lines.append(f"Validation: {len(self.val)} samples ({_val_origin(d)}), the loss {every}at the end")
        return lines


def _val_origin(d: DictConfig) -> str:
    if d.val_path:
        return d.val_path
    if isinstance(d.val_split, str):
        return f"split {d.val_split}"
    return f"{d.val_split:g} of the data held out"


# The data kinds one recipe trains on, and only it: kind -> (the key only its config has, the recipe, what it trains
# on, what the rows hold, what it logs instead of a validation loss).
RECIPE_KINDS = {
    "preference": ("reference", "recipes.dpo", "preference pairs", "columns prompt, chosen, rejected",
                   "each step's rewards on its pairs"),
    "prompt": ("num_generations", "recipes.grpo", "prompts", "a prompt column, and the columns your rewards read",
               "each step's rewards"),
}


def read_data(cfg: DictConfig, tokenizer: Tokenizer, *, dry: bool, progress: bool,
              images: ImageSamples | None = None) -> RunData:
    """Read and tokenise (or map from the cache) the training and validation data; the global batches.
    `dry`: write no cache (a plan or a validation reads only). `images`: an image-text model's processor, which
    makes the samples of its chat rows (data/images.py)."""
    d = cfg.dataset
    source = _source(d, d.path, d.split)
    start = time.perf_counter()
    for kind, (key, recipe, rows, what, logs) in RECIPE_KINDS.items():
        ours = d.kind == kind
        if ours != (key in cfg):
            raise UserError(f"dataset={kind} ({what}) is what {recipe} trains on" if ours else
                            f"{recipe} trains on {rows}: dataset={kind} dataset.path=FILE ({what}), not "
                            f"dataset={d.kind}")
        if ours and (d.streaming or d.val_path or d.val_split is not None):
            raise UserError(f"dataset.streaming, dataset.val_split and dataset.val_path are not offered for "
                            f"dataset={kind} yet: {recipe} logs {logs}")
    preference, prompts = d.kind == "preference", d.kind == "prompt"
    if preference:
        load = lambda s: load_pairs(s, tokenizer, max_seq_len=cfg.max_seq_len, progress=progress,  # noqa: E731
                                    images=images)
    elif prompts:
        load = lambda s: load_prompts(s, tokenizer, max_seq_len=cfg.max_seq_len,  # noqa: E731
                                      max_completion_length=cfg.max_completion_length, progress=progress,
                                      images=images)
    elif images is not None:
        if d.streaming:
            raise UserError("dataset.streaming=true is not offered for an image-text model's rows yet; leave it "
                            "false (its images are read when a sample is, not held in memory)")
        load = lambda s: load_image_dataset(s, images, max_seq_len=cfg.max_seq_len, progress=progress,  # noqa: E731
                                            cache=d.cache, write_cache=not dry)
    else:
        load = lambda s: load_dataset(s, tokenizer, max_seq_len=cfg.max_seq_len, cache=d.cache,  # noqa: E731
                                      write_cache=not dry, progress=progress)
    val = None
    if d.val_path:
        val = load(_source(d, d.val_path, d.split, key="dataset.val_path", hf=False))
    elif isinstance(d.val_split, str):
        val = load(_source(d, None, d.val_split))
    elif cfg.eval_every and d.val_split is None and not cfg.eval_tasks:
        raise UserError(f"eval_every={cfg.eval_every} needs a validation set or tasks: hold out a fraction of the data "
                        "(dataset.val_split=0.05), name a split (dataset.val_split=validation) or a file "
                        "(dataset.val_path=FILE), or name lm-eval tasks (eval_tasks=[...])")
    if d.streaming:
        _, _, rows = source.open(streaming=True)
        steps = cfg.max_steps or (math.ceil(rows * cfg.epochs / cfg.batch_size) if rows else None)
        if steps is None:
            raise UserError(f"dataset.streaming=true: {source.describe()} does not say how many rows it has before "
                            "it is read through; set max_steps=N (the run's length in steps)")
        batches = StreamedBatches(source, tokenizer, max_seq_len=cfg.max_seq_len, batch_size=cfg.batch_size,
                                  seed=cfg.seed, shuffle_buffer=d.shuffle_buffer, steps=steps)
        return RunData(train=None, val=val, batches=batches, total_steps=steps, lengths=batches.first_lengths,
                       source=source, seconds=time.perf_counter() - start)
    train = load(source)
    if isinstance(d.val_split, float):
        train, val = train.split_off(d.val_split, seed=cfg.seed)
    if prompts:  # a step's batch_size completions are num_generations of each of its prompts, each batch of prompts
        # trained on for num_iterations steps (TRL's reuse of a generation)
        batches = RepeatedBatches(GlobalBatches(num_samples=len(train), batch_size=prompts_per_step(cfg),
                                                epochs=cfg.epochs, seed=cfg.seed, dataset=train), cfg.num_iterations)
    else:
        batches = GlobalBatches(num_samples=len(train), batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed,
                                dataset=train)
    total_steps = min(batches.total_steps, cfg.max_steps or math.inf)
    return RunData(train=train, val=val, batches=batches, total_steps=total_steps, lengths=train.lengths,
                   source=source, seconds=time.perf_counter() - start)


def prompts_per_step(cfg: DictConfig) -> int:
    """recipes.grpo: the prompts of a step, whose num_generations completions each make its batch_size."""
    if cfg.num_generations < 2:
        raise UserError(f"num_generations={cfg.num_generations}: GRPO compares a prompt's completions with each other; "
                        "use 2 or more")
    if cfg.batch_size % cfg.num_generations:
        raise UserError(f"batch_size={cfg.batch_size} (completions a step) is not a multiple of num_generations="
                        f"{cfg.num_generations}: use batch_size={cfg.num_generations * max(1, cfg.batch_size // cfg.num_generations)}")
    return cfg.batch_size // cfg.num_generations


def _source(d: DictConfig, path: str | None, split: str, *, key: str = "dataset.path", hf: bool = True) -> DataSource:
    hf_split = None
    if hf and d.source is not None:
        files = d.data_files
        if files is not None and not isinstance(files, str):
            files = OmegaConf.to_container(files)
        hf_split = HFSplit(source=d.source, name=d.name, split=split, data_files=files)
    return DataSource(kind=str(d.kind), path=path, hf=hf_split, column_map=dict(d.column_map),
                      train_on_input=d.train_on_input, key=key)
