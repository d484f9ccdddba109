"""llama.cpp's convert_hf_to_gguf.py run as its own command does, in a process of its own (models/llama_cpp_converter.py
calls it): python -m moai_recipes.models.llama_cpp_convert_run CONVERTER_DIR CHECKPOINT_DIR [its arguments].

Its gguf-py goes first on the path before anything imports the gguf package (the converter needs its own, newer
than the one installed). Around it, what llama_cpp_converter.py's docstring lists as ours: the tokenizer it cannot
name written as our writer writes it, the layers' attention pattern, DeepSeek-V3's sigmoid routing, no
multi-token-prediction layers where the checkpoint has none.
"""

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    source, folder, rest = Path(argv[0]), Path(argv[1]), argv[2:]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import convert_hf_to_gguf as converter

    config = json.loads((folder / "config.json").read_text())
    text = {**config, **(config.get("text_config") or {})}
    pick = converter.get_model_class

    def get_model_class(*args, **kwargs):
        cls = pick(*args, **kwargs)
        _adapt(cls, text)
        if getattr(cls, "supports_mtp_export", False) and not _has_mtp(folder):
            cls.no_mtp = True  # what its --no-mtp does
        return cls

    converter.get_model_class = get_model_class
    sys.argv = ["convert_hf_to_gguf.py", str(folder), *rest]
    converter.main()


def _adapt(cls, config: dict) -> None:
    """Our part of the converter's model class `cls` (changed in this process only)."""
    import gguf

    own_vocab, own_parameters = cls.set_vocab, cls.set_gguf_parameters

    def set_vocab(self):
        try:
            own_vocab(self)
        except (NotImplementedError, FileNotFoundError, ValueError, AssertionError) as error:
            # Not a tokenizer it knows by name (nor a SentencePiece one): ours, if it is byte-level BPE.
            from moai_recipes.models.gguf_export import byte_level_vocab

            try:
                tokens, types, pre, bos = byte_level_vocab(self.dir_model, self.hparams.get("vocab_size")
                                                           or config["vocab_size"])
            except Exception:
                raise error from None
            writer = self.gguf_writer
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(pre)
            writer.add_token_list(tokens)
            writer.add_token_types(types)
            writer.add_add_bos_token(bos)
            gguf.SpecialVocab(self.dir_model, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)

    def set_gguf_parameters(self):
        if config.get("model_type") == "deepseek_v3":  # transformers' DeepSeek-V3 routes by sigmoid, said or not
            self.hparams.setdefault("scoring_func", "sigmoid")
        own_parameters(self)
        kinds = config.get("layer_types") or []
        windowed = [kind in ("sliding_attention", "chunked_attention") for kind in kinds]
        key = gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=self.gguf_writer.arch)
        if any(windowed) and len(windowed) == self.block_count and not _written(self.gguf_writer, key):
            self.gguf_writer.add_sliding_window_pattern(windowed)

    cls.set_vocab, cls.set_gguf_parameters = set_vocab, set_gguf_parameters


def _written(writer, key: str) -> bool:
    return any(key in kv for kv in writer.kv_data)


def _has_mtp(folder: Path) -> bool:
    """Whether the checkpoint holds multi-token-prediction layers (Qwen3.5's mtp.*)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        names = [n for f in folder.glob("*.safetensors") for n in safe_open(f, "pt").keys()]
    return any(n.startswith(("mtp.", "model.mtp.")) for n in names)


if __name__ == "__main__":
    main(sys.argv[1:])
