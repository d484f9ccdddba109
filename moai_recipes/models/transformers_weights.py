"""Checkpoint tensors and the parameters of transformers' modules, mapped by transformers' own conversion rules.

A checkpoint on disk is not always laid out as the modules hold it: transformers 5 keeps a Mixture-of-Experts layer's
experts stacked ([E, 2 x hidden, dim] gate and up fused) where the files hold one tensor per expert and projection,
renames Mixtral's `block_sparse_moe`, drops a multimodal prefix. Its conversion mapping (WeightRenaming and
WeightConverter rules, per model type) says how, both ways; this module is its one boundary: which parameter a
checkpoint tensor belongs to, a parameter made whole from its tensors (loading), and a parameter back to its
tensors (saving, as transformers' save_pretrained reverts them).

Test: `python -m pytest tests/test_architectures.py -q`.
"""

from __future__ import annotations

from copy import deepcopy

import torch


_MXFP4 = ("_blocks", "_scales")


class TransformersNames:
    """The mapping for one model (a transformers causal LM, on the meta device)."""

    def __init__(self, causal_lm, *, mxfp4: bool = False):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

        self.causal_lm, self.mxfp4 = causal_lm, mxfp4
        loading = get_model_conversion_mapping(causal_lm, add_legacy=True)
        self.renamings = [t for t in loading if isinstance(t, WeightRenaming)]
        self.converters = [t for t in loading if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        # Saving reverts what loading did, without the legacy renames or prefix changes (as save_pretrained does).
        self._has_saving_rules = any(not isinstance(t, PrefixChange)
                                     for t in get_model_conversion_mapping(causal_lm, add_legacy=False))
        self._patterns: dict[str, str | None] = {}
        # What the causal LM leaves in its checkpoints unread (a multimodal model's vision tower, multi-token
        # prediction layers): not its weights, written back as they were.
        import re

        self._ignored = [re.compile(p) for p in getattr(type(causal_lm), "_keys_to_ignore_on_load_unexpected", None)
                         or ()]

    def param_of(self, name: str) -> str | None:
        """The parameter (or buffer) of the model that a checkpoint tensor is, or is part of; None for one the causal
        LM does not read."""
        from transformers.core_model_loading import rename_source_key

        if any(p.search(name) for p in self._ignored):
            return None
        if self.mxfp4 and name.endswith(_MXFP4):  # gpt-oss's packed experts: the projection they make
            self._patterns[name] = None
            return name.rsplit("_", 1)[0]
        target, pattern = rename_source_key(name, self.renamings, self.converters)
        self._patterns[name] = pattern
        return target

    def ordered(self, names: list[str]) -> list[str]:
        """A parameter's tensors in the order its conversion takes them (transformers sorts experts by number)."""
        from transformers.core_model_loading import dot_natural_key

        return sorted(names, key=dot_natural_key)

    def gather(self, param: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The whole parameter from its checkpoint tensors (all of them, by name; meta tensors give its shape)."""
        if self.dequantized(param, list(tensors)):  # MXFP4: transformers' own dequantization, to bf16
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            parts = {n.rsplit("_", 1)[1]: t for n, t in tensors.items()}
            if parts["blocks"].is_meta:  # the shape alone: [experts, in, out] of [experts, out, in / 32, 16]
                e, out, groups, pair = parts["blocks"].shape
                return torch.empty(e, groups * pair * 2, out, dtype=torch.bfloat16, device="meta")
            return convert_moe_packed_tensors(parts["blocks"], parts["scales"], dtype=torch.bfloat16)
        patterns = {self._patterns[n] if n in self._patterns else self._pattern(n) for n in tensors}
        pattern = next(iter(patterns))
        if pattern is None:
            assert len(tensors) == 1, (param, list(tensors))
            return next(iter(tensors.values()))
        converter = deepcopy(self._by_pattern[pattern])
        for name, tensor in ((n, tensors[n]) for n in self.ordered(list(tensors))):
            converter.add_tensor(param, name, self._patterns.get(name) or self._pattern(name),
                                 (lambda t=tensor: t))
        out = converter.convert(param, model=self.causal_lm, config=self.causal_lm.config)
        assert param in out, (param, list(out))
        value = out[param]
        return value[0] if isinstance(value, list) else value

    def dequantized(self, param: str, names: list[str]) -> bool:
        """Whether the parameter is read from packed MXFP4 tensors (and written back in bf16 under its own name)."""
        return self.mxfp4 and all(n.endswith(_MXFP4) for n in names)

    def scatter(self, param: str, whole: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
        """A whole parameter as the checkpoint tensors `names` it was read from (as save_pretrained writes them); a
        dequantized one as itself, under its own name."""
        if self.dequantized(param, names):
            return {param: whole}
        if len(names) == 1 and self._pattern(names[0]) is None:
            return {names[0]: whole}
        from transformers.core_model_loading import dot_natural_key, revert_weight_conversion

        assert self._has_saving_rules, param
        out = revert_weight_conversion(self.causal_lm, {param: whole})
        if set(out) == set(names):
            return out
        # The checkpoint spelt the names with a prefix transformers drops and does not add back (a multimodal
        # model's language_model): the same tensors, in the same natural order.
        assert len(out) == len(names), (param, sorted(out)[:4], names[:4])
        return dict(zip(sorted(names, key=dot_natural_key), (out[k] for k in sorted(out, key=dot_natural_key))))

    def _pattern(self, name: str) -> str | None:
        if name not in self._patterns:
            self.param_of(name)
        return self._patterns[name]
