"""transformers' own modules as our decoder: any causal LM the installed transformers builds from its config.json.

Our native layers (models/build.py) cover the Llama, Mistral and Qwen lineage, where they are measured faster; every
other architecture (Gemma 3 and 4, gpt-oss, Qwen3.5, DeepSeek-V3, Llama 4, Phi-4, SmolLM3, GLM-4.5, and what ships
next month) runs through the modules transformers itself defines, on the day transformers knows it. The model's own
forward runs unchanged (its masks per layer kind, rotary tables, per-layer inputs, shared key-value layers, routers);
what we plug in is where transformers lets a library plug in:

- attention (`ATTENTION`, transformers' attention interface): packed rows attend document by document
  (`moai_documents`, models/attention.Documents), each block computed by plain causal SDPA where transformers' own mask
  for it is plain causal, else by the model's own attention (its SDPA or eager function, sinks and soft-capping
  included) with that block of its own mask. Masks are lazy (`LazyMask`): built only for the blocks that need them,
  never the square of a packed row;
- a sequence mixer that is not attention (Gated DeltaNet, Mamba: `MIXERS`) runs document by document on packed rows,
  so that its state stops at a document's end;
- the decoder is `TransformersDecoder`, which fills the interface the planner, the loop and the layouts use
  (`tok_embeddings`, `layers`, `norm`, `output`, `forward(tokens, mask=, input_pos=)`, `unembed`), its parameter names
  the checkpoint's own (`model.layers.0.self_attn.q_proj.weight`).

Remote code (`auto_map`) is never run unless the user sets model.trust_remote_code=true.
Test: `python -m pytest tests/test_architectures.py -q`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import sys
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from moai_recipes.errors import UserError
from moai_recipes.models.attention import Documents

ATTENTION = "moai"  # our attention implementation's name in transformers' registries
DOCUMENTS = "moai_documents"  # the keyword a packed row's Documents reaches every layer and attention call by
# Children of a decoder layer that mix tokens without the attention interface (linear attention, state-space and
# convolution mixers): on packed rows they run document by document. A layer whose kind (config.layer_types) is
# one of RECURRENT_KINDS has its mixer under one of these names or an attention's (MiniMax's lightning attention).
MIXERS = ("linear_attn", "mamba", "mixer", "conv", "short_conv", "ssm")
RECURRENT_KINDS = ("linear_attention", "mamba", "conv", "recurrent", "linear", "rwkv")
# Keywords a model passes its attention function that change what it computes beyond the mask (attention sinks,
# logit soft-capping, position biases): a block with any of them runs through the model's own function.
_SPECIAL = ("s_aux", "sinks", "softcap", "position_bias")

# What a base model calls its final norm (the library's head runs it: it is swapped out of the base's forward).
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm", "embedding_norm")

_documents: contextvars.ContextVar[Documents | None] = contextvars.ContextVar("moai_documents", default=None)
# Set while the planner traces a layer on real tensors (planner/activations.py): a mask is then what its request
# says, as under FakeTensorMode, and its confirmation (once a forward, LazyMask.is_plain) is not counted as the
# layer's own work in every layer.
_as_asked: contextvars.ContextVar[bool] = contextvars.ContextVar("moai_masks_as_asked", default=False)


@contextlib.contextmanager
def masks_as_asked():
    """Masks taken as their request says, their first rows not confirmed (the planner's traces on real tensors)."""
    token = _as_asked.set(True)
    try:
        yield
    finally:
        _as_asked.reset(token)


# ---------------------------------------------------------------------------------------------------------------
# Attention and masks, as transformers' interfaces take them.


class LazyMask:
    """What a model asked transformers' mask interface for (its mask function over positions, the sizes, the
    padding), built only where attention needs it: the block of one document, or the whole batch."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        self._plain: dict[tuple, bool] = {}

    def __getitem__(self, index) -> "LazyMask":
        """The mask of some of its queries (mask[:, :, rows, :], as a model that keeps the last positions slices it)."""
        assert isinstance(index, tuple) and len(index) == 4 and all(i == slice(None) for i in index[:2] + index[3:]), \
            index
        start, stop, step = index[2].indices(self.kwargs["q_length"])
        assert step == 1, index
        if (start, stop) == (0, self.kwargs["q_length"]):
            return self
        return LazyMask({**self.kwargs, "q_length": stop - start, "q_offset": self.kwargs.get("q_offset", 0) + start})

    def dense(self, *, boolean: bool, dtype: torch.dtype) -> torch.Tensor | None:
        """The whole mask as transformers' SDPA (boolean) or eager (additive) attention takes it."""
        from transformers.masking_utils import eager_mask, sdpa_mask

        kw = {**self.kwargs, "allow_is_causal_skip": False}
        return sdpa_mask(**kw) if boolean else eager_mask(**{**kw, "dtype": dtype})

    def block(self, start: int, length: int, *, boolean: bool, dtype: torch.dtype) -> torch.Tensor:
        """The mask of positions start .. start + length against themselves (one packed document)."""
        from transformers.masking_utils import sdpa_mask

        kw = {k: v for k, v in self.kwargs.items() if k not in ("dtype", "config")}
        kw.update(q_length=length, kv_length=length, q_offset=start, kv_offset=start, allow_is_causal_skip=False)
        mask = sdpa_mask(**kw)
        if boolean:
            return mask
        return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)

    def rectangle(self, q_start: int, q_length: int, k_start: int, k_length: int, *, boolean: bool,
                  dtype: torch.dtype) -> torch.Tensor:
        """The mask of queries at q_start .. + q_length against keys at k_start .. + k_length."""
        from transformers.masking_utils import sdpa_mask

        kw = {k: v for k, v in self.kwargs.items() if k not in ("dtype", "config")}
        kw.update(q_length=q_length, kv_length=k_length, q_offset=q_start, kv_offset=k_start,
                  allow_is_causal_skip=False)
        mask = sdpa_mask(**kw)
        if boolean:
            return mask
        return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)

    def is_plain(self, start: int | None = None, length: int | None = None) -> bool:
        """Whether the block (or, without `start`, the whole mask) is the causal triangle and nothing else: then
        SDPA's own causal kernel computes it, and no mask is built. What transformers asked says so (no padding, no
        other mask function, a window or chunk no shorter than the block); a real mask's first rows confirm it,
        once a mask and block (a forward's layers of one kind share their mask). In the planner's traces (under
        FakeTensorMode, or on real tensors within masks_as_asked) the request alone decides."""
        key = (start, length)
        if key not in self._plain:
            kw = self.kwargs
            whole = start is None
            n = kw["q_length"] if whole else length
            plain = (kw.get("attention_mask") is None and not kw.get("use_vmap")
                     and (kw.get("local_size") is None or n <= kw["local_size"])
                     and (not whole or (not kw.get("q_offset") and not kw.get("kv_offset")
                                        and kw["q_length"] == kw["kv_length"])))
            if plain and not _as_asked.get() and torch._guards.detect_fake_mode() is None:
                m = min(n, _CHECKED_ROWS)
                head = self.block(0 if whole else start, m, boolean=True, dtype=torch.float32)
                plain = head is None or bool(_is_causal(head))
            self._plain[key] = plain
        return self._plain[key]


