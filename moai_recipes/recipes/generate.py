"""Sample from a Hugging Face checkpoint, or a PEFT LoRA adapter on its base: what our recipes wrote, or any other.

    python -m recipes.generate model.checkpoint_dir=OUT/model prompt="What is the capital of France?"
    python -m recipes.generate adapter_dir=OUT/adapter prompt="..." temperature=0.7 top_p=0.9 seed=1
    python -m recipes.generate model=llama3_8b model.checkpoint_dir=DIR device_map=balanced_low_0 prompt="..."

`generate` reads top to bottom: settings -> checkpoint (and adapter) -> prompt -> build on meta -> place
the blocks on the devices -> weights (the adapter merged, then quantized if asked) -> KV caches -> sample; `main` prints. With
several GPUs the layers are spread over them as Accelerate's device_map does; on the CPU everything runs
on the CPU. The completion alone goes to stdout; what was loaded and where, to stderr.
"""

import sys

from omegaconf import DictConfig

from moai_recipes.config.compose import load_config
from moai_recipes.data.tokenizer import Tokenizer, prompt_ids
from moai_recipes.errors import UserError, exit_on_user_error
from moai_recipes.inference.loading import load_for_inference
from moai_recipes.inference.sampling import complete
from moai_recipes.models.spec import check_context
from moai_recipes.inputs import read_generate_inputs

RECIPE = "generate"


def generate(cfg: DictConfig, *, prompt: str | None) -> tuple[Tokenizer, list[int]]:
    """The tokenizer and the tokens of the completion of `prompt`, as the command prints them."""
    say = lambda *a: print(*a, file=sys.stderr, flush=True)

    # 1. Settings, the checkpoint and the adapter, checked, described and matched before any weight is read.
    if not prompt:
        raise UserError('prompt="..." is required: the text to answer (chat=true) or to continue (chat=false)')
    inputs = read_generate_inputs(cfg)
    sampling, hf, tokenizer, adapter = inputs.sampling, inputs.hf, inputs.tokenizer, inputs.adapter
    spec = hf.spec
    ids = prompt_ids(tokenizer, prompt, chat=cfg.chat)
    max_seq_len = len(ids) + sampling.max_new_tokens
    if max_seq_len > spec.max_position_embeddings:
        raise UserError(f"the prompt ({len(ids)} tokens) and max_new_tokens={sampling.max_new_tokens} exceed the "
                        f"model's context of {spec.max_position_embeddings} tokens; lower max_new_tokens")
    check_context(spec, max_seq_len, what=f"the prompt plus max_new_tokens={sampling.max_new_tokens}",
                  fix="shorten the prompt or lower max_new_tokens")

    # 2. Build on meta, place whole blocks on the devices (KV caches counted), then give memory and weights.
    loaded = load_for_inference(cfg, hf, adapter, max_seq_len=max_seq_len)
    say(loaded.summary)

    # 3. Sample.
    return tokenizer, complete(loaded.model, ids, sampling=sampling, stop_ids=tokenizer.stop_ids, device=loaded.device)


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # prompt=TEXT is taken as typed: Hydra would read its commas, quotes, ${...}, `null` or `42` as syntax.
    typed = [a.partition("=")[2] for a in argv if a.startswith("prompt=")]
    cfg = load_config(RECIPE, [a for a in argv if not a.startswith("prompt=")])
    tokenizer, completion = generate(cfg, prompt=typed[-1] if typed else cfg.prompt)
    print(tokenizer.decode(completion), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
