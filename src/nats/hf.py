"""Hugging Face ``transformers`` integration (``pip install -e ".[hf]"``).

After :func:`register`, ``AutoModelForCausalLM.from_pretrained(folder)`` loads a folder that
``NatsForCausalLM.save_pretrained`` or ``nats export`` wrote (its ``config.json`` names
``model_type`` "nats"), ``model.generate`` decodes against the hybrid cache and the ``Trainer``
trains the model as it is. The ``Trainer`` minimises the loss only: ``nats train``'s routing
controls (routing statistics, the softmax budget's controller, route exploration) do not
run. Nothing in the package imports this module, so ``import nats`` does not need
``transformers``.
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from typing import Any, ClassVar

import torch
from torch import nn

try:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        Cache,
        GenerationMixin,
        PretrainedConfig,
        PreTrainedModel,
    )
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import can_return_tuple
    from transformers.utils.deprecation import deprecate_kwarg
except ImportError as error:
    needed = 'nats.hf needs transformers >= 5.24: pip install -e ".[hf]"'
    raise ImportError(f"{needed} ({error})") from error

from .cache import HybridCache
from .config import HF_KEYS, LAYER_LISTS, NatsConfig
from .eval_mode import eval_mode
from .model import NatsForCausalLM

NATS_FIELDS = tuple(f.name for f in dataclasses.fields(NatsConfig))


class NatsHFConfig(PretrainedConfig):
    """A :class:`NatsConfig` as ``transformers`` sees it: every field an attribute, so that
    ``config.json`` holds the native keys beside ``transformers``' own; checked by
    ``NatsConfig`` on construction and again by :meth:`to_nats`."""

    model_type = HF_KEYS["model_type"]
    # transformers decides on tying by this name
    attribute_map: ClassVar[dict[str, str]] = {"tie_word_embeddings": "tie_embeddings"}

    def __init__(self, **kwargs: Any) -> None:
        fields = {key: kwargs.pop(key) for key in (*NATS_FIELDS, *LAYER_LISTS) if key in kwargs}
        config = NatsConfig.from_dict(fields)
        super().__init__(**kwargs)
        for name in NATS_FIELDS:
            setattr(self, name, getattr(config, name))

    @classmethod
    def from_nats(cls, config: NatsConfig) -> NatsHFConfig:
        return cls(**config.to_dict())

    def to_nats(self) -> NatsConfig:
        """The native config (fields changed on this object since construction included)."""
        return NatsConfig.from_dict({name: getattr(self, name) for name in NATS_FIELDS})


class NatsCache(Cache):
    """``transformers``' ``Cache`` interface over our :class:`HybridCache`.

    The first cached forward fills it with a prefill of its tokens, every later one feeds
    its tokens through ``decode_step`` one at a time. The hybrid cache is advanced by the
    whole model at once, not layer by layer, so it holds none of ``transformers``' per-layer
    objects, and every method that would walk them is replaced here.
    """

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.hybrid: HybridCache | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.hybrid is None else self.hybrid.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # buffers grow as needed

    @property
    def batch_size(self) -> int:
        # Every layer cache holds a convolution window [B, K-1, channels].
        return -1 if self.hybrid is None else int(self.hybrid.layers[0].conv.shape[0])

    @property
    def is_linear(self) -> list[bool]:
        """``[False]``: ``generate`` trims a prompt that continues a given cache by the
        cache's length only when not every layer is linear; this cache counts its tokens."""
        return [False]

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a NAtS-L cache cannot be cropped: its linear-attention state has "
                         "absorbed every token (assisted decoding needs a croppable cache)")

    def reset(self) -> None:
        self.hybrid = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.hybrid is not None:
            rows = torch.arange(self.batch_size, device=self.hybrid.position_t.device)
            self._select_rows(rows.repeat_interleave(repeats))

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) batch rows: every tensor of a layer cache is batch-first."""
        if self.hybrid is None:
            return
        for layer in self.hybrid.layers:
            for f in dataclasses.fields(layer):
                value = getattr(layer, f.name)
                if isinstance(value, torch.Tensor):
                    setattr(layer, f.name, value.index_select(0, rows.to(value.device)))


class NatsHFForCausalLM(PreTrainedModel, GenerationMixin):
    """A :class:`NatsForCausalLM` behind ``transformers``' model interface.

    ``native`` is the model itself and runs the forward pass and the cached decoding; its
    modules are this model's modules (one shared module table), so the state dict is the
    native one key for key, and a module swapped on either (PEFT, resized embeddings) is
    swapped on both.
    """

    config_class = NatsHFConfig
    main_input_name = "input_ids"
    _input_embed_layer = "embed"
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "embed.weight"}

    def __init__(self, config: NatsHFConfig, native: NatsForCausalLM | None = None) -> None:
        super().__init__(config)
        # from_pretrained builds on the meta device and then replaces every tensor by the
        # checkpoint's. A budgeted NAtS-L layer reads its initial routing bias back from a
        # tensor, which a meta tensor cannot give, so that build happens on the CPU, and its
        # placeholders stay unmarked: one the checkpoint lacks is reported missing and goes
        # to _init_weights. Any other build initialised every tensor, which transformers must
        # not draw again.
        device = torch.get_default_device()
        placeholders = native is None and device.type == "meta"
        if native is None:
            with torch.device("cpu" if placeholders else device):
                native = NatsForCausalLM(config.to_nats())
        if not placeholders:
            for tensor in chain(native.parameters(), native.buffers()):
                tensor._is_hf_initialized = True
        self._modules = native._modules
        object.__setattr__(self, "native", native)  # not a submodule: its modules are ours
        self.post_init()
        self.train(native.training)

    @classmethod
    def from_native(cls, model: NatsForCausalLM) -> NatsHFForCausalLM:
        """``model`` behind this interface, sharing its modules (nothing is copied)."""
        return cls(NatsHFConfig.from_nats(model.config), native=model)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the first cached forward makes its own NatsCache

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise what ``transformers`` asks for: tensors a checkpoint lacked, or new ones
        (resized embeddings). Linear and embedding weights are drawn as ``NatsForCausalLM``
        draws them; the other tensors (norms, gates, convolutions, routing statistics) have
        no rule outside their module's constructor, so a checkpoint without one is refused
        rather than filled with uninitialised memory."""
        self.native._init_weights(module)
        drawn = module.weight if isinstance(module, (nn.Linear, nn.Embedding)) else None
        lacking = [name for name, tensor in chain(module.named_parameters(recurse=False),
                                                  module.named_buffers(recurse=False))
                   if tensor is not drawn and not getattr(tensor, "_is_hf_initialized", False)]
        if lacking:
            prefix = next(name for name, m in self.named_modules() if m is module)
            names = ", ".join(f"{prefix}.{name}" for name in lacking)
            raise ValueError(f"the checkpoint holds no {names}: it does not match its config.json")

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize; the native model's config follows the new vocabulary."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.native.config = self.config.to_nats()
        return embeddings

    def train(self, mode: bool = True) -> NatsHFForCausalLM:
        self.native.training = mode  # its modules follow through the shared table
        return super().train(mode)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, cache: NatsCache | None = None,
                use_cache: bool | None = None) -> CausalLMOutputWithPast:
        """Logits of every position of ``input_ids``; with ``labels`` (the inputs' shape,
        shifted inside, -100 ignored) the native loss, cross-entropy plus the cost term.

        With ``use_cache`` or a ``cache`` the tokens continue the cache instead (the first
        call prefills it), without gradients: a cache is for decoding, not training.
        ``attention_mask`` may only mark every token: the mixers have no padding, so rows
        must have one length (pack sequences, as ``nats train`` does).
        """
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask marks padding, which NAtS models do not support: "
                             "give rows of one length (pack sequences, or generate one row at "
                             "a time)")
        if cache is None and not use_cache:
            out = self.native(input_ids, labels=labels)
            return CausalLMOutputWithPast(loss=out.loss, logits=out.logits)
        if labels is not None:
            raise ValueError("labels need the parallel forward (no gradient flows through the "
                             "cache): call without use_cache and cache")
        cache = NatsCache() if cache is None else cache
        return CausalLMOutputWithPast(logits=self._cached_logits(input_ids, cache), cache=cache)

    def _cached_logits(self, input_ids: torch.Tensor, cache: NatsCache) -> torch.Tensor:
        """Logits ``[B, T, V]`` of tokens that follow ``cache``, which they advance; in
        evaluation mode, as the native ``generate`` decodes (argmax routes, the routing
        statistics untouched)."""
        if cache.hybrid is not None and input_ids.shape[0] != cache.batch_size:
            raise ValueError(f"the cache holds {cache.batch_size} rows, input_ids "
                             f"{input_ids.shape[0]}")
        with eval_mode(self.native):
            if cache.hybrid is None:
                logits, cache.hybrid = self.native.prefill(input_ids)
                return logits
            return torch.stack([self.native.decode_step(token, cache.hybrid)
                                for token in input_ids.unbind(1)], 1)


def register() -> None:
    """Make ``AutoConfig`` and ``AutoModelForCausalLM`` know ``model_type`` "nats"; calling
    it again does nothing."""
    AutoConfig.register(NatsHFConfig.model_type, NatsHFConfig, exist_ok=True)
    AutoModelForCausalLM.register(NatsHFConfig, NatsHFForCausalLM, exist_ok=True)
