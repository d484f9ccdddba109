"""One epoch of TRL's SFTTrainer on tokenised documents, as a TRL user runs it: packed rows (best-fit decreasing,
each document attending to itself through its position ids), fp32 on the CPU, AdamW with a cosine schedule and
clipping. Run by bench/any_model_epoch.py as a job of its own, on the very token ids our run trains on (a JSONL of
`input_ids`: TRL takes a tokenised dataset as it is); its last line is a JSON object of what it trained.

    python bench/trl_sft.py CHECKPOINT TOKENS.jsonl OUT --max-length 2048 --rows 4 --lr 2e-5
    python bench/trl_sft.py ... --no-packing --rows 8    # padded batches of 8 documents
"""

import argparse
import json
import time
from pathlib import Path

BETAS, EPS, MAX_GRAD_NORM, WARMUP = (0.9, 0.95), 1e-8, 1.0, 2


def trainer(args, *, packing: bool):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(args.out / "trl"), packing=packing, max_length=args.max_length,
                       per_device_train_batch_size=args.rows, num_train_epochs=1,
                       learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=WARMUP, weight_decay=0.0,
                       adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM,
                       optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                       bf16=False, fp16=False, seed=args.seed, dataloader_num_workers=0, gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    data = load_dataset("json", data_files=str(args.data), split="train")
    return SFTTrainer(model=model, args=config, train_dataset=data,
                      processing_class=AutoTokenizer.from_pretrained(args.checkpoint))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("data", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--rows", type=int, default=4, help="packed rows of max-length tokens a step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-packing", dest="packing", action="store_false",
                   help="padded batches of --rows documents (where TRL cannot keep packed documents apart)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    t = trainer(args, packing=args.packing)
    t.train()
    t.save_model(str(args.out / "model"))
    steps = [h for h in t.state.log_history if "loss" in h]
    tokens = sum(len(json.loads(line)["input_ids"]) for line in args.data.read_text().splitlines() if line.strip())
    print(json.dumps({"steps": len(steps), "tokens": tokens, "seconds": time.perf_counter() - start,
                      "losses": [h["loss"] for h in steps]}))


if __name__ == "__main__":
    main()