# Rows of a mask that confirm what its request says (a block's first rows against themselves): a mask function
# other than causal, windowed and per document shows there; its whole square would cost n^2 bytes.
_CHECKED_ROWS = 512


def _is_causal(mask: torch.Tensor) -> torch.Tensor:
    n, m = mask.shape[-2:]
    return torch.equal(mask, torch.ones(n, m, dtype=torch.bool, device=mask.device).tril().expand_as(mask))


def _lazy_mask(**kwargs) -> LazyMask:
    """transformers' mask interface for ATTENTION: nothing is built yet."""
    return LazyMask(kwargs)


def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' attention interface for ATTENTION: query [batch, heads, q, head_dim], key and value [batch,
    kv heads, k, head_dim], the model's `dropout` and `scaling` among the keywords; returns ([batch, q, heads,
    head_dim], None) as transformers' own functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dropout, scaling = kwargs.pop("dropout", 0.0), kwargs.pop("scaling", None)
    documents = kwargs.pop(DOCUMENTS, None)
    special = any(kwargs.get(k) is not None for k in _SPECIAL)
    own = _own_attention(module)

    def plain(q, k, v):
        return sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                      **kwargs)[0]

    def masked(q, k, v, mask):
        return own(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0]

    boolean = own is _sdpa()
    if type(module).__name__.endswith("CrossAttention"):  # text to pictures (Llama 3.2 Vision): the model's own mask
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if hasattr(documents, "attend"):  # a context device's share of a row: the gather way, under the model's masks
        lazy = documents.row_masks[module.layer_idx]

        def block(q_start, q_length, k_start, k_length):
            return lazy.rectangle(q_start, q_length, k_start, k_length, boolean=boolean, dtype=query.dtype)

        return documents.attend_blocks(query, key, value, block, masked), None
    if documents is None or query.shape[2] != documents.offsets[-1]:
        if isinstance(attention_mask, LazyMask):
            if not special and attention_mask.is_plain():
                return plain(query, key, value), None
            attention_mask = attention_mask.dense(boolean=boolean, dtype=query.dtype)
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    assert query.shape[0] == 1, "a packed row is a micro-batch of one row"
    lazy = attention_mask if isinstance(attention_mask, LazyMask) else None
    outs = []
    n = list(documents.lengths)
    for start, q, k, v in zip(documents.offsets, query.split(n, dim=2), key.split(n, dim=2), value.split(n, dim=2)):
        length = q.shape[2]
        if lazy is None:  # no mask at all (transformers built none): causal within the document
            outs.append(plain(q, k, v) if not special else masked(q, k, v, None))
        elif not special and lazy.is_plain(start, length):
            outs.append(plain(q, k, v))
        else:
            outs.append(masked(q, k, v, lazy.block(start, length, boolean=boolean, dtype=q.dtype)))
    return torch.cat(outs, dim=1), None


@functools.cache
def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


# The attention a model family computes itself, by its Python module: SDPA where the model supports it, else the
# family's own eager function (gpt-oss's sinks: transformers refuses SDPA for it).
_OWN: dict[str, object] = {}


def _own_attention(module: nn.Module):
    return _OWN.get(type(module).__module__) or _sdpa()


def _remember_own_attention(causal_lm: nn.Module) -> None:
    for m in causal_lm.modules():
        name = type(m).__module__
        if name in _OWN or not name.startswith("transformers.models."):
            continue
        family = sys.modules[name]
        eager = getattr(family, "eager_attention_forward", None)
        _OWN[name] = _sdpa() if getattr(type(causal_lm), "_supports_sdpa", False) or eager is None else eager


@functools.cache
def register() -> None:
    """Our attention and mask functions in transformers' registries, once a process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attend)
    AttentionMaskInterface.register(ATTENTION, _lazy_mask)
    _grouped_experts_where_they_run()


def _grouped_experts_where_they_run() -> None:
    """transformers' grouped experts (its default experts implementation) call PyTorch's grouped product on the CPU
    whatever the dtype, where torch 2.13 takes bf16 only; its own loop over the experts (an operator with a shape
    function: the planner traces it on fake tensors) runs there instead."""
    from transformers.integrations import moe

    can_use = moe._can_use_grouped_mm
    if getattr(can_use, "moai", False):
        return

    def where_it_runs(input, weight, offs):
        return can_use(input, weight, offs) and not (weight.device.type == "cpu" and weight.dtype != torch.bfloat16)

    where_it_runs.moai = True
    moe._can_use_grouped_mm = where_it_runs


# ---------------------------------------------------------------------------------------------------------------
# Sequence mixers other than attention, document by document.


def _per_document(forward):
    """A mixer's forward that, on a packed row, runs each document alone (its state starts from zero at each)."""

    @functools.wraps(forward)
    def mixed(hidden_states, *args, **kwargs):
        documents = _documents.get()
        if documents is None or hidden_states.shape[1] != documents.offsets[-1]:
            return forward(hidden_states, *args, **kwargs)
        parts = hidden_states.split(list(documents.lengths), dim=1)
        outs = [forward(part, *args, **kwargs) for part in parts]
        if isinstance(outs[0], tuple):
            return (torch.cat([o[0] for o in outs], dim=1), *outs[0][1:])
        return torch.cat(outs, dim=1)

    return mixed


def _documents_known(forward):
    """A decoder layer's forward that makes its row's Documents known to what it calls (mixers read them), also when
    recomputed in the backward pass (the keyword comes with the saved inputs)."""

    @functools.wraps(forward)
    def layer(*args, **kwargs):
        token = _documents.set(kwargs.get(DOCUMENTS))
        try:
            return forward(*args, **kwargs)
        finally:
            _documents.reset(token)

    return layer


# ---------------------------------------------------------------------------------------------------------------
# The decoder.


