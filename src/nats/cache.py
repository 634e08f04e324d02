"""The inference cache: per layer, what decoding must remember (NATSL.md, "Inference cache").

A NAtS-L layer keeps, per routing head, the keys and values of its softmax chunks only,
the float32 linear state, a snapshot of that state at the current chunk's start, and
the unfinished chunk. KV memory therefore follows the softmax fraction.

Every buffer a decode step touches has a fixed shape and is updated in place, and the
step finds where to write from a device copy of the position: a step launches the same
kernels at every position but one in a chunk, the last, which also scores and files the
chunk; the host knows which it is, and a CUDA graph replays either. Only the host-side
bookkeeping between steps (growing a full buffer) may replace buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch
import torch.nn.functional as F


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


B = TypeVar("B", bound="_Buffers")


class _Buffers:
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (a captured decode step is bound to these)."""
        return [v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)]

    def cloned(self: B, names: Iterable[str] | None = None) -> B:
        """This cache with its own copy of each tensor (of the fields ``names``, default
        all): a prefill replayed from a CUDA graph wrote them in memory the next replay
        refills."""
        names = [f.name for f in fields(self)] if names is None else list(names)
        return replace(self, **{n: v.clone() for n in names
                                if isinstance(v := getattr(self, n), torch.Tensor)})


@dataclass
class SoftmaxLayerCache(_Buffers):
    """Plain causal attention: every key and value in ``[B, Hq, capacity, D]`` buffers, of
    which the first ``length`` positions are real (the capacity doubles when full), and
    the short convolution's window ``[B, K-1, channels]``."""

    k: torch.Tensor
    v: torch.Tensor
    length: int
    conv: torch.Tensor

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, conv: torch.Tensor,
                    ) -> SoftmaxLayerCache:
        """The cache after a prompt's keys and values ``[B, Hq, T, D]``, with room to grow."""
        room = (0, 0, 0, max(64, k.shape[2] // 4))
        return cls(k=F.pad(k, room), v=F.pad(v, room), length=k.shape[2], conv=conv)

    def kv_bytes(self) -> int:
        return _nbytes(self.k[:, :, : self.length], self.v[:, :, : self.length])

    def advance(self) -> None:
        """A token was written at ``length``; make room for the next one."""
        self.length += 1
        if self.length == self.k.shape[2]:
            grow = (0, 0, 0, self.length)
            self.k, self.v = F.pad(self.k, grow), F.pad(self.v, grow)


@dataclass
class LinearLayerCache(_Buffers):
    """Plain linear layer: the conv window and the float32 state ``[B, H, Dk, Dv]``
    (``Dv + 1`` for linear attention, whose last column is the normaliser)."""

    conv: torch.Tensor
    state: torch.Tensor

    def kv_bytes(self) -> int:
        return 0


@dataclass
class NatsLayerCache(_Buffers):
    """NAtS-L layer.

    ``store_k/v`` ``[B, H, r, M, C, D]`` hold per routing head its softmax chunks in
    order (the first ``store_len[b, h]`` keys, whole chunks, are real); ``chunk_k/v``
    ``[B, H*r, C, D]`` the unfinished chunk, of which the first ``open_len`` tokens are
    real; ``pool_sum`` and ``pool_max`` ``[B, D_model]`` the scorer's running sum and
    maximum over it (``-inf`` while it is empty; the maximum is kept only under a max
    pool, ``NatsConfig.scorer_pool``) and
    ``chunk_log_decay`` ``[B, H]`` its summed log decay (zeros for operators without a
    decay gate). ``state`` and ``snapshot`` are the linear operator's, two buffers
    (``Dv + 1`` columns for linear attention: the normaliser restores with it).
    ``most_filed`` bounds from above, on the host, the softmax chunks any head has filed:
    the bound lets the store grow in time without reading the count from the GPU at every
    close.
    """

    conv: torch.Tensor
    state: torch.Tensor
    snapshot: torch.Tensor
    chunk_log_decay: torch.Tensor
    chunk_k: torch.Tensor
    chunk_v: torch.Tensor
    open_len: int
    pool_sum: torch.Tensor
    pool_max: torch.Tensor
    store_k: torch.Tensor
    store_v: torch.Tensor
    store_len: torch.Tensor
    most_filed: int

    @property
    def ends_chunk(self) -> bool:
        """Whether the next token ends the open chunk (its step also scores and files it)."""
        return self.open_len == self.chunk_k.shape[2] - 1

    @property
    def store_chunks(self) -> torch.Tensor:
        """Softmax chunks stored per routing head ``[B, H]``."""
        return self.store_len // self.store_k.shape[4]

    def kv_bytes(self) -> int:
        """Bytes of keys and values that are really held (real slots and own chunk)."""
        r = self.store_k.shape[2]
        per_head = (self.store_k.shape[5] + self.store_v.shape[5]) * self.store_k.element_size()
        stored = int(self.store_len.sum()) * r  # (head, token) pairs
        open_chunk = self.chunk_k.shape[0] * self.chunk_k.shape[1] * self.open_len
        return (stored + open_chunk) * per_head

    def file_chunk(self, is_softmax: torch.Tensor) -> None:
        """File the finished chunk on the device: keys and values of softmax heads
        ``[B, H]`` go to the store. Every head writes its next free slot (there is one:
        :meth:`chunk_closed`); only softmax heads claim it."""
        batch, heads, r, _, chunk, _ = self.store_k.shape
        filed = self.store_chunks
        for store, new in ((self.store_k, self.chunk_k), (self.store_v, self.chunk_v)):
            src = new.reshape(batch, heads, r, 1, chunk, new.shape[-1])
            index = filed.view(batch, heads, 1, 1, 1, 1).expand_as(src)
            store.scatter_(3, index, src)
        self.store_len += chunk * is_softmax.long()  # in place: captured decode steps read it

    def chunk_closed(self) -> None:
        """Host bookkeeping once a step filed its chunk: a new chunk opens, and the store
        keeps a free slot for it. The real count is read from the GPU only when the bound
        says the store may be full; full, it grows geometrically."""
        self.open_len = 0
        self.most_filed += 1
        slots = self.store_k.shape[3]
        if self.most_filed < slots:
            return
        self.most_filed = int(self.store_chunks.max())
        if self.most_filed == slots:
            grow = (0, 0, 0, 0, 0, slots)
            self.store_k, self.store_v = F.pad(self.store_k, grow), F.pad(self.store_v, grow)


LayerCache = SoftmaxLayerCache | LinearLayerCache | NatsLayerCache


@dataclass
class HybridCache:
    """The whole model's cache: one entry per layer, and the number of tokens seen, on the
    host (``position``) and as a device scalar (``position_t``) that decode steps read."""

    layers: list[LayerCache]
    position: int
    position_t: torch.Tensor

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def buffers(self) -> list[torch.Tensor]:
        return [self.position_t, *(t for layer in self.layers for t in layer.buffers())]
