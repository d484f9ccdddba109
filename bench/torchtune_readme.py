"""Our planner's predictions against the two performance tables of torchtune's README (measured by torchtune on named
GPUs; no GPU is lent here, so ours are predictions, `recipes.plan` as a user runs it).

    python bench/torchtune_readme.py        # about a minute: two markdown tables

1. "Memory and training speed": Llama 3.1 at batch 2 a GPU, packed to 2,048 tokens, compiled. Ours: the planner's own
   choice for the same model, method, GPUs and global batch, in torchtune's storage (precision=bf16: weights,
   gradients and AdamW moments in bf16; QLoRA and LoRA keep their adapters so too).
2. "Optimization flags": Llama 3.2 3B full fine-tuning on one A100 80GB, batch 2 x 4,096 tokens, bf16, each technique
   added on top of the previous one. Ours: the same techniques forced (`plan.*=`), so each row compares one plan with
   the plan torchtune ran; and, last, the planner's free choice for the row the issue names (packed, no flags).
   Two differ: our 8-bit AdamW (torchao's) keeps fp32 master weights (with bf16 ones its state does not load back
   from a checkpoint, planner/search.stored_dtypes), torchtune's (bitsandbytes') bf16 ones; and we do not offload
   activations from compiled layers, so the LoRA rows leave compiling and offloading to the planner.

torchtune counts the tokens a step trains on (labels not ignored); ours are the step's tokens (a packed row is full).
"""

import json
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moai_recipes.recipes.plan import main as plan_main  # noqa: E402

GPU = {"4090": ["flavor.device=rtx4090", "flavor.memory_gb=24"], "A6000": ["flavor.device=a6000", "flavor.memory_gb=48"],
       "A100": ["flavor.device=a100", "flavor.memory_gb=80"], "8x A100": ["flavor.device=a100", "flavor.memory_gb=640"]}
METHOD = {"full": [], "LoRA": ["method=lora"], "QLoRA": ["method=lora", "lora.quantize_base=true"]}
MODEL = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}
GiB = 2**30
# torchtune's storage and its configs' clipping: bf16 weights, gradients and moments; no clipping (clip_grad_norm: null
# in every config these rows run), so the optimizer may run in the backward.
TORCHTUNE = ["precision=bf16", "optimizer.max_grad_norm=null"]

# (model, method, GPUs, torchtune's peak a GPU in GiB, torchtune's tokens/s)
HARDWARE = [("8B", "full", "4090", 18.9, 1650), ("8B", "full", "A6000", 37.4, 2579), ("8B", "LoRA", "4090", 16.2, 3083),
            ("8B", "LoRA", "A6000", 30.3, 4699), ("8B", "QLoRA", "4090", 7.4, 2413), ("70B", "full", "8x A100", 13.9, 1568),
            ("70B", "LoRA", "8x A100", 27.6, 3497), ("405B", "QLoRA", "8x A100", 44.8 * 1e9 / GiB, 653)]

# (technique, what it adds to the previous row's settings, torchtune's peak active GiB, tokens/s); "=" starts afresh
# from the packed row (LoRA and QLoRA: "which do not use optimizer_in_bwd or AdamW8bit").
PACKED = ["plan.packing=true", "plan.compile=false", "plan.chunked_loss=false", "plan.recompute=none",
          "plan.offload_activations=false", "plan.cpu_offload=false", "plan.optimizer_in_backward=false"]
