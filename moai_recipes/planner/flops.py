"""A training step's FLOPs counted by hand, and the model FLOPs utilisation (MFU) they give against the devices' peak.

Model FLOPs are the work a step must do, whatever the plan: the dense matmuls and the attention of the documents
actually trained. Per token, a weight costs 2 FLOPs forward, 2 for the gradient of its input and 2 for its own
gradient: 6 when trained, 4 when frozen (LoRA's base, QLoRA's NF4 base), 2 where its input needs no gradient
either (under LoRA the frozen embedding's output needs none: the first layer's q, k and v, and whatever follows
before an adapter; that layer's attention computes the gradients of only what is adapted). Attention costs 12 FLOPs per query dimension per pair of tokens a document attends (the
scores and the weighted sum, forward and backward), over the n(n+1)/2 pairs of a causal document of n tokens: at
the real document lengths, not the padded or packed row's.
Hardware FLOPs add what the plan computes twice: recomputation's second forward of each layer (full: its matmuls and
attention; selective re-runs only pointwise operators, no FLOPs counted here). The chunked loss computes its
gradients in the same pass (models/loss.py): nothing twice. Embedding lookups, norms, biases and the loss's softmax are left out (a fraction
of a percent), as Megatron and torchtitan leave them out.
MFU = model FLOPs / (step seconds x peak FLOP/s per device x devices), the peak of the compute dtype: GPUs' data
sheets (dense), the CPU's measured matmul (planner/cpu_speed.py). Test: `python -m pytest tests/test_flops.py -q`
checks the count against torch's FlopCounterMode on real forward and backward passes.
"""

from dataclasses import dataclass

from moai_recipes.models.spec import ModelSpec

_ATTENTION = {"q_proj", "k_proj", "v_proj", "output_proj"}


