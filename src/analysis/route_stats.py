"""Routing statistics over an evaluation set: softmax fractions, the scorer's probabilities,
and whether chunks that hold task-relevant tokens go to softmax more often than others.

A chunk's route decides where its keys and values live for the queries after it (KV cache
or state). So for a task whose answer must be read back from known positions (MQAR's
key-value pairs, a needle), the question is how often a chunk holding such a position is
routed to softmax, against the base rate of all chunks. Rates are per chunk (a partial
last chunk counts as one); the softmax fraction is per token, as everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from nats.eval_mode import eval_mode
from nats.kernels import SOFTMAX
from nats.softmax_fraction import softmax_token_counts
from nats.trainers.evaluation import RelevantFn, informative_chunks

if TYPE_CHECKING:
    from nats import NatsForCausalLM

BINS = 20
"""Bins of the route-probability histograms over ``0 .. 1``."""


@dataclass
class LayerRouteStats:
    """Counts for one NAtS-L layer, per routing head (arrays ``[H]``)."""

    layer: int
    heads: int
    tokens: int = 0
    """Tokens each head saw."""
    chunks: int = 0
    """Chunks each head routed (every sequence)."""
    relevant_chunks: int = 0
    """Chunks holding at least one task-relevant position (0: no mask was given)."""
    softmax_tokens: np.ndarray = field(init=False)
    softmax_chunks: np.ndarray = field(init=False)
    relevant_softmax_chunks: np.ndarray = field(init=False)
    prob_hist: np.ndarray = field(init=False)
    """``[H, BINS]`` counts of the scorer's softmax probability per chunk."""

    def __post_init__(self) -> None:
        self.softmax_tokens = np.zeros(self.heads, dtype=np.int64)
        self.softmax_chunks = np.zeros(self.heads, dtype=np.int64)
        self.relevant_softmax_chunks = np.zeros(self.heads, dtype=np.int64)
        self.prob_hist = np.zeros((self.heads, BINS), dtype=np.int64)

    @property
    def softmax_fraction(self) -> np.ndarray:
        """Per head, the share of tokens in softmax chunks."""
        return self.softmax_tokens / max(self.tokens, 1)

    @property
    def base_rate(self) -> np.ndarray:
        """Per head, the share of all chunks routed to softmax."""
        return self.softmax_chunks / max(self.chunks, 1)

    @property
    def relevant_rate(self) -> np.ndarray | None:
        """Per head, the share of relevant chunks routed to softmax (``None``: none seen)."""
        return self.relevant_softmax_chunks / self.relevant_chunks if self.relevant_chunks \
            else None

    @property
    def other_rate(self) -> np.ndarray | None:
        """Per head, the share of the remaining chunks routed to softmax."""
        rest = self.chunks - self.relevant_chunks
        if not self.relevant_chunks or not rest:
            return None
        return (self.softmax_chunks - self.relevant_softmax_chunks) / rest

    def add(self, routes: torch.Tensor, probs: torch.Tensor, seq_len: int, chunk_size: int,
            relevant: torch.Tensor | None) -> None:
        """Count one batch: ``routes``/``probs`` ``[B, N, H, 2]``, ``relevant`` ``[B, T]``."""
        sm = (routes[..., SOFTMAX].detach() > 0.5).cpu()  # [B, N, H]
        self.tokens += sm.shape[0] * seq_len
        self.softmax_tokens += softmax_token_counts(routes, seq_len, chunk_size).numpy()
        self.chunks += sm.shape[0] * sm.shape[1]
        self.softmax_chunks += sm.sum((0, 1)).numpy()
        p = probs[..., SOFTMAX].detach().float().cpu().clamp(0, 1)
        bins = (p * BINS).long().clamp(max=BINS - 1)  # [B, N, H]; p = 1 in the last bin
        for h in range(self.heads):
            self.prob_hist[h] += np.bincount(bins[..., h].flatten().numpy(), minlength=BINS)
        if relevant is not None:
            rel = informative_chunks(relevant.cpu(), chunk_size)  # [B, N]
            self.relevant_chunks += int(rel.sum())
            self.relevant_softmax_chunks += (sm & rel[..., None]).sum((0, 1)).numpy()


@torch.no_grad()
def collect_route_stats(model: NatsForCausalLM,
                        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        relevant: RelevantFn | None = None, progress: bool = True,
                        on_output: Callable[[int, Any], None] | None = None,
                        ) -> dict[int, LayerRouteStats]:
    """Run ``model`` (eval mode) over ``(input_ids, labels)`` batches and count every
    NAtS-L layer's routes; ``relevant`` marks the task-relevant positions of a batch.
    ``on_output(index, output)`` sees each batch's model output (to reuse a forward)."""
    device = model.embed.weight.device
    chunk = model.config.chunk_size
    stats: dict[int, LayerRouteStats] = {}
    with eval_mode(model):
        for n, (input_ids, labels) in enumerate(tqdm(batches, desc="routing statistics",
                                                     unit="batch", disable=not progress)):
            out = model(input_ids.to(device))
            if on_output is not None:
                on_output(n, out)
            mask = relevant(input_ids, labels) if relevant is not None else None
            for i, (routes, probs) in enumerate(zip(out.routes, out.probs, strict=True)):
                if routes is None:
                    continue
                if i not in stats:
                    stats[i] = LayerRouteStats(layer=i, heads=routes.shape[2])
                stats[i].add(routes, probs, input_ids.shape[1], chunk, mask)
    return stats
