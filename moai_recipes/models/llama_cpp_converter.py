"""A model our own GGUF writer does not lay out (models/gguf_export.py: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral),
written as GGUF by llama.cpp's own converter, convert_hf_to_gguf.py: the authority on how each architecture it runs
is laid out (Gemma 3/4, gpt-oss, Qwen3.5, DeepSeek-V3, GLM-4.5, Llama 4, Phi-4, SmolLM3 and the rest of its list).

The converter is not a package on PyPI: it ships in llama-cpp-python's source distribution (vendor/llama.cpp), the
very llama.cpp that reads the file. It is fetched once (`pip download --no-binary`) for the installed
llama-cpp-python's version (the newest where none is installed) and its convert_hf_to_gguf.py, conversion/ and
gguf-py/ kept in the cache; MOAI_LLAMA_CPP=DIR names a llama.cpp source folder instead (a machine without the package
index). It runs in a process of its own, its gguf-py first on the path (models/llama_cpp_convert_run.py), on the
checkpoint as it is or, with an adapter, on the merged model written aside first.

What is ours at this boundary (the rest is llama.cpp's):
- a tokenizer the converter cannot name (it knows released models' tokenizers by a hash of their output; one made
  here is not among them) is written as our own writer writes it (gguf_export.byte_level_vocab);
- the layers' pattern of sliding or chunked attention, from config.json's layer_types (llama.cpp assumes its own
  fixed pattern where the file has none: a Gemma 3 with another one would attend otherwise);
- transformers' DeepSeek-V3 always routes by sigmoid and its config.json need not say so (the Hub's does): said;
- a checkpoint without multi-token-prediction layers converts without them;
- what llama.cpp fixes for an architecture whatever the file says, checked against config.json: refused by name where
  they differ (the file would compute another model).
Test: `python -m pytest tests/test_export.py -q -k converter`.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from moai_recipes import env
from moai_recipes.errors import UserError
from moai_recipes.files import free_bytes, in_units, remove, room_for

# What llama.cpp's model code fixes whatever the file says (src/models/*.cpp): config.json field, its value there,
# and when it applies.
_FIXED = {
    "llama4_text": [("attention_chunk_size", 8192, lambda c: "chunked_attention" in (c.get("layer_types") or [])),
                    ("no_rope_layer_interval", 4, lambda c: True),
                    ("floor_scale", 8192, lambda c: c.get("attn_temperature_tuning")),
                    ("attn_scale", 0.1, lambda c: c.get("attn_temperature_tuning"))],
    "smollm3": [("no_rope_layer_interval", 4, lambda c: True)],
}
# Qwen3.5 always rotates by interleaved MRoPE: the sections the converter writes where config.json gives none.
_MROPE_DEFAULT = {"qwen3_5_text": [11, 11, 10], "qwen3_5_moe_text": [11, 11, 10]}
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def convert(folder: Path, out: Path, *, fmt: str, config: dict) -> None:
    """Write the checkpoint `folder` (config.json's text part: `config`) to `out` as GGUF in `fmt`, through llama.cpp's
    converter: written aside and renamed; what it cannot write is refused by name (UserError)."""
    check(config, folder)
    source = converter()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) * (2 if fmt == "f32" else 1) + 2**20
    if free_bytes(out.parent) < size:
        raise UserError(f"{out} needs about {in_units(size)}, but its disk has {in_units(free_bytes(out.parent))} "
                        "free; free space there or write elsewhere (out=FILE.gguf)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with room_for(out.parent, f"the GGUF file {out.name}", needed=size, aside=[tmp]):
        try:
            r = subprocess.run([sys.executable, "-m", "moai_recipes.models.llama_cpp_convert_run", str(source),
                                str(folder), "--outfile", str(tmp), "--outtype", fmt], capture_output=True, text=True,
                               env=env.with_python_path(Path(__file__).resolve().parents[2]))
            if r.returncode != 0:
                raise UserError(f"llama.cpp's converter ({source}) could not write {folder} as GGUF: "
                                f"{_last_error(r.stderr)}")
            time.sleep(env.fault_save_delay())  # a test's window to kill an export half-done
            os.replace(tmp, out)
        except BaseException:
            remove([tmp])
            raise


def check(config: dict, folder: Path) -> None:
    """Refuse (UserError) what llama.cpp would compute otherwise than `config` says."""
    kind = config.get("model_type")
    for field, fixed, applies in _FIXED.get(kind, ()):
        value = config.get(field)
        if applies(config) and value is not None and value != fixed:
            raise UserError(f"{folder}/config.json has {field}={value}, and llama.cpp's {kind} architecture fixes it "
                            f"at {fixed}: the GGUF file would compute another model. Export a checkpoint with "
                            f"{field}={fixed} (as the released models have)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if sections is None and kind in _MROPE_DEFAULT:  # the converter writes the upstream default in its place
        sections = _MROPE_DEFAULT[kind]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotated = int(head_dim * (rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0))
    if sections and 2 * sum(sections) > rotated:
        raise UserError(f"{folder}/config.json's mrope_section {sections} covers {2 * sum(sections)} rotary dimensions "
                        f"of the {rotated} its heads rotate, which llama.cpp refuses (it stops on an assertion)")


def converter() -> Path:
    """A folder holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/: MOAI_LLAMA_CPP's, else the one
    fetched for the installed llama-cpp-python's version (once; the newest where none is installed)."""
    given = env.llama_cpp_source()
    if given is not None:
        if not (given / "convert_hf_to_gguf.py").is_file():
            raise UserError(f"MOAI_LLAMA_CPP={given} is not a llama.cpp source folder (no convert_hf_to_gguf.py)")
        return given
    version = _installed_version()
    folder = env.cache_dir() / f"llama.cpp-converter-{version or 'newest'}"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    print(f"Fetching llama.cpp's converter with {requirement}'s source from the package index (once): {folder}",
          file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        # The source archive of this package alone: pip prepares its metadata in a build environment, whose own
        # requirements (scikit-build-core and the rest) `--no-binary :all:` had built from source too. And not through
        # pip's HTTP cache: the folder kept here is the cache, and pip (23.2) spent 40 s of CPU storing the 77 MB
        # archive in its own. Fresh home, 2026-11-28: 103 s (45 s of CPU) before, 17 s (4.5 s of CPU) now.
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                            "--quiet", "--no-cache-dir", "--dest", str(tmp), requirement], capture_output=True,
                           text=True)
        archives = sorted(tmp.glob("*.tar.gz"))
        if r.returncode != 0 or not archives:
            why = (r.stderr.strip().splitlines() or ["no source archive"])[-1]
            raise UserError(f"GGUF export of this architecture runs llama.cpp's converter, and {requirement}'s source "
                            f"could not be fetched ({why}). Check the network to the package index, or point "
                            "MOAI_LLAMA_CPP=DIR at a llama.cpp source folder")
        _extract(archives[0], tmp / "converter")
        try:
            os.rename(tmp / "converter", folder)
        except OSError:  # another process fetched it first
            if not (folder / "convert_hf_to_gguf.py").is_file():
                raise
        return folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract(archive: Path, into: Path) -> None:
    """The converter's files of llama-cpp-python's source archive (its vendor/llama.cpp), into `into`."""
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not (member.isfile() or member.isdir()):
                continue
            inner = "/".join(parts[3:])
            if any(inner == m or inner.startswith(m) for m in _MEMBERS):
                target = into / inner
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    if not (into / "convert_hf_to_gguf.py").is_file():
        raise UserError(f"{archive.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")


def _installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def _last_error(stderr: str) -> str:
    """The converter's own words for what stopped it: the last line of its traceback or log."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or line.startswith("ERROR")]
    return (errors or lines or ["no message"])[-1][:500]


def described(path: Path) -> tuple[str, int, str]:
    """(architecture, tensors, tokenizer pre-tokenizer) of a GGUF file, as the file says."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def text(key: str) -> str:
        field = reader.fields.get(key)
        return bytes(field.parts[field.data[0]]).decode() if field is not None else ""

    return text("general.architecture"), len(reader.tensors), text("tokenizer.ggml.pre")