def config_object(config: Mapping, *, trust_remote_code: bool = False, folder=None):
    """transformers' config object for a config.json's fields; what transformers cannot build is a UserError naming
    why. Code from the Hub (`auto_map`) runs only with `trust_remote_code`, from the checkpoint `folder`."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {k: _plain(v) for k, v in config.items() if k not in ("transformers_version", "architectures", "auto_map")}
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise UserError("config.json names no model_type; is it a Hugging Face model's config.json?")
    if model_type not in CONFIG_MAPPING:
        if "auto_map" not in config:
            raise UserError(f"model_type {model_type!r} is not known to the installed transformers "
                            f"{transformers.__version__}; a newer transformers may know it (pip install -U "
                            "transformers)")
        if not trust_remote_code:
            raise UserError(f"model_type {model_type!r} is defined by code that comes with the checkpoint "
                            f"(config.json's auto_map), which is not run unless you say so: set "
                            f"model.trust_remote_code=true if you trust its authors")
        if folder is None:
            raise UserError(f"model_type {model_type!r} is defined by code that comes with the checkpoint; set "
                            "model.checkpoint_dir to the folder that holds it")
        try:
            return AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
        except Exception as e:  # the author's code: whatever it raises is theirs to fix
            raise UserError(f"the code of {folder} (config.json's auto_map) fails to make its config: {e}") from None
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 - what transformers' validation of the user's config.json says
        raise UserError(f"config.json of model_type {model_type!r} is not one transformers "
                        f"{transformers.__version__} accepts: {e}") from None


def _plain(value):
    """A config value as JSON would give it (a model entry's architecture comes as OmegaConf containers)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def causal_lm_class(config, *, trust_remote_code: bool = False):
    """transformers' causal LM class for a config object; a UserError for what is not a decoder-only causal LM."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) in mapping:
        cls = mapping[type(config)]
        if "ConditionalGeneration" not in cls.__name__ and not getattr(config.get_text_config(),
                                                                     "cross_attention_layers", None):
            return cls  # a multimodal checkpoint's language model trains alone
    image_text = image_text_class(config)
    if image_text is not None:
        return image_text
    if type(config) in mapping:
        raise UserError(f"model_type {config.model_type!r} is a multimodal model ({mapping[type(config)].__name__}) "
                        "whose other inputs are not trained here. A text-only checkpoint of its language model trains "
                        f"(model_type {config.get_text_config().model_type!r})")
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return None  # built by AutoModelForCausalLM.from_config(trust_remote_code=True)
    raise UserError(f"model_type {config.model_type!r} has no causal language model in transformers (not a "
                    "decoder-only LM: an encoder, a sequence-to-sequence or a vision model?); only causal LMs are "
                    "fine-tuned here")


def image_text_class(config):
    """transformers' image-text-to-text class of a config (Qwen2.5-VL, Qwen3-VL, Gemma 3: images as embeddings among
    the text's; Llama 3.2 Vision: images read by cross-attention layers); None for any other config."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText._model_mapping.get(type(config), None)


class TransformersDecoder(nn.Module):
    """A transformers causal LM as the decoder the rest of the library sees. Its children are the causal LM's own
    (`model`, `lm_head`...), so its parameter names are the checkpoint's; `tok_embeddings`, `layers`, `norm` and
    `output` name the parts the layouts shard, recompute and cut."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        self.config = causal_lm.config
        # The base model: the child that holds the input embeddings (not always `base_model_prefix`: Llama 4's says
        # language_model and holds `model`); its decoder layers, the largest list of modules; its final norm.
        embeddings = causal_lm.get_input_embeddings()
        self.base_name = next(name for name, child in causal_lm.named_children()
                              if any(m is embeddings for m in child.modules()))
        # The language model: the module whose own child the embeddings are (the base itself, or an image-text
        # model's language_model beside its vision tower).
        self.text_name = next(name for name, m in self._modules[self.base_name].named_modules()
                              if any(c is embeddings for c in m.children()))
        base = self.text_model
        lists = [(sum(p.numel() for p in child.parameters()), name) for name, child in base.named_children()
                 if isinstance(child, nn.ModuleList)]
        self.layers_name = max(lists)[1]
        self.norm_name = next((n for n in _FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module)), None)
        if self.norm_name is None:
            raise UserError(f"{type(causal_lm).__name__}: its final norm is none of {', '.join(_FINAL_NORMS)}; this "
                            "architecture is not laid out as a decoder here")
        head = causal_lm.get_output_embeddings()
        self.head_name = next(name for name, child in causal_lm.named_children() if child is head)
        self.tied = self.output.weight is self.tok_embeddings.weight
        self.__dict__["causal_lm"] = causal_lm  # not a child: its modules are ours already
        # What the causal LM does to its output projection's logits (Gemma's soft-capping, Cohere's and Granite's
        # scales...), found out by running its own forward on stand-ins: None, or the logits of a final hidden state.
        self.plain_head = _head_is_plain(causal_lm, self.base_name, self.head_name)
        self.unpackable = None  # why documents cannot share a row (models/attention.Documents); None: they can
        text = self.config.get_text_config()
        self.experts_per_token = next((getattr(text, n) for n in ("num_experts_per_tok", "top_k_experts", "moe_topk")
                                       if getattr(text, n, None)), 0)
        self.sampling = _CacheSlot()  # transformers' cache while sampling (setup_caches)
        self.decoder_max_cache_seq_len = None
        # An image-text model (its language model inside the base, beside a vision tower): its image inputs
        # (data/images.collate_images) come with the rows, forward's `images`.
        self.reads_images = self.text_name != ""
        # Llama 3.2 Vision's layers that read the pictures by cross-attention (transformers skips them for rows
        # without pictures; here they run on stand-ins that change nothing, so that every device runs every layer).
        self.cross_attention_layers = tuple(getattr(text, "cross_attention_layers", None) or ())

    # The parts, under the names the library's layouts use.
    @property
    def base(self) -> nn.Module:
        return self._modules[self.base_name]

    @property
    def text_model(self) -> nn.Module:
        """The language model (the base, or an image-text model's language_model)."""
        return self.base.get_submodule(self.text_name)

    @property
    def layers_path(self) -> str:
        """The decoder layers' name among the model's modules (`model.layers`, `model.language_model.layers`)."""
        return ".".join(n for n in (self.base_name, self.text_name, self.layers_name) if n)

    @property
    def tok_embeddings(self) -> nn.Module:
        return self.base.get_input_embeddings()

    @property
    def layers(self) -> nn.ModuleList:
        return self.text_model._modules[self.layers_name]

    @property
    def norm(self) -> nn.Module:
        return self.text_model._modules[self.norm_name]

    @property
    def output(self) -> nn.Module:
        return self._modules[self.head_name]

    def forward(self, tokens: torch.Tensor, *, mask=None, input_pos: torch.Tensor | None = None,
                images: Mapping | None = None) -> torch.Tensor:
        """Logits of `tokens` [batch, tokens]. `mask`: a packed row's Documents (each document attends to itself; then
        `input_pos` restarts at each), or while sampling with the cache (setup_caches) torchtune's [batch, tokens,
        cache length] boolean mask of what each token attends to; None: causal over the row. `images`: an image-text
        model's inputs besides the tokens, as its processor makes them (pixel_values, image_grid_thw,
        token_type_ids...), for the images in these rows."""
        kwargs: dict = {"use_cache": False, **(images or {})}
        if isinstance(mask, Documents) or hasattr(mask, "attend"):  # a packed row, or a context device's share of one
            kwargs[DOCUMENTS] = mask
            if images and isinstance(mask, Documents) and hasattr(self.base, "get_rope_index"):
                input_pos = self._packed_positions(tokens, mask, images)
            elif input_pos is None:
                input_pos = mask.positions(tokens.device)
            if hasattr(mask, "attend"):
                self._row_masks(mask, tokens.device)
        elif mask is not None or self.caches_are_enabled():
            kwargs.update(self._cached_inputs(tokens, mask))
        if self.cross_attention_layers and not images:
            kwargs.update(self._stand_ins(tokens))
        if input_pos is not None and input_pos.dim() < 2:  # torchtune's generate squeezes a single row's positions
            input_pos = input_pos.reshape(1, tokens.shape[1]).expand(tokens.shape[0], -1)
        # The final norm runs in unembed (the chunked loss's head).
        with _swapped(self.text_model, self.norm_name, _NO_NORM):
            hidden = self.base(input_ids=tokens, position_ids=input_pos, **kwargs).last_hidden_state
        if self.reads_images and not images and torch.is_grad_enabled():
            # Rows without images leave the vision tower out of the graph; each of its weights still gets a (zero)
            # gradient, so that every device of a sharded model reduces the same gradients in a step.
            hidden = hidden + sum(p.reshape(-1)[:1].sum() for p in self.image_parameters()) * 0
        return self.unembed(hidden)

    def _packed_positions(self, tokens: torch.Tensor, documents: Documents, images: Mapping) -> torch.Tensor:
        """A packed row's multimodal rotary positions ([3, 1, row]: Qwen's time, height and width), each document's
        as the model computes them for the document alone (get_rope_index, given the document's own images: each
        image one run of image tokens in mm_token_type_ids), a document without images counting its tokens."""
        kinds, grid = images["mm_token_type_ids"], images.get("image_grid_thw")
        out, used = [], 0
        for start, n in zip(documents.offsets, documents.lengths):
            ids, own = tokens[:, start:start + n], kinds[:, start:start + n]
            starts = int(((own[0] == 1) & (torch.nn.functional.pad(own[0], (1, 0))[:-1] != 1)).sum())
            if starts:
                positions, _ = self.base.get_rope_index(ids, mm_token_type_ids=own,
                                                        image_grid_thw=grid[used:used + starts])
                used += starts
            else:
                positions = torch.arange(n, device=tokens.device).view(1, 1, n).expand(3, 1, n)
            out.append(positions)
        return torch.cat(out, dim=2)

    def image_features(self, images: Mapping) -> list[torch.Tensor]:
        """What the vision tower and projector make of a micro-batch's image inputs (the tensors the language model
        takes in place of the images' tokens, and Qwen3-VL's deep-stack features beside them), as the model's own
        get_image_features computes them."""
        import inspect

        if not hasattr(self.base, "get_image_features"):  # Llama 3.2 Vision: the tower's tiles, then the projector
            seen = self.base.vision_model(**{k: images[k] for k in ("pixel_values", "aspect_ratio_ids",
                                                                     "aspect_ratio_mask") if k in images})
            return [self.base.multi_modal_projector(seen.last_hidden_state)]
        accepted = inspect.signature(self.base.get_image_features).parameters
        out = self.base.get_image_features(**{k: v for k, v in images.items() if k in accepted})
        return [t for t in tree_leaves(out if not hasattr(out, "to_tuple") else out.to_tuple())
                if torch.is_tensor(t) and t.is_floating_point()]

    def _stand_ins(self, tokens: torch.Tensor) -> dict:
        """A cross-attention model's stand-ins (stand_in_pictures) for rows without pictures. Sampling with the cache:
        the prompts' pass caches the stand-ins' keys and values, and each decode step sees none of them (a mask of
        zeros), so that every device runs the cross-attention layers at every step, as FSDP2 needs, and each adds
        nothing; a sampling whose prompts had pictures goes on from its cache as transformers' does."""
        rows, length = tokens.shape
        holder = self.sampling.kv_cache if self.caches_are_enabled() else None
        if holder is None or holder.cache.get_seq_length() == 0:  # no cache, or the prompts' pass
            if holder is not None:
                holder.stood_in = True
            return self.stand_in_pictures(rows, length, device=tokens.device)
        if holder.stood_in:
            return {"cross_attention_mask": torch.zeros(rows, length, 1, 1, dtype=torch.long, device=tokens.device)}
        return {}

    def stand_in_pictures(self, rows: int, tokens: int, *, device, tiles: int = 1) -> dict:
        """A cross-attention model's inputs for rows without pictures (Llama 3.2 Vision): features of one picture of
        `tiles` tiles, all zeros, that no token may see. Each cross-attention layer then runs and adds exactly nothing:
        its keys and values are zeros, and the rows that see no picture have its MLP's output masked out, as
        transformers masks a text token before the first picture. transformers skips the layers instead, which FSDP2
        cannot: a device whose micro-batch has pictures gathers their weights, and every device must."""
        vision = self.base.vision_model
        dtype = self.tok_embeddings.weight.dtype
        states = torch.zeros(rows, tiles * vision.num_patches, self.config.get_text_config().hidden_size,
                             dtype=dtype, device=device)
        return {"cross_attention_states": states,
                "cross_attention_mask": torch.zeros(rows, tokens, 1, tiles, dtype=torch.long, device=device)}

    def sampling_positions(self, tokens: torch.Tensor, real: torch.Tensor, positions: torch.Tensor,
                           images: Mapping) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The positions of a sampling's prompts with their images (`tokens` left-padded, `real` where not padding,
        `positions` their text positions), and each row's offset of the decode steps' positions. A model with
        multimodal rotary positions (Qwen's get_rope_index) takes [4, rows, tokens], as transformers' generate gives
        them: the text positions, then time, height and width; a token drawn then sits at its text position moved by
        its row's offset (the prompt's largest position + 1 - its length). Other models: the text positions, None."""
        if not hasattr(self.base, "get_rope_index"):
            return positions, None
        import inspect

        accepted = inspect.signature(self.base.get_rope_index).parameters
        rope, offsets = self.base.get_rope_index(tokens, attention_mask=real.long(),
                                                 **{k: v for k, v in images.items() if k in accepted})
        return torch.cat([positions[None], rope.to(positions.dtype)]), offsets.to(positions.device)

    def image_parameters(self):
        """An image-text model's weights outside its language model and head (its vision tower and projector)."""
        text = {id(p) for p in self.text_model.parameters()} | {id(p) for p in self.output.parameters()}
        return (p for p in self.base.parameters() if id(p) not in text and p.requires_grad)

    def _row_masks(self, share, device) -> None:
        """The whole row's masks of a context device's share (train/context_parallel.ContextShare), each layer's as
        the model makes it (what its queries may see of the row's keys), once a row: the model's forward run over the
        row's places with its layers standing in (nothing computed but the embeddings and rotary tables)."""
        if share.row_masks is not None:
            return
        masks: dict[int, object] = {}
        stand_ins = nn.ModuleList(_MaskRecorder(i, masks) for i in range(len(self.layers)))
        row = share.documents
        ids = torch.zeros(1, row.offsets[-1], dtype=torch.long, device=device)
        text = self.text_model
        with _swapped(text, self.layers_name, stand_ins), _swapped(text, self.norm_name, _NO_NORM), torch.no_grad():
            self.base(input_ids=ids, position_ids=row.positions(device), use_cache=False, **{DOCUMENTS: row})
        share.keep_row_masks(masks)

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm, the output projection and what the model does to its logits (soft-capping, scales)."""
        return self.logits(self.norm(hidden))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The output projection of final-norm hidden states, and what the causal LM's own forward does after it."""
        if self.plain_head:
            return self.output(normed)
        with _swapped(self.causal_lm, self.base_name, _Given(normed)):
            return self.causal_lm(input_ids=torch.zeros(normed.shape[:2], dtype=torch.long, device=normed.device),
                                  use_cache=False).logits

    # Sampling with transformers' cache, under torchtune's protocol (local_kv_cache, disable_kv_cache, generate).
    def setup_caches(self, batch_size: int, dtype: torch.dtype, *, encoder_max_seq_len=None,
                     decoder_max_seq_len: int | None = None) -> None:
        self.sampling.kv_cache = _Cache(self.config)
        self.sampling.cache_enabled = True
        self.decoder_max_cache_seq_len = decoder_max_seq_len

    def caches_are_setup(self) -> bool:
        return self.sampling.kv_cache is not None

    def caches_are_enabled(self) -> bool:
        return self.caches_are_setup() and self.sampling.cache_enabled

    def reset_caches(self) -> None:
        if self.caches_are_setup():
            self.sampling.kv_cache = _Cache(self.config)

    @property
    def _kv_cache(self):
        return self.sampling.kv_cache.cache if self.caches_are_enabled() else None

    def _cached_inputs(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> dict:
        """transformers' inputs for a step of sampling: the cache (if enabled), and the padding mask of everything up
        to this step's last token (a torchtune mask's last row)."""
        cache = self._kv_cache
        past = cache.get_seq_length() if cache is not None else 0
        out = {"use_cache": cache is not None, "cache": cache}
        if mask is not None:
            padding = mask[:, -1, :past + tokens.shape[1]]
            # No padding: transformers' causal mask needs none (its plain triangle). Whether the prompts are padded is
            # read from the device once a sampling (its first pass): a decode step adds real tokens only.
            holder = self.sampling.kv_cache if cache is not None else None
            padded = holder.padded if holder is not None and past else None
            if padded is None:
                padded = not bool(padding.all())
                if holder is not None:
                    holder.padded = padded
            if padded:
                out["attention_mask"] = padding.to(torch.long)
        return out

    def cache_bytes(self) -> int:
        """Bytes the sampling cache holds now."""
        cache = self.sampling.kv_cache.cache if self.caches_are_setup() else None
        if cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t))


