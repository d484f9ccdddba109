"""Our model and tokenizer as a model of EleutherAI's lm-evaluation-harness (lm-eval): the one boundary to it.

lm-eval asks three things of a model: the log-likelihood of a continuation after a context (multiple choice,
scored per choice), the rolling log-likelihood of a whole text (perplexity tasks), and greedy generation up to a
stop string. `MoaiLM` answers them with the torchtune decoder and our Tokenizer, batched, as lm-eval's own Hugging
Face backend (HFLM) computes them, so that a task's numbers here equal its numbers there (tests/test_eval.py):
contexts without BOS unless `add_bos_token`, an empty context replaced by the BOS token, inputs cut on the left at
the context length, log-softmax in fp32.
"""

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torchtune.modules.common_utils import disable_kv_cache

from moai_recipes.data.tokenizer import Tokenizer


class MoaiLM(TemplateLM):
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, device: torch.device, batch_size: int,
                 max_length: int, add_bos_token: bool = False):
        super().__init__()
        self.model, self.tok, self._device = model, tokenizer, device
        self.batch_size, self.max_length, self.add_bos_token = batch_size, max_length, add_bos_token

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:  # what an empty context becomes, as HFLM: BOS
        return self.tok.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tok.encode(string, add_bos=bos, add_eos=False)

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's next-token log-probabilities [len, vocab] in fp32: one forward of the rows right-padded."""
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.tok.pad_id if self.tok.pad_id is not None else 0,
                            dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
        # With KV caches set up (for generate_until), torchtune's attention is causal only through an explicit mask.
        causal = torch.ones(width, width, dtype=torch.bool).tril().expand(len(rows), width, width)
        with disable_kv_cache(self.model):
            logits = self.model(tokens.to(self._device), mask=causal.to(self._device))
        if isinstance(logits, list):  # a chunked output layer
            logits = torch.cat(logits, dim=1)
        logp = F.log_softmax(logits.float(), dim=-1)
        return [logp[i, :len(r)] for i, r in enumerate(rows)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        # Longest first, as HFLM orders them: a batch pads little, and the first batch shows the peak memory.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows, conts = [], []
            for i in batch:
                _, context, continuation = requests[i]
                rows.append((context + continuation)[-(self.max_length + 1):][:-1])
                conts.append(continuation)
            for i, row, cont, logp in zip(batch, rows, conts, self._logprobs(rows)):
                scores = logp[len(row) - len(cont):]
                target = torch.tensor(cont, device=scores.device)
                picked = scores.gather(-1, target[:, None])[:, 0]
                results[i] = (float(picked.sum()), bool((scores.argmax(-1) == target).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood in windows of the context length, the first token after the BOS."""
        out = []
        for (text,) in (r.args for r in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            out.append(sum(s for s, _ in scores))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (`until`) or the end of text, through the KV cache."""
        from torchtune.generation import generate

        out = []
        for context, kwargs in (r.args for r in requests):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-(self.max_length - new):]
            self.model.reset_caches()
            tokens, _ = generate(self.model, torch.tensor(ids, device=self._device), max_generated_tokens=new,
                                 pad_id=-1, temperature=1.0, top_k=1, stop_tokens=self.tok.stop_ids)
            generated = tokens[0, len(ids):].tolist()
            generated = next((generated[:i] for i, t in enumerate(generated) if t in self.tok.stop_ids), generated)
            text = self.tok.decode(generated)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out
