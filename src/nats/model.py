"""`NatsForCausalLM`: pre-norm blocks of a mixer (NAtS-L, plain linear or softmax) and a
SwiGLU MLP, with save/load through safetensors and cached decoding."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save
from torch import nn

from .atomic_write import atomic_write_bytes
from .cache import HybridCache, LayerCache
from .config import HF_KEYS, NatsConfig
from .generation import generate
from .layers.linear_layer import LinearLayer
from .layers.nats_attention import LayerRouting, NatsAttention
from .layers.norms import RMSNorm
from .layers.routing import ChunkScorer, RouteOverride, RunningMoments
from .layers.softmax_attention import SoftmaxAttention

MIXERS = {"nats": NatsAttention, "linear": LinearLayer, "softmax": SoftmaxAttention}
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
IGNORE_INDEX = -100


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (a config): one-line errors otherwise."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def write_model_files(directory: Path, config: dict[str, Any],
                      state: dict[str, torch.Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` of a model folder, each atomically."""
    atomic_write_bytes(directory / CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
    atomic_write_bytes(directory / WEIGHTS_FILE,
                       save({k: v.detach().contiguous() for k, v in state.items()},
                            metadata={"format": "pt"}))


def next_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                             reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of position ``t``'s logits against ``labels[t + 1]``, in float32.

    ``labels`` has the shape of the inputs (HF convention); ``-100`` positions carry no loss.
    """
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: NatsConfig, kind: str) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.backend)
        self.mixer = MIXERS[kind](cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.backend)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, LayerRouting | None]:
        y, routing = self.mixer(self.mixer_norm(x))
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), routing

    def prefill(self, x: torch.Tensor):
        y, routing, cache = self.mixer.prefill(self.mixer_norm(x))
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), routing, cache

    def step(self, x: torch.Tensor, cache, position: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer.step(self.mixer_norm(x), cache, position)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class CausalLMOutput:
    """Logits, losses and, per layer, the routes taken (``None`` for non-NAtS layers)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    reg_loss: torch.Tensor | None = None
    routes: list[torch.Tensor | None] = field(default_factory=list)
    attn_frac: list[torch.Tensor | None] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)
    routable_frac: list[torch.Tensor | None] = field(default_factory=list)


PendingCache = LayerCache | Callable[[bool], LayerCache]
"""A layer's prefill cache, or a finisher that returns it (``NatsAttention.prefill``)."""


def finished(cache: PendingCache, own: bool = False) -> LayerCache:
    """A layer's prefill cache, or what its finisher returns; with ``own``, a cache that
    shares no memory with the prefill's tensors (a CUDA graph's replay refills those), of
    which a finisher copies only what it did not make itself."""
    if callable(cache):
        return cache(own)
    return cache.cloned() if own else cache


def _check_labels(labels: torch.Tensor) -> None:
    if not (labels[:, 1:] != IGNORE_INDEX).any():
        raise ValueError("labels hold no position with a loss (every next-token label is "
                         f"{IGNORE_INDEX}): the mean cross-entropy is undefined")


