"""The model's answers to a few prompts before and after training, so a newcomer sees that it learned."""

from pathlib import Path

import torch
from torch import nn

from moai_recipes.data.images import continued
from moai_recipes.data.tokenizer import Tokenizer, prompt_ids
from moai_recipes.errors import UserError
from moai_recipes.planner.plan import Plan
from moai_recipes.train.mixed_precision import in_compute_dtype


def greedy_continuation(model: nn.Module, prompt: list[int], *, max_new_tokens: int, stop_ids: list[int],
                        device: torch.device, images: dict | None = None) -> list[int]:
    """Greedy decoding without a cache (short demo answers); every rank runs it so FSDP's gathers match. `images`: an
    image-text model's inputs for the prompt's pictures, as its processor made them with the prompt (an input with a
    value per prompt token is given, for each token generated, 0 or, as transformers' generate gives Llama 3.2
    Vision's cross-attention mask, the last prompt token's)."""
    tokens = list(prompt)
    images = {k: v.to(device) for k, v in (images or {}).items()}
    per_token = [k for k, v in images.items()
                 if v.dim() >= 2 and v.shape[:2] == (1, len(prompt)) and not v.is_floating_point()]
    # Eager even where the layers are compiled for training (plan.compile): a graph for every prompt length
    # without gradients would cost more compiling than the few tokens it generates.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for _ in range(max_new_tokens):
            extra = {}
            if images:
                grown = {k: continued(images[k][0], len(tokens))[None] for k in per_token}
                extra["images"] = {**images, **grown}
            nxt = int(model(torch.tensor([tokens], device=device), **extra)[0, -1].argmax())
            if nxt in stop_ids:
                break
            tokens.append(nxt)
    return tokens[len(prompt):]


class Answers:
    """The model's answers to the dataset's sample prompts, taken before training and compared after."""

    @classmethod
    def for_run(cls, cfg, tokenizer: Tokenizer, *, plan: Plan, device: torch.device, images=None) -> "Answers":
        """The prompts of `cfg.dataset.sample_prompts`, asked as chats unless the data is plain text; with an
        image-text model's processor (`images`: data/images.ImageSamples), each about its picture of
        `cfg.dataset.sample_images`. None under tensor or pipeline parallelism: generating there would need its own
        cut of the model (recipes.generate answers from the saved model instead)."""
        cut = plan.tensor_parallel > 1 or plan.pipeline_stages > 1
        pictures = list(cfg.dataset.get("sample_images") or [])
        if pictures and images is None:
            raise UserError("dataset.sample_images: this model reads no images; give them to an image-text model, "
                            "or drop them")
        if pictures and len(pictures) != len(cfg.dataset.sample_prompts):
            raise UserError(f"dataset.sample_images names {len(pictures)} picture(s) for "
                            f"{len(cfg.dataset.sample_prompts)} sample_prompts: give one picture for each prompt")
        answers = cls(tokenizer, prompts=[] if cut else list(cfg.dataset.sample_prompts),
                      chat=cfg.dataset.kind != "text", max_new_tokens=cfg.sample_max_new_tokens, device=device,
                      plan=plan, images=images, pictures=pictures)
        if cut and cfg.sample_max_new_tokens > 0 and cfg.dataset.sample_prompts:
            answers.skipped = ("Sample answers are not generated on a model cut by tensor or pipeline parallelism; "
                               "python -m recipes.generate answers from the saved model")
        return answers

    def __init__(self, tokenizer: Tokenizer, *, prompts: list[str], chat: bool, max_new_tokens: int,
                 device: torch.device, plan: Plan, images=None, pictures: list[str] = ()):
        self.tokenizer, self.max_new_tokens, self.device = tokenizer, max_new_tokens, device
        self.plan = plan  # the run's: the answers are computed in its compute dtype, as training computes
        self.inputs: dict[str, dict] = {}  # an image-text model's: each prompt's picture, as its processor makes it
        if pictures and max_new_tokens > 0:
            self.prompts = {}
            for prompt, picture in zip(prompts, pictures):
                key = f"{prompt} [{Path(picture).name}]"
                self.prompts[key], self.inputs[key] = images.prompt(prompt, picture)
        else:
            self.prompts = {p: prompt_ids(tokenizer, p, chat=chat) for p in prompts if max_new_tokens > 0}
        self.before: dict[str, str] = {}
        self.skipped: str | None = None  # why no answers are taken, said after training

    def answers(self, model: nn.Module) -> dict[str, str]:
        if not self.inputs:
            return self._text_answers(model)
        was_training = model.training
        model.eval()
        with in_compute_dtype(model, self.plan):
            out = {p: self.tokenizer.decode(greedy_continuation(model, ids, max_new_tokens=self.max_new_tokens,
                                                                stop_ids=self.tokenizer.stop_ids, device=self.device,
                                                                images=self.inputs.get(p)))
                   for p, ids in self.prompts.items()}
        model.train(was_training)
        return out

    def _text_answers(self, model: nn.Module) -> dict[str, str]:
        """Greedy answers with the KV cache of recipes.grpo's sampler (top-k 1 is the argmax): the demo's six answers
        took 11 s of its 40 without it (every token recomputing the prompt and the vocabulary's logits at every
        position). Eager even where the layers are compiled for training, as greedy_continuation."""
        from moai_recipes.train.rollouts import Sampler, SamplingSettings

        if not self.prompts:
            return {}
        stop_ids = tuple(self.tokenizer.stop_ids)
        longest = max(len(ids) for ids in self.prompts.values())
        sampler = Sampler(SamplingSettings(top_k=1, max_completion_length=self.max_new_tokens), stop_ids=stop_ids,
                          pad_id=self.tokenizer.pad_id, plan=self.plan, device=self.device,
                          max_length=longest + self.max_new_tokens)
        with torch.compiler.set_stance("force_eager"):
            completions = sampler.complete(model, list(self.prompts.values()), seeds=[0] * len(self.prompts))
        # The sampler keeps a completion's stop token (as TRL does); an answer ends before it.
        return {p: self.tokenizer.decode([t for t in c if t not in stop_ids])
                for p, c in zip(self.prompts, completions.completions)}

    def take_before(self, model: nn.Module) -> None:
        self.before = self.answers(model)

    def report_after(self, model: nn.Module) -> list[str]:
        if self.skipped:
            return [self.skipped]
        after = self.answers(model)
        return [f"Sample {p!r}\n  before: {self.before.get(p, '')!r}\n  after:  {after[p]!r}" for p in after]
