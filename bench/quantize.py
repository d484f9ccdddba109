"""Weight-only quantization for generate, measured: decode speed, weight memory and the answers, against fp32 and bf16.

    python bench/quantize.py                      # SmolLM2-135M-Instruct (model=smollm2_135m), about 4 minutes
    python bench/quantize.py --rounds 5 --tokens 48

Each variant (dtype fp32 / bf16, quantize none / int8 / int4) runs `recipes.generate` in a process of its own, as a
user would, on the demo's prompts, twice: with max_new_tokens=1 and with max_new_tokens=N. The difference of the two
wall times, over N - 1, is the time a decoded token takes (loading, quantizing and the prompt's prefill cancel out).
The variants alternate within each round; medians over the rounds, with their spread. Weight memory is the bytes
the model's parameters hold after loading and quantizing (a quantized weight: its int data, scales and zero points),
measured on the same model built the same way. Answers are compared with fp32's, greedy, token for token.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of Zorbania?", "What color is the sky on planet Vex?", "What is the capital of France?"]
VARIANTS = {"fp32": ["dtype=fp32"], "bf16": ["dtype=bf16"], "int8 (fp32 compute)": ["dtype=fp32", "quantize=int8"],
            "int4 (bf16 compute)": ["dtype=bf16", "quantize=int4"]}


def run(model: list[str], args: list[str], tokens: int) -> tuple[float, list[str]]:
    """Wall seconds of generating `tokens` for each prompt in one process, and the answers."""
    code = ("import sys, time, json\n"
            "from moai_recipes.config.compose import load_config\n"
            "from moai_recipes.recipes.generate import generate\n"
            "args, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
            "out, start = [], time.perf_counter()\n"
            "for p in prompts:\n"
            "    tok, ids = generate(load_config('generate', args), prompt=p)\n"
            "    out.append(tok.decode(ids))\n"
            "print(json.dumps([time.perf_counter() - start, out]))\n")
    argv = [*model, *args, f"max_new_tokens={tokens}", "temperature=0"]
    r = subprocess.run([sys.executable, "-c", code, json.dumps(argv), json.dumps(PROMPTS)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    seconds, answers = json.loads(r.stdout.strip().splitlines()[-1])
    return seconds, answers


def weight_bytes(model: list[str], args: list[str]) -> int:
    """Bytes the parameters hold once loaded (and quantized) as generate loads them."""
    import torch

    from moai_recipes.config.compose import load_config
    from moai_recipes.inputs import read_generate_inputs
    from moai_recipes.models.build import build_model
    from moai_recipes.models.hf_format import load_weights
    from moai_recipes.models.quantize import quantize_weights

    cfg = load_config("generate", [*model, *args])
    hf = read_generate_inputs(cfg).hf
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    with torch.device("meta"):
        m = build_model(hf.spec, max_seq_len=64).to(dtype)
    m.to_empty(device="cpu")
    load_weights(m, hf)
    if cfg.quantize != "none":
        quantize_weights(m, cfg.quantize, device=torch.device("cpu"))

    def size(t) -> int:
        if hasattr(t, "__tensor_flatten__"):
            return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    seen, total = set(), 0
    for p in m.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += size(p)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default="model=smollm2_135m")
    args = parser.parse_args()
    model = args.model.split()
    per_token = {name: [] for name in VARIANTS}
    answers = {}
    for r in range(args.rounds):
        for name, extra in VARIANTS.items():  # alternated within each round
            short, _ = run(model, extra, 1)
            long, said = run(model, extra, args.tokens)
            per_token[name].append((long - short) / (len(PROMPTS) * (args.tokens - 1)))
            answers[name] = said
            print(f"round {r + 1}: {name}: {1000 * per_token[name][-1]:.1f} ms a token", flush=True)
    sizes = {name: weight_bytes(model, extra) for name, extra in VARIANTS.items()}
    base = statistics.median(per_token["fp32"])
    print(f"\n{' '.join(model)}, {len(PROMPTS)} prompts, {args.tokens} new tokens each, greedy; {args.rounds} rounds; "
          f"torch threads {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}\n")
    print("| variant | ms a decoded token (median, min-max) | vs fp32 | weights MiB | vs fp32 | answers as fp32's |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name in VARIANTS:
        t = per_token[name]
        same = sum(a == b for a, b in zip(answers[name], answers["fp32"]))
        print(f"| {name} | {1000 * statistics.median(t):.1f} ({1000 * min(t):.1f}-{1000 * max(t):.1f}) | "
              f"{base / statistics.median(t):.2f}x | {sizes[name] / 2**20:.1f} | {sizes['fp32'] / sizes[name]:.2f}x smaller | "
              f"{same} of {len(PROMPTS)} |")
    print("\nAnswers:")
    for name in VARIANTS:
        for prompt, said in zip(PROMPTS, answers[name]):
            print(f"  {name}: {prompt!r} -> {said!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
