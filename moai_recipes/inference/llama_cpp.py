"""llama.cpp, through llama-cpp-python, asked about a GGUF file: the client a shipped model meets.

The one boundary to llama-cpp-python (an optional dependency: it builds llama.cpp from source when installed,
a few minutes once). Greedy, with the chat template the file carries, as `llama-cli` and Ollama use it.
Test: `python -m pytest tests/test_export.py -q`.
"""

import os
from pathlib import Path

from moai_recipes.errors import UserError


def require() -> None:
    """Refuses (UserError) where llama-cpp-python is not installed: before a file is written to be asked."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise UserError("prompts= asks the file through llama.cpp, and llama-cpp-python is not installed: "
                        "pip install llama-cpp-python (or `make demo-gguf`, or pip install 'moai-recipes[gguf]'; it "
                        "builds llama.cpp from source, about 5 minutes once), or leave prompts= empty to write the "
                        "file only") from None


def _llama(path: Path, *, n_ctx: int = 2048, logits_all: bool = False, f32_cache: bool = False):
    require()
    from llama_cpp import Llama

    # llama.cpp prints its load log on the C side's stderr even with verbose=False: silenced at the descriptor.
    with open(os.devnull, "w") as null:
        fd = os.dup(2)
        os.dup2(null.fileno(), 2)
        try:
            return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False, seed=0,
                         logits_all=logits_all, **({"type_k": 0, "type_v": 0} if f32_cache else {}))
        except ValueError as e:  # llama-cpp-python's words for a file llama.cpp refused
            raise UserError(f"llama.cpp cannot load {path} ({e})") from None
        finally:
            os.dup2(fd, 2)
            os.close(fd)


def answers(path: Path, prompts: list[str], *, max_new_tokens: int) -> list[str]:
    """llama.cpp's greedy answer to each prompt as a user turn of the file's chat template."""
    if not prompts:
        return []
    llm = _llama(path)
    out = []
    for prompt in prompts:
        reply = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], temperature=0.0,
                                           top_k=1, max_tokens=max_new_tokens)
        out.append(reply["choices"][0]["message"]["content"].strip())
    return out


def greedy_tokens(path: Path, ids: list[int], *, max_new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of the token ids `ids` (no template, no tokenizer: the model alone), stopping
    at an end-of-generation token as llama.cpp's own loop does."""
    llm = _llama(path)
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if llm.token_eos() == token or _is_end(llm, token) or len(out) == max_new_tokens:
            break
        out.append(token)
    return out


def logits(path: Path, ids: list[int]):
    """llama.cpp's logits [len(ids), vocabulary] (numpy, fp32) of the token ids `ids`, every position's."""
    import numpy as np

    llm = _llama(path, n_ctx=max(64, len(ids)), logits_all=True, f32_cache=True)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def tokenize(path: Path, text: str) -> list[int]:
    """llama.cpp's tokens for `text` (special tokens parsed, no BOS added): to compare with the model's tokenizer."""
    llm = _llama(path, n_ctx=64)
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def _is_end(llm, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token))
