"""Preference data: rows of a prompt, a chosen and a rejected completion, as tokens for recipes.dpo.

A row's three columns are strings, or conversations (TRL's conversational format: lists of {role, content}, the
prompt ending with a user turn, each completion an assistant turn). They are tokenised as TRL 1.16's DPOTrainer
tokenises them, so that the same rows give the same tokens there and here (tests/test_dpo.py):
- strings: the EOS token's text is appended to each completion; prompt + completion is tokenised as one string
  (transformers' `tokenizer(text)`: BOS where the tokenizer adds one) and split where it leaves the prompt's tokens;
- conversations: the chat template renders the prompt (with the generation prompt) and the prompt with each
  completion; the completion is what follows the prompt's tokens (the template's end of turn included).
Each sequence (prompt + completion) is cut at max_seq_len from its start; a row whose prompt alone fills it is
dropped. A row whose chosen and rejected completions are the same, or a missing column, is refused by name.
An image-text model's rows (pictures in the prompt) are made by its processor as TRL's DPOTrainer makes them for such
a model (data/images.ImageSamples.pair); a pair's image inputs go with both of its sequences.
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moai_recipes.data.datasets import DataSource, column, image_refusal
from moai_recipes.data.images import ImageSample, ImageSamples, _ImageInputs, collate_images, image_load
from moai_recipes.data.local_files import type_name
from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.errors import UserError
from moai_recipes.models.attention import Documents


class PreferencePairs(torch.utils.data.Dataset):
    """Tokenised pairs. A sample is {"prompt", "chosen", "rejected"} token lists and "tokens", the two sequences
    a pair runs end to end (what the planner and the ranks' shares weigh a pair by). An image-text model's pairs
    (`prompts`: each prompt's text and images, `maker` its processor) have "images" too: the prompt's image inputs,
    made by the processor when first looked at (data/images.py), which both sequences of the pair read."""

    def __init__(self, pairs: list[tuple[list[int], list[int], list[int]]], *, rows: int, dropped: int,
                 origin: str = "memory", prompts: list[ImageSample] | None = None, maker: ImageSamples | None = None):
        self._pairs, self.rows, self.dropped, self.origin = pairs, rows, dropped, origin
        self._prompts, self.maker = prompts, maker
        self.processed = 0  # pairs whose pictures this process has made into inputs (data/images._ImageInputs)

    def __len__(self):
        return len(self._pairs)

    def __getitem__(self, i) -> dict:
        prompt, chosen, rejected = self._pairs[i]
        pair = {"index": i, "prompt": prompt, "chosen": chosen, "rejected": rejected,
                "tokens": prompt + chosen + prompt + rejected,
                "documents": (len(prompt) + len(chosen), len(prompt) + len(rejected))}  # the two sequences run
        if self._prompts is not None:
            pair["images"] = _ImageInputs(self, self._prompts[i])
        return pair

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(2 * len(p) + len(c) + len(r) for p, c, r in self._pairs)

    def image_load(self) -> dict | None:
        """What the planner prices the vision tower by (planner/plan.ImageLoad): each pair's prompt images, run with
        both of its sequences."""
        if self.maker is None:
            return None
        return image_load(self.maker, [p.tokens for p in self._prompts], lambda i: self[i]["images"], copies=2)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps(self._pairs).encode())
        if self.maker is not None:  # the pictures are named by the rows, made by the processor
            digest.update(self.maker.fingerprint().encode())
            digest.update(json.dumps([[str(v) for v in p.images] for p in self._prompts]).encode())
        return digest.hexdigest()

    def split_off(self, fraction: float, *, seed: int):
        raise UserError("dataset.val_split is not offered for preference data yet; recipes.dpo logs the rewards "
                        "of each step's pairs")


def load_pairs(source: DataSource, tokenizer: Tokenizer, *, max_seq_len: int, progress: bool = False,
               images: ImageSamples | None = None) -> PreferencePairs:
    """The rows of `source` as pairs; `images`: an image-text model's processor, which makes them as TRL's
    DPOTrainer does for such a model (data/images.ImageSamples.pair), their pictures read then and again when a pair
    is (their pixels are not held)."""
    rows, _, total = source.open()
    pairs, prompts, n_rows, dropped = [], [] if images is not None else None, 0, 0
    base = Path(source.path).resolve().parent if source.path else None
    bar = tqdm(rows, total=total, unit=" rows", desc=f"Tokenising {source.describe()}", disable=not progress,
               file=sys.stderr, leave=False)
    for where, row in bar:
        n_rows += 1
        try:
            if images is None:
                pair = tokenize_pair(row, tokenizer, source.column_map, max_seq_len=max_seq_len)
            else:
                pair = images.pair(row, column_map=source.column_map, base=base, max_seq_len=max_seq_len)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if pair is None:
            dropped += 1
        elif images is None:
            pairs.append(pair)
        else:
            prompt, chosen, rejected, text, refs = pair
            pairs.append((prompt, chosen, rejected))
            prompts.append(ImageSample(np.asarray(prompt, dtype=np.int64), None, text, refs, base,
                                       special_tokens=False))
    if n_rows == 0:
        raise UserError(f"{source.describe()} holds no rows; check dataset.split and dataset.data_files")
    if not pairs:
        raise UserError(f"no row of {source.describe()} keeps a completion token within max_seq_len={max_seq_len} "
                        f"({dropped} dropped); raise max_seq_len")
    return PreferencePairs(pairs, rows=n_rows, dropped=dropped, prompts=prompts, maker=images)


def tokenize_pair(row: dict, tokenizer: Tokenizer, column_map: dict, *, max_seq_len: int):
    """(prompt, chosen, rejected) token lists, cut to max_seq_len; None when the prompt alone fills it."""
    prompt, chosen, rejected = (column(row, name, column_map) for name in ("prompt", "chosen", "rejected"))
    values = {col: value for col, value in (prompt, chosen, rejected)}
    if chosen[1] == rejected[1]:
        raise UserError(f"columns '{chosen[0]}' and '{rejected[0]}' hold the same completion: a pair teaches nothing "
                        "when both sides are equal; remove the row")
    kinds = {type(v) for v in values.values()}
    if kinds == {str}:
        eos = tokenizer.eos_text
        p = tokenizer.encode_as_transformers(prompt[1])
        pc = tokenizer.encode_as_transformers(prompt[1] + _ended(chosen[1], eos))
        pr = tokenizer.encode_as_transformers(prompt[1] + _ended(rejected[1], eos))
    elif kinds == {list}:
        for col, value in values.items():
            _check_messages(col, value)
        render = lambda messages, **kw: tokenizer.encode_rendered(tokenizer.render(messages, **kw))  # noqa: E731
        p = render(prompt[1], add_generation_prompt=True)
        pc, pr = render(prompt[1] + chosen[1]), render(prompt[1] + rejected[1])
    else:
        found = ", ".join(f"'{c}' {type_name(v)}" for c, v in values.items())
        raise UserError(f"the prompt, chosen and rejected columns must all be strings or all be lists of messages; "
                        f"found {found}")
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    prompt_ids, chosen_ids, rejected_ids = p[:n], pc[n:], pr[n:]
    if len(prompt_ids) >= max_seq_len:
        return None
    keep = max_seq_len - len(prompt_ids)
    return prompt_ids, chosen_ids[:keep], rejected_ids[:keep]


def _ended(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_messages(col: str, value: list) -> None:
    if not value:
        raise UserError(f"column '{col}' holds no messages")
    for j, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            raise image_refusal(j, col)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"message {j} of '{col}' must be an object with a string role and content, got {m!r}"[:300])


def collate_pairs(pairs: list[dict], *, pad_id: int, packed: bool = False, padded_row=None) -> dict:
    """A micro-batch of pairs as one forward: the chosen sequences, then the rejected (TRL's layout), right-padded
    rows, or (`packed`) one row of them end to end, each attending to itself only (models/attention.Documents);
    `completion` marks the tokens whose log-probabilities are summed (the label of the position before).
    `padded_row` (Plan.padded_row): the length a row of so many tokens is padded to (a packed row's padding is one
    more document, whose tokens are no sequence's). `samples`: each token's sequence (-1: padding), for a
    Mixture-of-Experts model's routing (models/moe.Routing)."""
    seqs = [p["prompt"] + p["chosen"] for p in pairs] + [p["prompt"] + p["rejected"] for p in pairs]
    starts = [len(p["prompt"]) for p in pairs] * 2
    batch = _collated(seqs, starts, pad_id=pad_id, packed=packed, padded_row=padded_row or (lambda n: n))
    if any("images" in p for p in pairs):
        # Each pair's images with both its sequences, in their order (TRL repeats them so); the inputs with a value
        # per token (Qwen's mm_token_type_ids, Gemma's token_type_ids) are the prompt's, then 0.
        rows = [{"tokens": seq, "images": p.get("images", {})} for seq, p in zip(seqs, pairs * 2)]
        width = batch["tokens"].shape[1]
        if packed and width > sum(map(len, seqs)):  # the padding document
            rows.append({"tokens": [pad_id] * (width - sum(map(len, seqs)))})
        batch["images"] = collate_images(rows, None if packed else width)
    return batch


def _collated(seqs: list[list[int]], starts: list[int], *, pad_id: int, packed: bool, padded_row) -> dict:
    if packed:
        completion = [j >= start for seq, start in zip(seqs, starts) for j in range(len(seq))]
        tokens = [t for seq in seqs for t in seq]
        lengths = tuple(map(len, seqs))
        missing = padded_row(len(tokens)) - len(tokens)
        if missing:
            tokens, completion, lengths = tokens + [pad_id] * missing, completion + [False] * missing, (*lengths, missing)
        sequence = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
        return {"tokens": torch.tensor([tokens]), "completion": torch.tensor([completion]),
                "documents": Documents(lengths), "sequences": len(seqs), "sequence": sequence,
                "samples": torch.where(sequence < len(seqs), sequence, -1)[None]}
    width = padded_row(max(map(len, seqs)))
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    completion = torch.zeros((len(seqs), width), dtype=torch.bool)
    samples = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        tokens[i, :len(seq)] = torch.tensor(seq)
        completion[i, start:len(seq)] = True
        samples[i, :len(seq)] = i
    return {"tokens": tokens, "completion": completion, "samples": samples}


def completion_logps(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's completion, its number of tokens), in fp32: position j predicts
    token j + 1."""
    targets = batch["tokens"][:, 1:].to(logits.device)
    mask = batch["completion"][:, 1:].to(logits.device)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    if "documents" not in batch:
        return (logp * mask).sum(dim=1), mask.sum(dim=1)
    # One packed row: each target's sums go to its sequence. A document's first token is a prompt token, never
    # a completion's: the position before it (the previous document's last) adds nothing.
    # A padding document after the sequences (collate_pairs' padded_row) sums into a last slot, dropped: its tokens
    # are no completion's.
    sequence = batch["sequence"][1:].to(logits.device)
    n, slots = batch["sequences"], len(batch["documents"].lengths)
    summed = torch.zeros(slots, device=logits.device).index_add(0, sequence, (logp * mask)[0])
    counts = torch.zeros(slots, device=logits.device, dtype=torch.long).index_add(0, sequence, mask[0].long())
    return summed[:n], counts[:n]
