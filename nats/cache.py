"""The inference cache: per layer, what decoding must remember (NATSL.md, "Inference cache").

A NAtS-L layer keeps, per routing head, the keys and values of its softmax chunks only,
the float32 linear state, a snapshot of that state at the current chunk's start, and
the unfinished chunk. KV memory therefore follows the softmax fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SoftmaxLayerCache:
    """Plain causal attention: every key and value, ``[B, L, Hq, D]``."""

    k: torch.Tensor
    v: torch.Tensor

    def kv_bytes(self) -> int:
        return _nbytes(self.k, self.v)


@dataclass
class DeltaLayerCache:
    """Gated DeltaNet: the conv window and the float32 state ``[B, H, Dk, Dv]``."""

    conv: torch.Tensor
    state: torch.Tensor

    def kv_bytes(self) -> int:
        return 0


@dataclass
class NatsLayerCache:
    """NAtS-L layer.

    ``store_k/v`` ``[B, H, M, C, r, D]`` hold per routing head its softmax chunks in
    order (the first ``store_chunks[b, h]`` slots are real); ``chunk_k/v``
    ``[B, n, H*r, D]`` the unfinished chunk; ``pool_sum`` ``[B, D_model]`` the scorer's
    running sum over it and ``chunk_log_decay`` ``[B, H]`` its summed gates.
    """

    conv: torch.Tensor
    state: torch.Tensor
    snapshot: torch.Tensor
    chunk_log_decay: torch.Tensor
    chunk_k: torch.Tensor
    chunk_v: torch.Tensor
    pool_sum: torch.Tensor
    store_k: torch.Tensor
    store_v: torch.Tensor
    store_chunks: torch.Tensor

    def kv_bytes(self) -> int:
        """Bytes of keys and values that are really held (real slots and own chunk)."""
        per_slot = math.prod(self.store_k.shape[3:]) + math.prod(self.store_v.shape[3:])
        real_slots = int(self.store_chunks.sum())
        return real_slots * per_slot * self.store_k.element_size() + _nbytes(self.chunk_k,
                                                                             self.chunk_v)


LayerCache = SoftmaxLayerCache | DeltaLayerCache | NatsLayerCache


@dataclass
class HybridCache:
    """The whole model's cache: one entry per layer, and the number of tokens seen."""

    layers: list[LayerCache]
    position: int

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
