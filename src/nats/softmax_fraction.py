"""How much of each NAtS-L layer a model keeps in softmax attention: the one definition of
the softmax fraction.

It is token-weighted: the fraction of tokens, over every sequence and chunk, that lie in
chunks routed to softmax attention (their keys stay in the KV cache, so KV bytes and
softmax FLOPs follow it), per routing head and over all heads. A partial last chunk
counts by its tokens. :func:`nats.kernels.reference.routes.softmax_fraction` gives it for
one forward pass on the routes' device (the layer's ``attn_frac``, made with its routes by
:func:`nats.kernels.chunk_routes`); :func:`measure_softmax_fraction` here over many
batches, with integer counts so that "all softmax" and "all linear" are exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nats.eval_mode import eval_mode
from nats.kernels import SOFTMAX
from nats.kernels.reference.chunks import check_route_chunks, chunk_token_counts

if TYPE_CHECKING:
    from nats import NatsForCausalLM

ALL_SOFTMAX, ALL_LINEAR, MIXED = "all-softmax", "all-linear", "mixed"
"""What a layer did on the measured data (:attr:`LayerFraction.kind`)."""


@dataclass(frozen=True)
class LayerFraction:
    """Softmax routing of one NAtS-L layer over some data."""

    layer: int
    """Index of the layer in the model."""
    softmax_tokens: tuple[int, ...]
    """Per routing head, the tokens in chunks routed to softmax."""
    tokens: int
    """Tokens seen by each head (every sequence of every batch)."""

    @property
    def per_head(self) -> tuple[float, ...]:
        """Softmax fraction of each routing head."""
        return tuple(n / self.tokens for n in self.softmax_tokens)

    @property
    def overall(self) -> float:
        """Softmax fraction over all heads (each head has the same tokens: their mean)."""
        return sum(self.softmax_tokens) / (self.tokens * len(self.softmax_tokens))

    @property
    def kind(self) -> str:
        """``"all-softmax"``, ``"all-linear"`` or ``"mixed"``, exactly (no tolerance)."""
        if all(n == self.tokens for n in self.softmax_tokens):
            return ALL_SOFTMAX
        if not any(self.softmax_tokens):
            return ALL_LINEAR
        return MIXED


def softmax_token_counts(routes: torch.Tensor, seq_len: int, chunk_size: int) -> torch.Tensor:
    """Per routing head ``[H]``, the tokens of ``routes`` ``[B, N, H, 2]`` routed to softmax."""
    is_sm = (routes[..., SOFTMAX].detach() > 0.5).long().cpu()  # [B, N, H]
    counts = chunk_token_counts(seq_len, chunk_size)
    check_route_chunks(routes, counts.numel(), seq_len, chunk_size)
    return (is_sm * counts[None, :, None]).sum((0, 1))


@torch.no_grad()
def measure_softmax_fraction(
        model: NatsForCausalLM, batches: Iterable[tuple[torch.Tensor, torch.Tensor]
                                                   | torch.Tensor],
) -> dict[int, LayerFraction]:
    """Run ``model`` (eval mode, no grad) over ``batches`` and measure every NAtS-L layer.

    ``batches`` are ``(input_ids, labels)`` pairs (labels are not used) or plain
    ``input_ids`` ``[B, T]``; they are moved to the model's device. Layers whose routes
    are forced (``route_override``) are measured as forced. Returns ``{layer index:
    LayerFraction}`` for the NAtS-L layers only; no batches is an error.
    """
    device = model.embed.weight.device
    chunk = model.config.chunk_size
    sums: dict[int, torch.Tensor] = {}
    tokens = 0
    with eval_mode(model):
        for batch in batches:
            input_ids = batch[0] if isinstance(batch, (tuple, list)) else batch
            out = model(input_ids.to(device))
            seq_len = input_ids.shape[1]
            for i, routes in enumerate(out.routes):
                if routes is not None:
                    counts = softmax_token_counts(routes, seq_len, chunk)
                    sums[i] = sums[i] + counts if i in sums else counts
            tokens += input_ids.numel()
    if tokens == 0:
        raise ValueError("measuring the softmax fraction needs at least one batch")
    return {i: LayerFraction(layer=i, softmax_tokens=tuple(int(n) for n in s), tokens=tokens)
            for i, s in sums.items()}