@dataclass(frozen=True)
class StepFlops:
    model: float  # the work the step must do
    hardware: float  # what the plan has the devices compute: model plus recomputation

    def utilisation(self, seconds: float, peak_flops: float, devices: int) -> tuple[float, float]:
        """(MFU, HFU): the share of the devices' peak that the step's model FLOPs, and its hardware FLOPs, used in
        `seconds`; (0, 0) where the peak is not known."""
        if seconds <= 0 or peak_flops <= 0:
            return 0.0, 0.0
        capacity = seconds * peak_flops * devices
        return self.model / capacity, self.hardware / capacity


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per token of a model's dense matmuls (by what they compute) and per attended pair of its attention."""

    per_token: float  # dense matmuls, forward and backward, trained and frozen weights as they are
    layer_forward: float  # one forward of the layers' matmuls: what full recomputation does again
    per_pair: float  # attention, forward and backward, per pair of tokens a document attends, over the layers
    pair_forward: float  # one forward of the attention per pair: what full recomputation does again

    @classmethod
    def of(cls, spec: ModelSpec, lora=None) -> "ModelFlops":
        """`lora` (models.lora.LoraOptions): the adapters, the base frozen; None: every weight trained. A
        Mixture-of-Experts layer counts its router and the experts a token is sent to (top-k), not all of them.
        A model of transformers' modules has no formula here: its layers and head are traced
        (planner/activations.traced_flops)."""
        if not spec.native:
            from moai_recipes.planner.activations import traced_flops

            key = None if lora is None else tuple(
                sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in lora.builder_kwargs().items()))
            t = traced_flops(spec, key)
            return cls(per_token=t.per_token, layer_forward=t.layer_forward, per_pair=t.per_pair,
                       pair_forward=t.pair_forward)
        d, q, kv, ff = spec.embed_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
            spec.intermediate_dim
        shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "output_proj": (q, d),
                  "w1": (d, ff), "w3": (d, ff), "w2": (ff, d)}
        head = spec.vocab_size * d
        adapted = set() if lora is None else set(lora.attn_modules) | ({"w1", "w2", "w3"} if lora.apply_to_mlp else set())
        experts_adapted = lora is not None and getattr(lora, "apply_to_experts", False)
        rank = 0 if lora is None else lora.rank

        def linear(name: str, i: int, o: int, grad_in: bool, has_adapter: bool | None = None) -> tuple[float, bool]:
            """A linear's FLOPs per token, and whether its output needs a gradient. Its weight's gradient is
            computed when it trains; its input's when the input needs one; a LoRA adapter's A and B train."""
            trained = lora is None
            has_adapter = name in adapted if has_adapter is None else has_adapter
            flops = 2 * i * o * (1 + grad_in + trained)
            if has_adapter:
                flops += 2 * rank * i * (2 + grad_in) + 6 * rank * o
            return flops, grad_in or trained or has_adapter

        # Which activations need a gradient, layer by layer: under LoRA the frozen embedding's output needs none, so
        # the first layers compute fewer input gradients (and their attention fewer of its own) until an adapter.
        per_token, per_pair, grad, forward = 0.0, 0.0, lora is None, 0.0
        for index in range(spec.num_layers):
            out = {}
            for name in ("q_proj", "k_proj", "v_proj"):
                flops, out[name] = linear(name, *shapes[name], grad)
                per_token += flops
            qk = out["q_proj"] or out["k_proj"]
            # Per pair and query dimension: 4 forward (scores, weighted sum); backward, the gradients of the
            # probabilities and the queries and keys (2 each, where needed) and of the values (2).
            per_pair += q * (4 + 2 * out["v_proj"] + 2 * qk + 2 * out["q_proj"] + 2 * out["k_proj"])
            flops, attended = linear("output_proj", *shapes["output_proj"], qk or out["v_proj"])
            per_token += flops
            grad = grad or attended
            forward += 2 * sum(i * o for name, (i, o) in shapes.items() if not name.startswith("w"))
            if index in spec.moe_layers:
                e, k = spec.expert_dim, spec.experts_per_token
                router, _ = linear("router", d, spec.num_experts, grad, has_adapter=False)
                flops1, g1 = linear("experts.w1", d, e, grad, has_adapter=experts_adapted)
                flops3, g3 = linear("experts.w3", d, e, grad, has_adapter=experts_adapted)
                flops2, g2 = linear("experts.w2", e, d, g1 or g3, has_adapter=experts_adapted)
                per_token += router + k * (flops1 + flops3 + flops2)
                forward += 2 * d * spec.num_experts + k * 2 * 3 * d * e
            else:
                flops1, g1 = linear("w1", *shapes["w1"], grad)
                flops3, g3 = linear("w3", *shapes["w3"], grad)
                flops2, g2 = linear("w2", *shapes["w2"], g1 or g3)
                per_token += flops1 + flops3 + flops2
                forward += 2 * 3 * d * ff
            grad = grad or g2
        per_token += 2 * head * (1 + grad + (lora is None))  # the output projection (its input: the last layer's)
        if lora is not None and lora.apply_to_output:
            per_token += 2 * rank * d * (2 + grad) + 6 * rank * spec.vocab_size
        return cls(per_token=per_token, layer_forward=forward, per_pair=per_pair, pair_forward=4 * spec.num_layers * q)

    def step(self, lengths: list[int], *, recompute: str = "none") -> StepFlops:
        """The FLOPs of a step over documents of `lengths` tokens, as the plan (its recomputation) computes them."""
        return self.of_totals(sum(lengths), sum(n * (n + 1) // 2 for n in lengths), recompute=recompute)

    def of_totals(self, tokens: float, pairs: float, *, recompute: str = "none") -> StepFlops:
        """step() for documents of `tokens` tokens and `pairs` attended pairs in all (a mean step: the planner's)."""
        model = self.per_token * tokens + self.per_pair * pairs
        again = 0.0
        if recompute == "full":
            again += self.layer_forward * tokens + self.pair_forward * pairs
        return StepFlops(model=model, hardware=model + again)
