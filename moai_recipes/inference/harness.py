"""Our model and tokenizer as a model of EleutherAI's lm-evaluation-harness (lm-eval): the one boundary to it.

lm-eval asks three things of a model: the log-likelihood of a continuation after a context (multiple choice,
scored per choice), the rolling log-likelihood of a whole text (perplexity tasks), and greedy generation up to a
stop string. `MoaiLM` answers them with the torchtune decoder and our Tokenizer, batched, as lm-eval's own Hugging
Face backend (HFLM) computes them, so that a task's numbers here equal its numbers there (tests/test_eval.py):
contexts without BOS unless `add_bos_token`, an empty context replaced by the BOS token, inputs cut on the left at
the context length, log-softmax in fp32.

Under torch.distributed (a training run's ranks, eval_tasks=) each rank scores its share of the documents, as
lm-eval deals them out, and rank 0 combines the metrics. A sharded model (FSDP2) needs every rank in each forward:
each forward is preceded by a vote, and a rank out of work runs a one-token forward for as long as another still
works, so ranks with more requests, longer texts or longer generations never leave the others waiting in one.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moai_recipes.errors import UserError

try:  # an optional dependency (the `eval` extra): the training recipes and the demo do without it
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:
    raise UserError("lm-eval tasks need EleutherAI's lm-evaluation-harness, which is not installed: pip install "
                    "'moai-recipes[eval]' (or 'lm-eval>=0.4.8,<0.5'; make test installs it)") from None

from moai_recipes.data.tokenizer import Tokenizer
from moai_recipes.inference.loading import whole_sequence_logits
from moai_recipes.inference.task_index import builtin_tasks_cached


@dataclass(frozen=True)
class Scoring:
    """How requests are run: sequences a forward scores at once, tokens an input keeps, BOS before contexts."""

    batch_size: int
    max_length: int
    add_bos_token: bool = False


class MoaiLM(TemplateLM):
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, scoring: Scoring, *, device: torch.device):
        super().__init__()
        self.model, self.tok, self.scoring, self._device = model, tokenizer, scoring, device
        self.batch_size, self.max_length = scoring.batch_size, scoring.max_length
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # --- lm-eval's distributed hooks: the default process group (every rank a data-parallel rank) ---
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        out = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return torch.stack(out)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # --- tokens ---
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:  # what an empty context becomes, as HFLM: BOS
        return self.tok.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        bos = self.scoring.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tok.encode(string, add_bos=bos, add_eos=False)

    # --- forwards, in step with the other ranks ---
    def _working(self, busy: bool) -> bool:
        """Whether any rank still has a forward to run (a vote every rank takes before each forward)."""
        if self.world_size == 1:
            return busy
        flag = torch.tensor([float(busy)], device=self._device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def _finish(self) -> None:
        """Run one-token forwards for as long as another rank still runs real ones (its FSDP2 all-gathers)."""
        one = torch.zeros(1, 1, dtype=torch.long, device=self._device)
        while self.world_size > 1 and self._working(False):
            whole_sequence_logits(self.model, one)

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's next-token log-probabilities [len, vocab] in fp32: one forward of the rows right-padded."""
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
        self._working(True)
        logits = whole_sequence_logits(self.model, tokens.to(self._device))
        logp = F.log_softmax(logits.float(), dim=-1)
        return [logp[i, :len(r)] for i, r in enumerate(rows)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        # Longest first, as HFLM orders them: a batch pads little, and the first batch shows the peak memory.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in batch]
            for i, row, logp in zip(batch, rows, self._logprobs(rows)):
                cont = requests[i][2]
                scores = logp[len(row) - len(cont):]
                target = torch.tensor(cont, device=scores.device)
                picked = scores.gather(-1, target[:, None])[:, 0]
                results[i] = (float(picked.sum()), bool((scores.argmax(-1) == target).all()))
        self._finish()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood in windows of the context length, the first token after the BOS."""
        windows, owner = [], []
        for n, (text,) in enumerate(r.args for r in requests):
            for w in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                ctx, cont = make_disjoint_window(w)
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += score
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string (`until`) or an end-of-text token."""
        out = []
        for context, kwargs in (r.args for r in requests):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-(self.max_length - new):]
            text = self.tok.decode(self._greedy(ids, new, until))
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        self._finish()
        return out

    def _greedy(self, ids: list[int], new: int, until: list[str]) -> list[int]:
        """Up to `new` tokens after `ids`: through the KV cache where it is set up (recipes.eval), else each token
        from the whole sequence (a training run's model, which has no cache)."""
        if self.model.caches_are_setup():
            from torchtune.generation import generate

            self.model.reset_caches()
            tokens, _ = generate(self.model, torch.tensor(ids, device=self._device), max_generated_tokens=new,
                                 pad_id=-1, temperature=1.0, top_k=1, stop_tokens=self.tok.stop_ids)
            generated = tokens[0, len(ids):].tolist()
            return next((generated[:i] for i, t in enumerate(generated) if t in self.tok.stop_ids), generated)
        generated = []
        for _ in range(new):
            row = (ids + generated)[-self.max_length:]
            self._working(True)
            logits = whole_sequence_logits(self.model, torch.tensor([row], device=self._device))
            token = int(logits[0, -1].argmax())
            if token in self.tok.stop_ids:
                break
            generated.append(token)
            if until and any(s in self.tok.decode(generated) for s in until):
                break
        return generated


