"""A torchtune tokenizer component for bench/vs_torchtune.py (imported by torchtune's recipe, not by ours).

torchtune 0.6.1's Llama 3 tokenizer reads a tiktoken file; our checkpoints carry a Hugging Face
tokenizer.json. torchtune's own HuggingFaceBaseTokenizer reads that file but is a BaseTokenizer:
it lacks the `max_seq_len` that text_completion_dataset truncates to and the `pad_id` that the
recipe's collate pads with. This subclass adds the two and nothing else, so the token ids are
exactly torchtune's: BOS + text + EOS, truncated by the dataset to max_seq_len - 1 tokens.

The benchmark puts this folder on torchtune's PYTHONPATH (never the repository root, whose
`recipes/` would shadow torchtune's) and names the component
`torchtune_components.hf_text_tokenizer` in the generated YAML.
"""

from pathlib import Path

from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer


class HFTextTokenizer(HuggingFaceBaseTokenizer):
    def __init__(self, checkpoint_dir: str, max_seq_len: int | None):
        folder = Path(checkpoint_dir)
        super().__init__(str(folder / "tokenizer.json"),
                         tokenizer_config_json_path=str(folder / "tokenizer_config.json"),
                         generation_config_path=str(folder / "generation_config.json"))
        self.max_seq_len = max_seq_len
        pad = self.config.get("pad_token") if self.config else None
        pad_id = self.tokenizer.token_to_id(pad) if isinstance(pad, str) else None
        self.pad_id = pad_id if pad_id is not None else self.eos_id


def hf_text_tokenizer(checkpoint_dir: str, max_seq_len: int | None = None) -> HFTextTokenizer:
    return HFTextTokenizer(checkpoint_dir, max_seq_len)