FLAGS = [("+ packed dataset", PACKED, 60.0, 7075),
         ("+ compile", ["plan.compile=true"], 51.0, 8998),
         ("+ chunked cross entropy", ["plan.chunked_loss=true"], 42.9, 9174),
         ("+ activation checkpointing", ["plan.recompute=full"], 24.9, 7210),
         ("+ optimizer step in the backward", ["plan.optimizer_in_backward=true"], 23.1, 7309),
         # torchtune offloads from compiled layers; ours are not compiled then (the same offload, eager layers).
         ("+ activation offloading", ["plan.offload_activations=true", "plan.compile=false"], 21.8, 7301),
         ("+ 8-bit AdamW", ["optimizer.states=int8", "precision=mixed"], 17.6, 6960),
         # torchtune compiles and offloads together; we do not (offloading is not compiled): the planner picks one.
         ("LoRA", ["=", *PACKED[:1], "plan.chunked_loss=true", "plan.recompute=full", "method=lora"], 8.5, 8210),
         ("QLoRA", ["lora.quantize_base=true"], 4.6, 8035)]


def plan(args: list[str]) -> dict | str:
    """The chosen candidate of `recipes.plan args` (plan.json), or the first line of its refusal."""
    with tempfile.TemporaryDirectory() as out:
        text = StringIO()
        try:
            with redirect_stdout(text), redirect_stderr(text):
                code = plan_main([*args, f"output_dir={out}"])
        except SystemExit as e:
            code = e.code
        if code != 0:
            return "refused: " + text.getvalue().strip().splitlines()[-1][:160]
        return json.loads((Path(out) / "plan.json").read_text())["chosen"]


def describe(c: dict) -> str:
    parts = [f"TP {c['tensor_parallel']}" if c["tensor_parallel"] > 1 else "",
             f"FSDP2 over {c['data_parallel']}" if c["data_parallel"] > 1 else "one device",
             f"recompute {c['recompute']}", "compiled" if c["compile"] else "", "chunked loss" if c["chunked_loss"] else "",
             "state offloaded" if c["cpu_offload"] else "", "activations offloaded" if c["offload_activations"] else "",
             "optimizer in backward" if c.get("optimizer_in_backward") else ""]
    return ", ".join(p for p in parts if p)


def row(c: dict | str, tokens: int, peak: float, theirs: int) -> str:
    if isinstance(c, str):
        return f"{peak:.1f} GiB, {theirs:,} | {c} | |"
    ours = tokens / c["predicted_step_s"]
    return (f"{peak:.1f} GiB, {theirs:,} | {describe(c)}: {c['predicted_peak_bytes'] / GiB:.1f} GiB, {ours:,.0f} "
            f"({c['predicted_step_s']:.3g} s a step) | {ours / theirs:.2f} |")


def main() -> None:
    print("| model | method | GPUs | torchtune: peak a GPU, tokens/s (measured) | ours: plan, peak a GPU, tokens/s "
          "(predicted) | ours / theirs |\n|---|---|---|---|---|---|")
    for model, method, gpus, peak, theirs in HARDWARE:
        n = 8 if gpus.startswith("8x") else 1
        args = ["flavor=small", *GPU[gpus], f"model={MODEL[model]}", *METHOD[method], f"batch_size={2 * n}",
                "max_seq_len=2048", "plan.packing=true", *TORCHTUNE]
        print(f"| Llama 3.1 {model} | {method} | {gpus} | " + row(plan(args), 2 * n * 2048, peak, theirs), flush=True)
    print("\n| technique (each on top of the row above) | torchtune: peak, tokens/s (measured) | ours, forced so: plan, "
          "peak, tokens/s (predicted) | ours / theirs |\n|---|---|---|---|")
    base = ["flavor=small", *GPU["A100"], "model=llama3_2_3b", "batch_size=2", "max_seq_len=4096", *TORCHTUNE]
    settings: list[str] = []
    for name, adds, peak, theirs in FLAGS:
        settings = adds[1:] if adds[:1] == ["="] else [*settings, *adds]
        print(f"| {name} | " + row(plan([*base, *settings]), 2 * 4096, peak, theirs), flush=True)
    free = plan([*base, "plan.packing=true"])
    print(f"\nThe planner's own choice for the packed 3B row: {row(free, 2 * 4096, 60.0, 7075)}")


if __name__ == "__main__":
    main()
