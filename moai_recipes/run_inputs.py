"""What a training run reads before its first step: its folder, the checkpoint, the tokenizer, the data.

Every rank reads the same; a mistake in any of them is a UserError before anything is written.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig

from moai_recipes.checkpoint.run_folder import check_output_dir
from moai_recipes.checkpoint.steps import read_meta
from moai_recipes.data.batches import GlobalBatches
from moai_recipes.data.datasets import SFTDataset, load_dataset
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.models.hf_format import HFCheckpoint
from moai_recipes.models.sources import model_source, resolve_checkpoint_dir


@dataclass
class RunInputs:
    out: Path
    ckpt: HFCheckpoint
    tokenizer: Tokenizer
    dataset: SFTDataset
    batches: GlobalBatches
    total_steps: int
    resume_from: Path | None  # a complete checkpoint to continue from

    @property
    def resume_step(self) -> int:
        return read_meta(self.resume_from)["step"] if self.resume_from else 0


def read_inputs(cfg: DictConfig) -> RunInputs:
    """Check the output folder, describe the checkpoint (no weights yet), tokenise the data."""
    # Restarted workers of this very run (by us or by torchrun) may find their own folder without a checkpoint.
    restarting = any(int(os.environ.get(v, "0")) > 0 for v in ("MOAI_RESTART", "TORCHELASTIC_RESTART_COUNT"))
    out, resume_from = check_output_dir(cfg, restarting=restarting)
    dist.barrier()  # every rank has checked before rank 0 writes anything
    ckpt = HFCheckpoint.open(resolve_checkpoint_dir(**model_source(cfg)))
    cfg.model.checkpoint_dir = str(ckpt.folder)  # config.yaml records where the weights came from
    tokenizer = Tokenizer.from_checkpoint(ckpt.folder)
    dataset = load_dataset(kind=cfg.dataset.kind, path=cfg.dataset.path, tokenizer=tokenizer,
                           max_seq_len=cfg.max_seq_len, column_map=dict(cfg.dataset.column_map),
                           train_on_input=cfg.dataset.train_on_input)
    batches = GlobalBatches(num_samples=len(dataset), batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed)
    total_steps = min(batches.total_steps, cfg.max_steps or math.inf)
    return RunInputs(out=out, ckpt=ckpt, tokenizer=tokenizer, dataset=dataset, batches=batches, total_steps=total_steps,
                     resume_from=resume_from)


def describe_inputs(inputs: RunInputs, cfg: DictConfig) -> list[str]:
    lines = [f"Model {cfg.model.name} from {inputs.ckpt.folder}: {inputs.ckpt.spec.family}, "
             f"{inputs.ckpt.spec.num_params() / 1e6:.1f}M parameters",
             f"Data: {len(inputs.dataset)} samples, {inputs.batches.steps_per_epoch} steps per epoch of global batch "
             f"{cfg.batch_size}, {inputs.total_steps} steps"]
    if inputs.dataset.dropped:
        lines.append(f"warning: {inputs.dataset.dropped} samples had no target token within "
                     f"max_seq_len={cfg.max_seq_len} and were dropped")
    return lines
