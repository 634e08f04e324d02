"""The inference cache: per layer, what decoding must remember (NATSL.md, "Inference cache").

A NAtS-L layer keeps, per routing head, the keys and values of its softmax chunks only,
the float32 linear state, a snapshot of that state at the current chunk's start, and
the unfinished chunk. KV memory therefore follows the softmax fraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SoftmaxLayerCache:
    """Plain causal attention: every key and value in ``[B, Hq, capacity, D]`` buffers, of
    which the first ``length`` positions are real (capacity doubles, so steps never copy),
    and the short convolution's window."""

    k: torch.Tensor
    v: torch.Tensor
    length: int
    conv: torch.Tensor

    def kv_bytes(self) -> int:
        return _nbytes(self.k[:, :, : self.length], self.v[:, :, : self.length])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one token's keys and values ``[B, Hq, D]``."""
        if self.length == self.k.shape[2]:
            grow = (0, 0, 0, self.length)
            self.k, self.v = F.pad(self.k, grow), F.pad(self.v, grow)
        self.k[:, :, self.length], self.v[:, :, self.length] = k, v
        self.length += 1


@dataclass
class LinearLayerCache:
    """Plain linear layer: the conv window and the float32 state ``[B, H, Dk, Dv]``
    (``Dv + 1`` for linear attention, whose last column is the normaliser)."""

    conv: torch.Tensor
    state: torch.Tensor

    def kv_bytes(self) -> int:
        return 0


@dataclass
class NatsLayerCache:
    """NAtS-L layer.

    ``store_k/v`` ``[B, H, r, M, C, D]`` hold per routing head its softmax chunks in
    order (the first ``store_chunks[b, h]`` chunks are real); ``chunk_k/v``
    ``[B, H*r, n, D]`` the unfinished chunk; ``pool_sum`` ``[B, D_model]`` the scorer's
    running sum over it and ``chunk_log_decay`` ``[B, H]`` its summed log decay (zeros
    for operators without a decay gate). ``state`` and ``snapshot`` are the linear
    operator's (``Dv + 1`` columns for linear attention: the normaliser restores with it).
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
        r, _, chunk = self.store_k.shape[2:5]
        per_token = r * (self.store_k.shape[5] + self.store_v.shape[5])
        real_tokens = int(self.store_chunks.sum()) * chunk
        return real_tokens * per_token * self.store_k.element_size() + _nbytes(self.chunk_k,
                                                                               self.chunk_v)

    def append_chunk(self, is_softmax: torch.Tensor) -> None:
        """File the finished chunk: keys and values of softmax heads ``[B, H]`` go to the
        store. Every head writes its next free slot; only softmax heads claim it."""
        batch, heads, r, slots, chunk, _ = self.store_k.shape
        if int(self.store_chunks.max()) == slots:  # grow geometrically
            grow = (0, 0, 0, 0, 0, slots)
            self.store_k, self.store_v = F.pad(self.store_k, grow), F.pad(self.store_v, grow)
        for store, new in ((self.store_k, self.chunk_k), (self.store_v, self.chunk_v)):
            src = new.reshape(batch, heads, r, 1, chunk, new.shape[-1])
            index = self.store_chunks.view(batch, heads, 1, 1, 1, 1).expand_as(src)
            store.scatter_(3, index, src)
        self.store_chunks = self.store_chunks + is_softmax.long()
        self.chunk_k, self.chunk_v = self.chunk_k[:, :, :0], self.chunk_v[:, :, :0]


LayerCache = SoftmaxLayerCache | LinearLayerCache | NatsLayerCache


@dataclass
class HybridCache:
    """The whole model's cache: one entry per layer, and the number of tokens seen."""

    layers: list[LayerCache]
    position: int

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
