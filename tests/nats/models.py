"""Tiny model factories shared by the model tests."""

from __future__ import annotations

import torch

from nats import NatsConfig, NatsForCausalLM
from nats.config import OFFICIAL_RECIPE


def tiny_config(layer_types: tuple[str, ...] = ("nats", "nats"), **overrides) -> NatsConfig:
    """The official recipe unless ``overrides`` say otherwise: its routes are a plain argmax
    of the scorer's logits, which the definition tests write out by hand."""
    base = dict(vocab_size=50, d_model=32, n_layers=len(layer_types), n_heads=2,
                softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                layer_types=layer_types, **OFFICIAL_RECIPE)
    return NatsConfig(**{**base, **overrides})


def tiny_model(layer_types: tuple[str, ...] = ("nats", "nats"), seed: int = 0,
               dtype: torch.dtype = torch.float64, **overrides) -> NatsForCausalLM:
    torch.manual_seed(seed)
    model = NatsForCausalLM(tiny_config(layer_types, **overrides)).to(dtype).eval()
    # Spread the scorer's logits so that both routes occur in small inputs.
    with torch.no_grad():
        for layer in model.nats_layers:
            layer.scorer.proj.weight.normal_(0, 1.0)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()
