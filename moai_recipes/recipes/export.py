"""Ship a model: write a run's model (or its adapter merged into the base) as one GGUF file that llama.cpp, Ollama
and LM Studio run, and ask it questions through llama.cpp to see that it answers as trained.

    python -m recipes.export model.checkpoint_dir=OUT/model                      # OUT/model-f16.gguf
    python -m recipes.export adapter_dir=OUT/adapter outtype=q8_0                # OUT/adapter-merged-q8_0.gguf
    python -m recipes.export adapter_dir=OUT/adapter outtype=q8_0 prompts='["What is the capital of France?"]'

`export` reads top to bottom: the checkpoint and the adapter, checked and matched -> the file, streamed one
tensor at a time, written aside and renamed (models/gguf_export.py) -> the prompts, answered by llama.cpp
(llama-cpp-python) from that file. The file's path goes to stdout, the rest to stderr.
"""

import sys
from pathlib import Path

from omegaconf import DictConfig

from moai_recipes.config.compose import load_config
from moai_recipes.errors import UserError, exit_on_user_error
from moai_recipes.files import in_units
from moai_recipes.inference import llama_cpp
from moai_recipes.inputs import model_and_adapter
from moai_recipes.models.gguf_export import Exported, export_gguf, source_type

RECIPE = "export"


def export(cfg: DictConfig) -> Exported:
    say = lambda *a: print(*a, file=sys.stderr, flush=True)

    # 1. The checkpoint and the adapter, checked and matched before anything is written.
    hf, adapter = model_and_adapter(cfg)
    outtype = source_type(hf) if cfg.outtype == "auto" else str(cfg.outtype)
    if cfg.out:
        out = Path(cfg.out).expanduser()
        if out.suffix != ".gguf":
            raise UserError(f"out={cfg.out}: a GGUF file's name ends in .gguf")
    elif adapter:
        out = adapter.folder.parent / f"{adapter.folder.name}-merged-{outtype}.gguf"
    else:
        out = hf.folder.parent / f"{hf.folder.name}-{outtype}.gguf"
    if cfg.prompts:
        llama_cpp.require()

    # 2. The file.
    say(f"Writing {hf.folder}" + (f" with the adapter {adapter.folder} merged" if adapter else "")
        + f" as GGUF ({outtype}) to {out}")
    done = export_gguf(hf, out, fmt=outtype, adapter=adapter)
    say(f"Wrote {done.path}: {done.arch} architecture, {done.tensors} tensors, {in_units(done.bytes)}, "
        f"tokenizer pre-tokenizer {done.tokenizer_pre!r}")

    # 3. The prompts, answered by llama.cpp from the file just written.
    for prompt, answer in zip(cfg.prompts, llama_cpp.answers(done.path, list(cfg.prompts), max_new_tokens=cfg.max_new_tokens)):
        say(f"llama.cpp> {prompt}\n{answer}")
    return done


@exit_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(RECIPE, sys.argv[1:] if argv is None else argv)
    print(export(cfg).path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