class _MaskRecorder(nn.Module):
    """A decoder layer's stand-in that keeps the mask the model's forward gives it, and passes its input on."""

    def __init__(self, index: int, masks: dict):
        super().__init__()
        self.index, self.masks = index, masks

    def forward(self, hidden_states, *args, **kwargs):
        self.masks[self.index] = kwargs.get("attention_mask")
        return hidden_states


class _CacheSlot(nn.Module):
    """Where transformers' cache lives while sampling, held as torchtune's attention modules hold theirs (`kv_cache`,
    `cache_enabled`): torchtune's local_kv_cache, delete_kv_caches and disable_kv_cache find it."""

    def __init__(self):
        super().__init__()
        self.kv_cache: _Cache | None = None
        self.cache_enabled = False


class _Cache(nn.Module):
    """transformers' own cache (DynamicCache: sliding layers keep their window, linear ones their state)."""

    def __init__(self, config):
        from transformers import DynamicCache

        super().__init__()
        self.cache = DynamicCache(config=config)
        self.padded: bool | None = None  # whether the prompts sampled from are padded (TransformersDecoder._cached_inputs)
        self.stood_in = False  # whether the prompts' pass ran cross-attention on stand-ins (_stand_ins)

    def forward(self, *args):
        raise RuntimeError("transformers' cache is passed to its model, not called")