def load_tasks(names: list[str], *, tasks_dir: str | None, key: str = "tasks"):
    """lm-eval's TaskManager with each named task's data read (from the datasets cache, or downloaded): an unknown
    name, or data neither here nor reachable, is a UserError naming the task (`key`: the setting that names them)."""
    from lm_eval.tasks import TaskManager

    folder = str(Path(tasks_dir).expanduser()) if tasks_dir else None
    if folder and not Path(folder).is_dir():
        raise UserError(f"{key}_dir={tasks_dir} is not a folder; give the folder of your task YAML files")
    own = TaskManager(include_path=folder, include_defaults=False) if folder else None
    # lm-eval's 14k built-in task files: only when a name is not one of the user's own, and their index read from
    # this machine's cache once one process made it (task_index.py: 4 s of parsing, about half a second to read).
    if own and all(n in own.all_tasks for n in names):
        manager = own
    else:
        with builtin_tasks_cached():
            manager = TaskManager(include_path=folder)
    # Every name that cannot be evaluated, in one message: a user fixing a list fixes it once.
    problems = []
    for name in names:
        if name not in manager.all_tasks and not Path(name).is_file():
            where = f" or in {key}_dir={tasks_dir}" if tasks_dir else f" (your own: {key}_dir=FOLDER of task YAMLs)"
            problems.append(f"{name!r} is not an lm-eval task, group or tag{where}; `lm-eval ls tasks` lists them")
            continue
        try:
            manager.load([name])
        except OSError as e:  # datasets' ConnectionError: neither in the local cache nor reachable
            source = (getattr(manager.task_index.get(name), "cfg", None) or {}).get("dataset_path", "its dataset")
            problems.append(
                f"{name!r} needs its data ({source}), which is not in the local datasets cache and could not "
                f"be downloaded ({str(e).splitlines()[0]}). On a machine with network: python -c \"import datasets; "
                f"datasets.load_dataset('{source}')\" (with the task's subset name if it has one), then copy "
                "~/.cache/huggingface here (or set HF_DATASETS_CACHE to it)")
    if problems:
        raise UserError(f"{key}: " + f"\n{key}: ".join(problems))
    return manager


@dataclass(frozen=True)
class Tasks:
    """The tasks of a run, loaded: what lm-eval evaluates, how many documents, how many examples before each."""

    manager: object  # lm_eval.tasks.TaskManager
    names: list[str]
    limit: float | None = None
    num_fewshot: int | None = None
    stderr: bool = True  # bootstrapped where not computed in closed form (a training run's checks go without)


def run_tasks(lm: MoaiLM, tasks: Tasks) -> dict | None:
    """lm-eval's evaluation of `tasks` with `lm` (every rank takes part); on rank 0 its output, else None."""
    from lm_eval import simple_evaluate

    # lm-eval's own seeds (few-shot sampling): its numbers, as its command line gives them.
    return simple_evaluate(model=lm, tasks=tasks.names, task_manager=tasks.manager, num_fewshot=tasks.num_fewshot,
                           limit=tasks.limit, log_samples=True, bootstrap_iters=100000 if tasks.stderr else 0)


def headline(results: dict) -> dict[str, float]:
    """Each task's metrics as `task/metric` -> value (lm-eval's `acc,none` keys; stderr and names left out)."""
    return {f"{task}/{key.split(',')[0]}" + ("" if key.endswith(",none") else f"/{key.split(',', 1)[1]}"): value
            for task, metrics in results.items() for key, value in metrics.items()
            if "," in key and "stderr" not in key and isinstance(value, (int, float))}
