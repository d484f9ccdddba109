"""One epoch of TRL's SFTTrainer on picture rows, as a TRL user runs an image-text model: prompt-completion rows with
an images column (the loss on the completions only), the checkpoint's processor, fp32 on the CPU, AdamW with a cosine
schedule and clipping, padded batches. Run by bench/vision_epoch.py as a job of its own; its last line is a JSON
object of what it trained.

    python bench/trl_vision_sft.py CHECKPOINT ROWS.jsonl OUT --batch-size 16 --lr 2e-4
"""

import argparse
import json
import sys
import time
from pathlib import Path

BETAS, EPS, MAX_GRAD_NORM, WARMUP = (0.9, 0.95), 1e-8, 1.0, 2
ROOT = Path(__file__).resolve().parents[1]


def rows_and_tokens(path: Path, processor):
    """TRL's prompt-completion rows of our chat rows (the pictures opened), and the tokens they make (the processor's
    for each whole conversation: what both tools train on)."""
    from PIL import Image

    rows, tokens = [], 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        images = [Image.open(path.parent / p).convert("RGB") for p in row["images"]]
        messages = row["messages"]
        rows.append({"prompt": messages[:1], "completion": messages[1:], "images": images})
        text = processor.apply_chat_template(messages, tokenize=False)
        tokens += processor(text=[text], images=images, return_tensors="pt")["input_ids"].shape[1]
    return rows, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("rows", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    start = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(ROOT))
    from moai_recipes.data.images import load_processor  # the processor as ours reads it (no torchvision here)

    processor = load_processor(args.checkpoint)
    rows, tokens = rows_and_tokens(args.rows, processor)
    config = SFTConfig(output_dir=str(args.out / "trl"), max_length=None, per_device_train_batch_size=args.batch_size,
                       num_train_epochs=1, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=WARMUP,
                       weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
                       max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch", logging_steps=1, save_strategy="no",
                       report_to="none", use_cpu=True, bf16=False, fp16=False, seed=args.seed,
                       dataloader_num_workers=0, gradient_checkpointing=False)
    model = AutoModelForImageTextToText.from_pretrained(args.checkpoint, dtype=torch.float32,
                                                        attn_implementation="sdpa")
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=processor)
    trainer.train()
    trainer.model.save_pretrained(args.out / "model")  # (its processor has no video processor to save here)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"steps": len(steps), "tokens": tokens, "seconds": time.perf_counter() - start,
                      "losses": [h["loss"] for h in steps]}))


if __name__ == "__main__":
    main()