class NatsForCausalLM(nn.Module):
    """A causal language model whose mixers are NAtS-L supernet layers or baselines."""

    def __init__(self, config: NatsConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.d_model, config.norm_eps, config.backend)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        # ``apply`` visits a module's children first, so the scorer's rule comes last.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, ChunkScorer) and self.config.scorer_init == "zero":
            nn.init.zeros_(module.proj.weight)

    @property
    def nats_layers(self) -> list[NatsAttention]:
        return [b.mixer for b in self.blocks if isinstance(b.mixer, NatsAttention)]

    def update_routing_statistics(
            self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Fold the statistics that this step's training forwards gathered (the routing's,
        and the softmax output's scale under ``branch_norm="scaled"``) into the running ones
        (``RunningMoments``); call once per optimizer step, as the trainer does (``reduce``
        sums them over processes first)."""
        for module in self.modules():
            if isinstance(module, RunningMoments):
                module.commit(reduce)

    def set_route_override(self, override: RouteOverride) -> None:
        """Force the routes of every NAtS-L layer (analysis, baselines); ``None`` undoes it."""
        for layer in self.nats_layers:
            layer.route_override = override

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                ) -> CausalLMOutput:
        """Logits for every position; with ``labels`` (same shape, shifted inside, -100
        ignored) also ``loss = cross-entropy + mean over NAtS layers of the cost term``."""
        # Checked first: reading the answer waits for the GPU. Not in a CUDA-graph capture,
        # which cannot read back; its warm-up checked the same fixed labels.
        if labels is not None and not (labels.is_cuda
                                       and torch.cuda.is_current_stream_capturing()):
            _check_labels(labels)
        x = self.embed(input_ids)
        routings = []
        for block in self.blocks:
            x, routing = block(x)
            routings.append(routing)
        return self._output(self.lm_head(self.norm(x)), routings, labels)

    def _output(self, logits: torch.Tensor, routings: list[LayerRouting | None],
                labels: torch.Tensor | None) -> CausalLMOutput:
        out = CausalLMOutput(
            logits=logits,
            routes=[r.routes if r else None for r in routings],
            attn_frac=[r.attn_frac if r else None for r in routings],
            probs=[r.probs if r else None for r in routings],
            routable_frac=[r.routable_frac if r else None for r in routings])
        regs = [r.reg for r in routings if r is not None]
        out.reg_loss = torch.stack(regs).mean() if regs else logits.new_zeros(())
        if labels is not None:
            out.ce_loss = next_token_cross_entropy(logits, labels)
            out.loss = out.ce_loss + out.reg_loss
        return out

    # -- cached decoding ------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, HybridCache]:
        """Logits of the prompt and the cache that decoding continues from."""
        logits, caches = self.prefill_compute(input_ids, finish=True)
        return logits, self.prompt_cache(caches, input_ids)

    @torch.no_grad()
    def prefill_compute(self, input_ids: torch.Tensor, finish: bool,
                        ) -> tuple[torch.Tensor, list[PendingCache]]:
        """The prompt's logits and each layer's cache. A NAtS-L layer's cache comes as a
        finisher that reads a size from the GPU: with ``finish`` called once the next
        layer's work is queued (the GPU has work while the host waits); without, left to
        the caller (a CUDA graph records this work, and its replay fills the size:
        :class:`nats.cuda_graph.GraphedPrefill`)."""
        x = self.embed(input_ids)
        caches: list[PendingCache] = []
        for block in self.blocks:
            x, _, cache = block.prefill(x)
            if finish and caches:
                caches[-1] = finished(caches[-1])
            caches.append(cache)
        if finish:
            caches[-1] = finished(caches[-1])
        return self.lm_head(self.norm(x)), caches

    @staticmethod
    def prompt_cache(caches: list[PendingCache], input_ids: torch.Tensor, own: bool = False,
                     ) -> HybridCache:
        """The whole model's cache after the prompt ``input_ids`` from its layers' (with
        ``own``, sharing no memory with them: :func:`finished`)."""
        position = input_ids.shape[1]
        return HybridCache(
            layers=[finished(cache, own) for cache in caches], position=position,
            # Filled on the device: a tensor made from the host value is a blocking copy.
            position_t=torch.full((), position, device=input_ids.device))

    @torch.no_grad()
    def decode_step(self, token: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Logits ``[B, V]`` for one new token ``[B]``; advances ``cache``."""
        logits = self.decode_compute(token, cache)
        self.decode_advance(cache)
        return logits

    @torch.no_grad()
    def decode_compute(self, token: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """The device work of a decode step: logits ``[B, V]``, every cache buffer updated
        in place. It reads no value back to the host and launches the same kernels at every
        position of one :meth:`decode_plan`, so :class:`nats.cuda_graph.GraphedDecoder` can
        capture it; it must be followed by :meth:`decode_advance`."""
        self.decode_plan(cache)  # its checks raise before a step changes the cache
        x = self.embed(token[:, None])
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block.step(x, layer_cache, cache.position_t)
        cache.position_t.add_(1)
        return self.lm_head(self.norm(x))[:, 0]

    def decode_plan(self, cache: HybridCache) -> tuple[bool, ...]:
        """Per layer, whether the next decode step ends a chunk there (and so also scores
        and files it): all on the host that the step's launches depend on, so a graphed
        decoder keeps one graph per plan."""
        return tuple(isinstance(block.mixer, NatsAttention)
                     and block.mixer.closes_chunk(c, cache.position)
                     for block, c in zip(self.blocks, cache.layers, strict=True))

    def decode_advance(self, cache: HybridCache) -> None:
        """The host bookkeeping after :meth:`decode_compute`: new chunks open, full buffers
        grow."""
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            block.mixer.advance(layer_cache, cache.position)
        cache.position += 1

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """Prompt followed by ``max_new_tokens`` tokens; see :func:`nats.generation.generate`."""
        return generate(self, input_ids, max_new_tokens, **sampling)

    # -- persistence ----------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.safetensors``, each atomically. ``config.json``
        also names the model type for ``transformers`` (``HF_KEYS``), so that
        ``AutoModelForCausalLM`` loads the folder once :func:`nats.hf.register` has run."""
        # Tied weights share storage, which safetensors refuses: store the embedding once.
        state = {k: v for k, v in self.state_dict().items()
                 if not (self.config.tie_embeddings and k == "lm_head.weight")}
        write_model_files(Path(directory), {**self.config.to_dict(), **HF_KEYS}, state)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike,
                        device: str | torch.device = "cpu") -> NatsForCausalLM:
        """Restore a model written by :meth:`save_pretrained`, in the dtype it was saved in
        (no pickle is loaded)."""
        directory = Path(directory)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory} is not a saved nats model: no {name}")
        config = NatsConfig.from_dict(read_json_object(directory / CONFIG_FILE))
        try:
            state = load_file(str(directory / WEIGHTS_FILE), device=str(device))
        except Exception as e:  # safetensors' own error types for a damaged file
            raise ValueError(f"{directory / WEIGHTS_FILE} cannot be read "
                             f"({type(e).__name__}: {e})") from None
        if "embed.weight" not in state:
            raise ValueError(f"{directory / WEIGHTS_FILE} holds no embed.weight: not the "
                             "weights of a nats model")
        return cls.from_state(config, state, f"{directory / WEIGHTS_FILE}").to(device)

    @classmethod
    def from_state(cls, config: NatsConfig, state: dict[str, torch.Tensor],
                   source: str) -> NatsForCausalLM:
        """A model of ``config`` holding ``state`` (in its dtype; a tied head may be absent
        from it); a tensor missing, unexpected or mis-shaped is a one-line error naming
        ``source``."""
        model = cls(config).to(state["embed.weight"].dtype)
        if config.tie_embeddings:
            state = {**state, "lm_head.weight": state["embed.weight"]}
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            reason = " ".join(str(e).split())
            raise ValueError(f"{source} does not match {CONFIG_FILE}: {reason[:300]}") \
                from None
        return model
