"""The model's answers to a few prompts before and after training, so a newcomer sees that it learned."""

import torch
from torch import nn

from moai_recipes.data.tokenizer import Tokenizer, prompt_ids
from moai_recipes.planner.plan import Plan
from moai_recipes.train.mixed_precision import in_compute_dtype


def greedy_continuation(model: nn.Module, prompt: list[int], *, max_new_tokens: int, stop_ids: list[int],
                        device: torch.device) -> list[int]:
    """Greedy decoding without a cache (short demo answers); every rank runs it so FSDP's gathers match."""
    tokens = list(prompt)
    # Eager even where the layers are compiled for training (plan.compile): a graph for every prompt length
    # without gradients would cost more compiling than the few tokens it generates.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([tokens], device=device))[0, -1].argmax())
            if nxt in stop_ids:
                break
            tokens.append(nxt)
    return tokens[len(prompt):]


class Answers:
    """The model's answers to the dataset's sample prompts, taken before training and compared after."""

    @classmethod
    def for_run(cls, cfg, tokenizer: Tokenizer, *, plan: Plan, device: torch.device) -> "Answers":
        """The prompts of `cfg.dataset.sample_prompts`, asked as chats unless the data is plain text. None under
        tensor or pipeline parallelism: generating there would need its own cut of the model (recipes.generate
        answers from the saved model instead)."""
        cut = plan.tensor_parallel > 1 or plan.pipeline_stages > 1
        answers = cls(tokenizer, prompts=[] if cut else list(cfg.dataset.sample_prompts),
                      chat=cfg.dataset.kind != "text", max_new_tokens=cfg.sample_max_new_tokens, device=device,
                      plan=plan)
        if cut and cfg.sample_max_new_tokens > 0 and cfg.dataset.sample_prompts:
            answers.skipped = ("Sample answers are not generated on a model cut by tensor or pipeline parallelism; "
                               "python -m recipes.generate answers from the saved model")
        return answers

    def __init__(self, tokenizer: Tokenizer, *, prompts: list[str], chat: bool, max_new_tokens: int,
                 device: torch.device, plan: Plan):
        self.tokenizer, self.max_new_tokens, self.device = tokenizer, max_new_tokens, device
        self.plan = plan  # the run's: the answers are computed in its compute dtype, as training computes
        self.prompts = {p: prompt_ids(tokenizer, p, chat=chat) for p in prompts if max_new_tokens > 0}
        self.before: dict[str, str] = {}
        self.skipped: str | None = None  # why no answers are taken, said after training

    def answers(self, model: nn.Module) -> dict[str, str]:
        was_training = model.training
        model.eval()
        with in_compute_dtype(model, self.plan):
            out = {p: self.tokenizer.decode(greedy_continuation(model, ids, max_new_tokens=self.max_new_tokens,
                                                                stop_ids=self.tokenizer.stop_ids, device=self.device))
                   for p, ids in self.prompts.items()}
        model.train(was_training)
        return out

    def take_before(self, model: nn.Module) -> None:
        self.before = self.answers(model)

    def report_after(self, model: nn.Module) -> list[str]:
        if self.skipped:
            return [self.skipped]
        after = self.answers(model)
        return [f"Sample {p!r}\n  before: {self.before.get(p, '')!r}\n  after:  {after[p]!r}" for p in after]