_NO_NORM = nn.Identity()  # one module for every forward (PyTorch's module trackers keep weak references to it)


class _Given(nn.Module):
    """A base model that returns the hidden states it was given: the causal LM's forward then computes its head."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _GivenOutput(self.hidden)


class _GivenOutput:
    """A base model's output holding only its last hidden states (anything else a causal LM reads of it is None)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name):
        return None

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]


def _head_is_plain(causal_lm: nn.Module, base_name: str, head_name: str) -> bool:
    """Whether the causal LM's logits are its output projection's and nothing more: its forward run on the CPU with a
    small random projection and hidden states standing in for its own."""
    generator = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        hidden = torch.randn(1, 3, 8, generator=generator)
        head = nn.Linear(8, 16, bias=False)
    with torch.no_grad(), torch.device("cpu"):
        head.weight.copy_(torch.randn(16, 8, generator=generator))
        with _swapped(causal_lm, base_name, _Given(hidden)), _swapped(causal_lm, head_name, head):
            logits = causal_lm(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False).logits
        return logits.shape == (1, 3, 16) and torch.equal(logits.float(), head(hidden).float())


@contextlib.contextmanager
def _swapped(module: nn.Module, name: str, replacement: nn.Module):
    original = module._modules[name]
    module._modules[name] = replacement
    try:
        yield
    finally:
        module._modules[name] = original


def build_transformers_model(config, *, trust_remote_code: bool = False) -> TransformersDecoder:
    """The causal LM of a transformers config object as a TransformersDecoder, with our attention: its parameters
    where the current device is (use meta), its buffers (rotary tables) computed on the CPU and kept to be put back
    after the parameters get memory (init_buffers)."""
    model = TransformersDecoder(_causal_lm(config, trust_remote_code=trust_remote_code))
    types = list(getattr(model.config.get_text_config(), "layer_types", None) or [])
    for i, layer in enumerate(model.layers):
        layer.forward = _documents_known(layer.forward)
        recurrent = i < len(types) and types[i] in RECURRENT_KINDS
        mixers = [getattr(layer, n) for n in (*MIXERS, *(("self_attn", "attention", "attn") if recurrent else ()))
                  if isinstance(getattr(layer, n, None), nn.Module)]
        for mixer in mixers[:1 if recurrent else None]:
            mixer.forward = _per_document(mixer.forward)
        if recurrent and not mixers:  # a token mixer of its own, not found: its state would cross documents
            model.unpackable = (f"its {types[i]} layers mix tokens with a module of their own, which would carry "
                                "one document's state into the next")
    if model.cross_attention_layers:
        model.unpackable = ("its text tokens before a picture attend to every picture tile of the row (transformers' "
                            "cross-attention mask of Llama 3.2 Vision), which would be other documents' pictures")
    _record_routing(model)
    # Buffers that are not in any checkpoint (rotary tables): computed now, put back by init_buffers.
    model._initial_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return model


def _record_routing(model: TransformersDecoder) -> None:
    """A Mixture-of-Experts model's routers, found as transformers records their logits (`router_logits`), each made to
    give what it decides to the routing a training step records (models/moe.Routing: the balancing loss and the
    experts' load): each token's router probabilities (softmax of its logits) and its top-k experts by them, as
    transformers' load_balancing_loss_func reads the logits."""
    text = model.text_model
    recorder = type(text).__dict__.get("_can_record_outputs") or getattr(text, "_can_record_outputs", {})
    recorder = (recorder or {}).get("router_logits")
    if recorder is None:
        return
    target, index = getattr(recorder, "target_class", recorder), getattr(recorder, "index", 0)
    top_k = model.experts_per_token
    for i, layer in enumerate(model.layers):
        for router in (m for m in layer.modules() if isinstance(m, target)):

            def record(module, args, out, layer=i):
                routing = module.routing
                if routing is None:
                    return
                logits = out[index] if isinstance(out, tuple) else out
                probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
                routing.record(layer, probs, probs.topk(top_k, dim=-1).indices)

            router.routing = None  # set while a forward records (models/moe.routing_recorded)
            router.register_forward_hook(record)


