"""The tokenizer boundary: a Hugging Face checkpoint's tokenizer, its chat template, and the loss mask.

Hugging Face's `tokenizers` reads tokenizer.json; BOS and EOS are the tokens tokenizer_config.json names, else the ids
generation_config.json gives (as torchtune's HuggingFaceBaseTokenizer infers them); the Jinja chat template is rendered
here as transformers renders it. Not torchtune's wrapper itself: it imports torchtune.data, and with it HF datasets,
pandas and pyarrow (0.9 s of every process that tokenizes, most of which read no HF dataset), for the three files
read here. Tested by `python -m pytest tests/test_data.py`.
"""

import hashlib
import json
import os
import re
from datetime import datetime
from pathlib import Path

import jinja2
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moai_recipes.errors import UserError

# Roles beyond system, user and assistant that chat templates render when they name them.
_TOOL_ROLES = ("tool", "ipython", "function", "developer", "observation")


def _token(config: dict, key: str) -> str | None:
    """A special token tokenizer_config.json names: a string, or an AddedToken as transformers saves one."""
    token = config.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"could not parse {key} from tokenizer_config.json")
    return token


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers' apply_chat_template uses."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the rendered prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _read_chat_template(folder: Path, config: dict) -> str | None:
    # Recent transformers save the template next to the config rather than inside it.
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # the older named-templates form
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


class Tokenizer:
    """Encode, decode and turn conversations into (tokens, loss mask) the way the checkpoint was trained."""

    def __init__(self, hf: tokenizers.Tokenizer, config: dict, generation_config: dict | None = None, *,
                 chat_template: str | None = None, name: str = "tokenizer"):
        """`hf`: tokenizer.json read by Hugging Face's tokenizers; `config`: tokenizer_config.json; `generation_config`:
        generation_config.json where there is one. ValueError where they name no EOS token."""
        self._hf, self.name = hf, name
        gen = generation_config or {}
        special = {k: _token(config, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self._special = {k: v for k, v in special.items() if v is not None}
        # Qwen names no BOS token: nothing is prepended then, but bos_id stays an int for callers.
        self._add_bos = "bos_token" in self._special and config.get("add_bos_token", True) is not False
        ids = {}
        for kind in ("bos", "eos"):
            token = self._special.get(f"{kind}_token")
            found = hf.token_to_id(token) if token is not None else None
            found = found if found is not None else gen.get(f"{kind}_token_id")
            ids[kind] = found[0] if isinstance(found, list) else found  # generation_config may list several
        if ids["eos"] is None:
            raise ValueError("could not infer the EOS token from tokenizer_config.json or generation_config.json")
        self.eos_id: int = ids["eos"]
        self.bos_id: int = ids["bos"] if ids["bos"] is not None else self.eos_id
        pad = self._special.get("pad_token")
        pad_id = self._hf.token_to_id(pad) if pad else None
        self.pad_id: int = pad_id if pad_id is not None else self.eos_id
        self.vocab_size: int = self._hf.get_vocab_size(with_added_tokens=True)
        self._template_source = chat_template
        # The roles a conversation may have: system, user, assistant, and the tool roles the chat template names
        # (Qwen's tool, Llama 3's ipython). A role the template does not name is most likely a typo that it would
        # render as a prompt, training on nothing.
        named = set(re.findall(r"""['"](\w+)['"]""", chat_template or ""))
        self.roles: tuple[str, ...] = ("system", "user", "assistant", *(r for r in _TOOL_ROLES if r in named))
        self._template = _compile_template(chat_template) if chat_template else None
        self.has_chat_template = self._template is not None
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        stops = [self.eos_id, self._end_of_turn_id(), *gen_eos]
        self.stop_ids: list[int] = list(dict.fromkeys(i for i in stops if i is not None))

    @classmethod
    def from_checkpoint(cls, checkpoint_dir) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face checkpoint folder."""
        folder = Path(checkpoint_dir)
        for needed in ("tokenizer.json", "tokenizer_config.json"):
            if not (folder / needed).exists():
                raise UserError(
                    f"checkpoint folder {folder} has no {needed}: a fast Hugging Face tokenizer is needed; "
                    f"write it with AutoTokenizer.from_pretrained(...).save_pretrained('{folder}')")
        gen = folder / "generation_config.json"
        try:
            hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_bytes())
            generation = json.loads(gen.read_bytes()) if gen.exists() else None
            template = _read_chat_template(folder, config)
        except Exception as e:  # tokenizers says a file it cannot parse with a bare Exception
            said = (str(e).splitlines() or [type(e).__name__])[0]
            raise UserError(f"cannot read the tokenizer in {folder}: {said}; its tokenizer files are damaged or "
                            "unreadable: write them again with AutoTokenizer.save_pretrained") from None
        try:
            return cls(hf, config, generation, chat_template=template, name=str(folder))
        except ValueError as e:
            raise UserError(f"cannot read the tokenizer in {folder}: {e}; "
                            "set eos_token in its tokenizer_config.json") from None

    def fingerprint(self) -> str:
        """A digest of what tokens depend on: the tokenizer's files as read and the chat template."""
        digest = hashlib.sha256()
        folder = Path(self.name)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
            if (folder / name).is_file():
                digest.update(name.encode() + (folder / name).read_bytes())
        digest.update((self._template_source or "").encode())
        return digest.hexdigest()

    def _encode_text(self, text: str):
        # add_special_tokens=False: BOS is ours to add (torchtune's encode cannot drop a post-processor's BOS).
        return self._hf.encode(text, add_special_tokens=False)

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of plain text, with the model's BOS (if it uses one) and EOS."""
        ids = self._encode_text(text).ids
        return ([self.bos_id] if add_bos and self._add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_as_transformers(self, text: str) -> list[int]:
        """`text`'s tokens as transformers' `tokenizer(text)` gives them: BOS where tokenizer.json's post-processor
        adds one (Llama 3's does, a ChatML model's does not), nothing else. What TRL tokenises plain rows with."""
        return self._hf.encode(text, add_special_tokens=True).ids

    def encode_rendered(self, text: str) -> list[int]:
        """The tokens of text a chat template rendered (its special tokens parsed, nothing added)."""
        return self._encode_text(text).ids

    @property
    def eos_text(self) -> str:
        return self._special["eos_token"]

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, through the chat template."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self._special)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template of {self.name} rejects this conversation: {e}") from None

    def tokenize_messages(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """Tokens of a conversation and a mask per token, True where the loss ignores it (all but assistant turns)."""
        if self._template is None:
            return self._tokenize_plain(messages)
        text = self.render(messages)
        enc = self._encode_text(text)
        spans = self._assistant_spans(messages, text)
        # A token is trained when it lies within an assistant turn (vectorised: a long conversation has thousands).
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        trained = np.zeros(len(offsets), dtype=bool)
        for start, end in spans:
            trained |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end)
        return self._with_bos(text, enc.ids, (~trained).tolist())

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """Tokens that prompt the model for the next assistant turn."""
        if self._template is None:
            return self._tokenize_plain(messages)[0]
        text = self.render(messages, add_generation_prompt=True)
        return self._with_bos(text, self._encode_text(text).ids, [])[0]

    def _with_bos(self, text, ids, masked):
        if self._add_bos and not text.startswith(self._special["bos_token"]):  # templates often emit it themselves
            return [self.bos_id] + ids, [True] + masked
        return ids, masked

    def _assistant_spans(self, messages, full: str) -> list[tuple[int, int]]:
        return assistant_spans(messages, full, self.render, name=self.name)

    def _tokenize_plain(self, messages):
        """Without a template: bos, prompts joined by blank lines, then each answer followed by eos."""
        ids, masked, prompt = [], [], []

        def add(new_ids, is_masked):
            ids.extend(new_ids)
            masked.extend([is_masked] * len(new_ids))

        add([self.bos_id] if self._add_bos else [], True)
        for message in messages:
            if message["role"] != "assistant":
                prompt.append(message["content"])
                continue
            if prompt:
                add(self._encode_text("\n\n".join(prompt) + "\n\n").ids, True)
                prompt = []
            add(self._encode_text(message["content"]).ids + [self.eos_id], False)
        if prompt:
            add(self._encode_text("\n\n".join(prompt) + "\n\n").ids, True)
        return ids, masked

    def _end_of_turn_id(self) -> int | None:
        """The special token that closes an assistant turn in the template (<|im_end|>, <|eot_id|>), if any."""
        if self._template is None:
            return None
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        try:
            before, upto = self.render(chat[:1], add_generation_prompt=True), self.render(chat)
        except UserError:
            return None
        special = {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        turn = upto[len(os.path.commonprefix([before, upto])):]
        return next((i for i in self._encode_text(turn).ids if i in special), None)


def assistant_spans(messages: list[dict], full: str, render, *, name: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full` (the conversation rendered), each ending after its
    end-of-turn text; `render(messages, add_generation_prompt=...)` renders a part of it through the chat template."""
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        upto = render(messages[: i + 1], add_generation_prompt=False)
        if full.startswith(upto) and upto.startswith(before):
            start, end = len(before), len(upto)
        else:  # the template moves text between turns (Mistral puts the system prompt in the last user turn)
            turn = upto[len(os.path.commonprefix([before, upto])):]
            start = full.find(turn, cursor)
            if start < 0:
                raise UserError(f"cannot find assistant turn {i} where the chat template of {name} renders the "
                                "conversation")
            end = start + len(turn)
        spans.append((start, end))
        cursor = end
    return spans


def prompt_ids(tokenizer: "Tokenizer", prompt: str, *, chat: bool) -> list[int]:
    """The tokens that ask for an answer: a user turn as the model was trained on chats (its chat template,
    or our plain layout without one), or, with `chat=False`, the text itself to continue."""
    if chat:
        return tokenizer.encode_prompt([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt, add_eos=False)