def _causal_lm(config, *, trust_remote_code: bool = False) -> nn.Module:
    """transformers' causal LM of a config object, our attention set; on the meta device where that is the current
    one (its buffers computed on the CPU all the same)."""
    from transformers import AutoModelForCausalLM

    register()
    cls = causal_lm_class(config, trust_remote_code=trust_remote_code)
    if cls is None:
        causal_lm = AutoModelForCausalLM.from_config(config, trust_remote_code=True, attn_implementation=ATTENTION)
    elif image_text_class(config) is cls:  # an image-text model: our attention in its language model, its vision
        # tower's own (SDPA over each image's patches)
        sub = {name: ("sdpa" if name != "text_config" else ATTENTION) for name in config.sub_configs}
        causal_lm = cls._from_config(config, attn_implementation={"": ATTENTION, **sub})
    else:  # a multimodal config's language model takes its text config (Qwen3.5's)
        text = config if isinstance(config, cls.config_class) else config.get_text_config()
        causal_lm = cls._from_config(text, attn_implementation=ATTENTION)
    if any(b.is_meta for b in causal_lm.buffers()):
        _real_buffers(causal_lm)
    _remember_own_attention(causal_lm)
    return causal_lm


@torch.no_grad()
def _real_buffers(causal_lm: nn.Module) -> None:
    """A causal LM built on the meta device given its buffers (rotary tables, embedding scales) on the CPU, computed by
    transformers' own initialisation, as its from_pretrained does after building on meta."""
    from transformers import PreTrainedModel

    # Each module is initialised by the nearest model that holds it (an image-text model's vision tower is a model of
    # its own, whose initialisation knows its embeddings' positions).
    models = [(name, m) for name, m in causal_lm.named_modules() if isinstance(m, PreTrainedModel)]
    owners = {}
    for name, buffer in list(causal_lm.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = causal_lm.get_submodule(owner)
        module._buffers[leaf] = torch.zeros_like(buffer, device="cpu")
        holder = max(((n, m) for n, m in models if not n or owner == n or owner.startswith(n + ".")),
                     key=lambda item: len(item[0]))[1]
        owners[id(module)] = (module, holder)
    with torch.device("cpu"):  # what the initialisation computes on the default device (the caller's meta)
        for module, holder in owners.values():
            holder._init_weights(module)


def _config_of(spec):
    return config_object(json.loads(spec.hf_config), trust_remote_code=spec.code_dir is not None, folder=spec.code_dir)


def model_of(spec, *, lora: dict | None = None, quantize_base: bool = False) -> TransformersDecoder:
    """The TransformersDecoder of a spec (implementation "transformers"), where the current device is; with LoRA
    adapters (LoraOptions.builder_kwargs()) and under QLoRA its other linear weights in NF4."""
    model = build_transformers_model(_config_of(spec), trust_remote_code=spec.code_dir is not None)
    if lora is not None:
        add_adapters(model, lora, quantize_base=quantize_base)
    return model


def causal_lm_of(spec) -> nn.Module:
    """transformers' causal LM of a spec on the meta device: what its checkpoint's names are converted with."""
    with torch.device("meta"):
        return _causal_lm(_config_of(spec), trust_remote_code=spec.code_dir is not None)


def restore_buffers(model: TransformersDecoder, device) -> None:
    """After the parameters got memory (to_empty): the buffers computed when the model was built, and the output tied
    to the embedding again where the model ties them (to_empty gives each module's parameters memory of their own)."""
    if model.tied:
        model.output._parameters["weight"] = model.tok_embeddings._parameters["weight"]
    for name, value in model._initial_buffers.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        module._buffers[leaf] = value.to(device)


# ---------------------------------------------------------------------------------------------------------------
# What the planner needs of an architecture it has no formula for.


def map_tensors(value, fn):
    """`value` with `fn` applied to each tensor in it (in tuples, lists and mappings, each rebuilt as its own type:
    Gemma 4's KVSharingDict among them); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        out = type(value)()
        for k, v in value.items():
            out[k] = map_tensors(v, fn)
        return out
    return value


def _leaves(value):
    """`value` with each tensor in it a leaf of its own: detached, needing a gradient where it did."""
    return map_tensors(value, lambda t: t.detach().requires_grad_(t.requires_grad))


class _Captured(Exception):
    def __init__(self, args, kwargs):
        super().__init__()
        self.args, self.kwargs = args, kwargs


def layer_call(model: TransformersDecoder, index: int, *, tokens: int, documents: Documents | None = None,
               rows: int = 1):
    """(args, kwargs) the base model's forward calls decoder layer `index` with on `rows` rows of `tokens` tokens (one
    of packed `documents`, if given): what the planner traces the layer with. The layers before it run for what they leave to
    later ones (Gemma 4's shared keys and values); under FakeTensorMode nothing is computed."""
    layer = model.layers[index]
    had = "forward" in layer.__dict__
    original = layer.__dict__.get("forward")

    def capture(*args, **kwargs):
        raise _Captured(args, kwargs)

    layer.forward = capture
    ids = torch.zeros(rows, tokens, dtype=torch.long)
    kwargs = {} if documents is None else {DOCUMENTS: documents, "position_ids": documents.positions(ids.device)}
    if index in model.cross_attention_layers:  # it reads a picture: one of the most tiles the model cuts one into
        tiles = getattr(model.config.vision_config, "max_num_tiles", 1)
        kwargs.update(model.stand_in_pictures(rows, tokens, device=ids.device, tiles=tiles))
    try:
        model.base(input_ids=ids, use_cache=False, **kwargs)
    except _Captured as c:
        # What earlier layers made for this one (Gemma 4's shared keys and values) needs a gradient as it does in
        # training, and sends it no further: leaves of their own.
        return _leaves(c.args), _leaves(c.kwargs)
    finally:
        if had:
            layer.forward = original
        else:
            del layer.forward
    raise AssertionError(f"the base model's forward never called layer {index}")


def transformers_spec(config: Mapping, *, trust_remote_code: bool = False, folder=None):
    """The ModelSpec of a config.json that transformers' modules build: the usual dimensions where the config names
    them, and the parameters counted by part on the model built on the meta device."""
    from moai_recipes.models.spec import ModelSpec

    obj = config_object(config, trust_remote_code=trust_remote_code, folder=folder)
    remote = trust_remote_code and getattr(obj, "auto_map", None) and type(obj).__module__.startswith(
        "transformers_modules")
    with torch.device("meta"):
        model = build_transformers_model(obj, trust_remote_code=bool(remote))
    parts = describe(model)
    text = obj.get_text_config()

    stored = text.to_dict()

    def value(name):
        try:
            return getattr(text, name, None)
        except AttributeError:
            return None
        except Exception:  # a per-layer attribute (Gemma 4's head_dim: 256, 512 on global layers): the config's own
            return stored.get(name)

    def field(*names, default=None):
        return next((value(n) for n in names if value(n) is not None), default)

    embed = field("hidden_size", "d_model", "n_embd")
    heads = field("num_attention_heads", "n_head", default=1)
    experts = field("num_experts", "num_local_experts", "n_routed_experts", default=0)
    return ModelSpec(
        family=str(config.get("model_type")), vocab_size=field("vocab_size"), num_layers=len(parts.layers),
        num_heads=heads, num_kv_heads=field("num_key_value_heads", default=heads), embed_dim=embed,
        intermediate_dim=field("intermediate_size", "moe_intermediate_size", default=4 * embed),
        head_dim=field("head_dim", default=embed // heads), max_position_embeddings=field("max_position_embeddings",
                                                                                          default=2048),
        rope_base=0.0, norm_eps=float(field("rms_norm_eps", "layer_norm_eps", "norm_eps", default=1e-6)),
        tie_word_embeddings=parts.output == 0, rope_scaling=None, attention_bias=False,
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        num_experts=int(experts or 0), experts_per_token=int(field("num_experts_per_tok", "top_k_experts",
                                                                   default=0) or 0),
        expert_dim=int(field("moe_intermediate_size", default=0) or 0),
        # Its sparse layers (those with routed experts), and the balancing loss where the model has one (as TRL adds
        # it: a config that can output router logits, its own coefficient).
        moe_layers=tuple(i for i, kind in enumerate(parts.kinds) if ", sparse" in kind),
        router_aux_loss_coef=float(field("router_aux_loss_coef", default=0.0) or 0.0) if _balances(obj) else 0.0,
        implementation="transformers", hf_config=json.dumps(_plain(config), sort_keys=True),
        code_dir=str(folder) if remote else None, parts=parts, reads_images=model.reads_images)


def experts_of(layer: nn.Module) -> nn.Module | None:
    """A sparse layer's routed experts as transformers' experts interface holds them (a module of its
    `use_experts_implementation`: forward(hidden states [T, dim], top-k experts [T, k], their weights [T, k]), weights
    stacked along the experts), or None."""
    for module in layer.modules():
        if hasattr(module, "num_experts") and hasattr(module, "is_concatenated") and hasattr(module, "has_gate"):
            return module
    return None


def _balances(config) -> bool:
    """Whether transformers' causal LM of `config` adds a load-balancing loss when asked for its router logits (its
    config can output them and its forward computes the loss: Llama 4's does not)."""
    import inspect

    if not hasattr(config.get_text_config(), "output_router_logits"):
        return False
    cls = causal_lm_class(config)
    return cls is not None and "load_balancing_loss_func" in inspect.getsource(sys.modules[cls.__module__])


def describe(model: TransformersDecoder):
    """A model's parameters counted by part (spec.Parts), on the meta device."""
    from moai_recipes.models.spec import Parts

    text = model.config.get_text_config()
    experts = next((getattr(text, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, n, None)), 0)
    top_k = next((getattr(text, n) for n in ("num_experts_per_tok", "top_k_experts", "moe_topk")
                  if getattr(text, n, None)), 0)
    types = list(getattr(text, "layer_types", None) or [])
    seen, in_layers, layers, active, kinds, layer_tensors, routed_layers = set(), set(), [], [], [], [], []
    signatures: dict[str, list] = {}
    for i, layer in enumerate(model.layers):
        params = [(n, p) for n, p in layer.named_parameters() if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        count = sum(p.numel() for _, p in params)
        routed = sum(p.numel() for n, p in params if ".experts." in f".{n}" and "shared" not in n)
        routed_layers.append(routed)
        layers.append(count)
        active.append(count - routed + (routed * top_k // experts if experts and top_k else routed))
        layer_tensors.append(len(params))
        mixer = types[i] if i < len(types) else "attention"
        label = f"{mixer}, {'sparse' if routed else 'dense'}"
        signature = tuple((n, tuple(p.shape)) for n, p in params)
        shapes = signatures.setdefault(label, [])
        if signature not in shapes:
            shapes.append(signature)
        kinds.append(label if shapes.index(signature) == 0 else f"{label} #{shapes.index(signature) + 1}")
    in_layers = seen
    root_params = [p for p in model.parameters() if id(p) not in in_layers]
    sparse = [i for i, kind in enumerate(kinds) if ", sparse" in kind]
    dispatchable = bool(sparse) and all(experts_of(model.layers[i]) is not None for i in sparse)
    return Parts(root=sum(p.numel() for p in root_params), layers=tuple(layers), active_layers=tuple(active),
                 kinds=tuple(kinds), tensors=len(root_params) + sum(layer_tensors),
                 output=0 if model.tied else sum(p.numel() for p in model.output.parameters()),
                 layer_tensors=tuple(layer_tensors), unpackable=model.unpackable, routed=tuple(routed_layers),
                 experts_dispatchable=dispatchable)
# ---------------------------------------------------------------------------------------------------------------
# LoRA and QLoRA on transformers' modules.

# An attention's projections by the role the `lora.attn_modules` option names (torchtune's names), as
# transformers' families call them: the first present is adapted (a fused qkv_proj once, for any of q, k, v).
ROLES = {"q_proj": ("q_proj", "q_a_proj", "q_b_proj", "qkv_proj", "query", "c_attn", "Wqkv"),
         "k_proj": ("k_proj", "kv_a_proj_with_mqa", "kv_b_proj", "qkv_proj", "key", "c_attn", "Wqkv"),
         "v_proj": ("v_proj", "kv_b_proj", "qkv_proj", "value", "c_attn", "Wqkv"),
         "output_proj": ("o_proj", "out_proj", "dense", "c_proj", "wo")}
# A decoder layer's MLP, by what transformers' families call it; a router inside it is never adapted.
_MLPS = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_ROUTERS = ("gate", "router")


def adapted_linears(model: TransformersDecoder, targets) -> list[str]:
    """The names of the linear modules `targets` (models/lora.LoraOptions) puts adapters on, in the decoder layers
    (and the output projection with apply_to_output), and every one of an image-text model's vision tower or projector
    where lora.vision or lora.projector is lora."""
    names = []
    for i, layer in enumerate(model.layers):
        prefix = f"{model.layers_path}.{i}."
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and _adapted(name, layer, targets):
                names.append(prefix + name)
    if targets.apply_to_output:
        names.append(model.head_name)
    adapted_parts = {part for part in ("vision", "projector") if getattr(targets, part, "frozen") == "lora"}
    if adapted_parts:
        names += [name for name, module in model.named_modules()
                  if isinstance(module, nn.Linear) and image_part(model, name) in adapted_parts]
    return names


# What an image-text model's projector (the vision features into the language model's width) is called, where it is
# not inside the vision tower (Gemma's multi_modal_projector) or is (Qwen's merger and deep-stack mergers).
_PROJECTORS = ("multi_modal_projector", "mm_projector", "merger", "deepstack_merger_list", "connector", "projector")


def image_part(model: TransformersDecoder, name: str) -> str | None:
    """"vision" or "projector" for a module or parameter of an image-text model's vision side; None for the
    language model's and the head's."""
    if not model.reads_images or not name.startswith(f"{model.base_name}."):
        return None
    if name.startswith(f"{model.base_name}.{model.text_name}."):
        return None
    return "projector" if any(part in _PROJECTORS for part in name.split(".")) else "vision"


def _whole_modules(model: TransformersDecoder, part: str) -> list[str]:
    """The fewest modules that hold every parameter of `part` and nothing else (PEFT's modules_to_save)."""
    out = []

    def visit(prefix: str, module: nn.Module) -> None:
        names = [f"{prefix}.{n}" for n, _ in module.named_parameters()]
        container = isinstance(module, (nn.ModuleList, nn.ModuleDict))  # PEFT wraps a module, not a list of them
        if names and not container and all(image_part(model, n) == part for n in names):
            out.append(prefix)
            return
        if any(image_part(model, f"{prefix}.{n}") == part for n, _ in module.named_parameters(recurse=False)):
            raise UserError(f"{prefix} holds weights of the {part} beside others; lora.{part}=full cannot train it "
                            "whole here (use lora)")
        for n, child in module.named_children():
            visit(f"{prefix}.{n}", child)

    for n, child in model.base.named_children():
        if n != model.text_name.split(".")[0]:
            visit(f"{model.base_name}.{n}", child)
    return out


@functools.lru_cache(maxsize=8)
def image_modules(spec, part: str) -> tuple[str, ...]:
    """The modules an image-text model's `part` ("vision" or "projector") is trained whole as (lora.<part>=full)."""
    return tuple(_whole_modules(_meta_of(spec), part))


def _adapted(name: str, layer: nn.Module, targets) -> bool:
    leaf = name.rpartition(".")[2]
    if targets.target_modules is not None:
        return "all-linear" in targets.target_modules and leaf not in _ROUTERS or leaf in targets.target_modules
    parts = name.split(".")
    if targets.apply_to_mlp and parts[0] in _MLPS and leaf not in _ROUTERS and ".experts." not in f".{name}.":
        return True
    attention = next((m for m in ("self_attn", "attention", "attn") if hasattr(layer, m)), None)
    if attention is None or parts[0] != attention or len(parts) != 2:
        return False
    children = {n for n, m in getattr(layer, attention).named_children() if isinstance(m, nn.Linear)}
    roles = {next((c for c in ROLES[role] if c in children), None) for role in targets.attn_modules}
    return leaf in roles


def add_adapters(model: TransformersDecoder, lora: dict, *, quantize_base: bool) -> None:
    """torchtune's LoRALinear in place of each adapted linear (its weight keeps its name: the checkpoint's), and
    under QLoRA every other linear of the layers frozen in NF4 (FrozenNF4Linear); on the meta device."""
    from torchtune.modules.low_precision import FrozenNF4Linear
    from torchtune.modules.peft import LoRALinear

    from moai_recipes.models.lora import LoraOptions

    targets = LoraOptions.from_builder_kwargs(lora)
    model.trained_whole = targets.trained_whole  # models/lora.freeze_base leaves them trainable
    adapted = set(adapted_linears(model, targets))
    unquantized = set(targets.unquantized)  # too small for whole NF4 blocks (models/lora._unquantized)
    layer_prefixes = tuple(f"{model.layers_path}.{i}." for i in range(len(model.layers)))
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        bias = module.bias is not None
        nf4 = quantize_base and name.startswith(layer_prefixes) and name not in unquantized
        if name in adapted:
            new = LoRALinear(module.in_features, module.out_features, rank=targets.rank, alpha=targets.alpha,
                             dropout=targets.dropout, use_bias=bias, quantize_base=nf4)
        elif nf4:
            new = FrozenNF4Linear(module.in_features, module.out_features, bias=bias)
        else:
            continue
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_module(leaf, new)
        if name == model.head_name:  # the causal LM's own forward computes logits with it too (TransformersDecoder.logits)
            model.causal_lm.register_module(leaf, new)
    if targets.apply_to_experts:
        for layer in model.layers:
            experts = experts_of(layer)
            if experts is not None:
                _adapt_experts(experts, rank=targets.rank, scale=targets.alpha / targets.rank)


def _adapt_experts(experts: nn.Module, *, rank: int, scale: float) -> None:
    """LoRA on each stacked weight of an experts module ([E, m, n]: each expert's m x n): adapters A [E, rank, n] and
    B [E, m, rank] as `lora_a.NAME` and `lora_b.NAME`, the module computing with W + scale x B @ A for the time of its
    forward (PEFT's ParamWrapper adds the same update to the same parameter)."""
    stacked = [n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3]
    experts.lora_a, experts.lora_b = nn.Module(), nn.Module()
    for name in stacked:
        weight = experts._parameters[name]
        e, m, n = weight.shape
        experts.lora_a.register_parameter(name, nn.Parameter(torch.empty(e, rank, n, dtype=weight.dtype)))
        experts.lora_b.register_parameter(name, nn.Parameter(torch.empty(e, m, rank, dtype=weight.dtype)))
    forward = experts.forward

    def adapted(*args, **kwargs):
        held = {name: experts._parameters[name] for name in stacked}
        for name in stacked:
            update = torch.matmul(experts.lora_b._parameters[name], experts.lora_a._parameters[name])
            experts._parameters[name] = held[name] + scale * update.to(held[name].dtype)
        try:
            return forward(*args, **kwargs)
        finally:
            experts._parameters.update(held)

    experts.forward = adapted


def _meta_of(spec) -> TransformersDecoder:
    with torch.device("meta"):
        return model_of(spec)


@functools.lru_cache(maxsize=8)
def linear_shapes(spec) -> dict[str, tuple[int, int]]:
    """The weight shape [out, in] of every linear module of the decoder layers (QLoRA keeps them in NF4)."""
    model = _meta_of(spec)
    return {f"{model.layers_path}.{i}.{name}": (m.out_features, m.in_features)
            for i, layer in enumerate(model.layers) for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


@functools.lru_cache(maxsize=8)
def linear_names(spec) -> tuple[str, ...]:
    """The names (the last part) of the decoder layers' linear modules, in the order they first appear."""
    return tuple(dict.fromkeys(name.rpartition(".")[2] for name in linear_shapes(spec)))


@functools.lru_cache(maxsize=16)
def adapter_sizes(spec, lora: tuple | None, quantize_base: bool) -> tuple[int, int, tuple[int, ...]]:
    """(trainable parameters, trainable tensors, the values of each NF4 weight of one layer... of all layers) of the
    model with the adapters of `lora` (Workload.lora_key); without LoRA every parameter trains."""
    with torch.device("meta"):
        model = model_of(spec, lora=dict(lora) if lora else None, quantize_base=quantize_base)
    from moai_recipes.models.lora import trained_under_lora

    trainable = [p for n, p in model.named_parameters() if lora is None or trained_under_lora(model, n)]
    nf4 = tuple(m.weight.numel() for m in model.modules() if type(m).__name__ == "FrozenNF4Linear"
                or (getattr(m, "_quantize_base", False) and hasattr(m, "weight")))
    return sum(p.numel() for p in trainable), len(trainable), nf4
