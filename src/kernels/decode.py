"""Public one-token decode operators: one signature, a ``backend`` that picks the
implementation (as in :mod:`.ops`: ``"auto"`` is Triton for CUDA tensors, the plain
PyTorch reference otherwise).

Each step operator returns ``(o, new_state)`` and writes the new state into ``out``
when given (``out=state`` updates it in place, which a CUDA-graph-captured step needs).
"""

from __future__ import annotations

import torch

from .ops import Backend, check_decay_parameters, resolve_backend
from .reference import decode as reference
from .reference.decode import AttentionSplits

__all__ = ["AttentionSplits", "append_to_open_chunk", "gated_delta_rule_step",
           "gated_linear_attention_step", "hybrid_attention_decode", "hybrid_attention_splits",
           "linear_attention_step", "linear_gates_step", "merge_step", "short_conv_step"]


def _triton(backend: Backend, x: torch.Tensor):
    """The Triton decode module where ``backend`` picks it for ``x``, else None."""
    if resolve_backend(backend, x) == "reference":
        return None
    from .triton import decode  # imported lazily: Triton is optional on the CPU path

    return decode


def gated_delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, scale: float, *,
                          out: torch.Tensor | None = None, backend: Backend = "auto",
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`.reference.decode.gated_delta_rule_step`."""
    fast = _triton(backend, state)
    if fast is None:
        return reference.gated_delta_rule_step(state, q, k, v, g, beta, scale, out)
    return fast.linear_step(state, q, k, v, g, beta, scale, out)


def gated_linear_attention_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, g: torch.Tensor, scale: float, *,
                                out: torch.Tensor | None = None, backend: Backend = "auto",
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`.reference.decode.gated_linear_attention_step`."""
    fast = _triton(backend, state)
    if fast is None:
        return reference.gated_linear_attention_step(state, q, k, v, g, scale, out)
    return fast.linear_step(state, q, k, v, g, None, scale, out)


def linear_attention_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor | None = None,
                          backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`.reference.decode.linear_attention_step` (every backend composes it over
    its own gated linear attention step)."""
    def gla(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            g: torch.Tensor, scale: float, out: torch.Tensor | None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        return gated_linear_attention_step(state, q, k, v, g, scale, out=out, backend=backend)

    return reference.linear_attention_step(state, q, k, v, eps, out, gla_step=gla)


def hybrid_attention_decode(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_len: torch.Tensor, chunk_k: torch.Tensor | None = None,
                            chunk_v: torch.Tensor | None = None,
                            chunk_len: torch.Tensor | None = None, scale: float | None = None,
                            *, backend: Backend = "auto") -> torch.Tensor:
    """See :func:`.reference.decode.hybrid_attention_decode`."""
    fast = _triton(backend, q)
    impl = reference if fast is None else fast
    return impl.hybrid_attention_decode(q, store_k, store_v, store_len, chunk_k, chunk_v,
                                        chunk_len, scale)


def hybrid_attention_splits(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_len: torch.Tensor, chunk_k: torch.Tensor | None = None,
                            chunk_v: torch.Tensor | None = None,
                            chunk_len: torch.Tensor | None = None, scale: float | None = None,
                            *, backend: Backend = "auto") -> AttentionSplits:
    """:func:`hybrid_attention_decode` without its last launch, for :func:`merge_step` to
    finish; see :func:`.reference.decode.hybrid_attention_splits`."""
    fast = _triton(backend, q)
    impl = reference if fast is None else fast
    return impl.hybrid_attention_splits(q, store_k, store_v, store_len, chunk_k, chunk_v,
                                        chunk_len, scale)


def linear_gates_step(x: torch.Tensor, w_a: torch.Tensor | None, a_log: torch.Tensor | None,
                      dt_bias: torch.Tensor | None, w_b: torch.Tensor | None, *,
                      backend: Backend = "auto",
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear operator's gates for one token ``x`` ``[B, D]`` from its projection weights
    ``[H, D]`` (either may be None); see :func:`.reference.decode.linear_gates_step`."""
    if x.dim() != 2:
        raise ValueError(f"linear_gates_step needs x [B, D], got {list(x.shape)}")
    weights = [w for w in (w_a, w_b) if w is not None]
    if not weights:
        return None, None
    heads = weights[0].shape[0]
    if any(w.shape != (heads, x.shape[1]) for w in weights):
        raise ValueError(f"linear_gates_step needs weights [H, D] with D = {x.shape[1]}, got "
                         f"{[list(w.shape) for w in weights]}")
    if w_a is not None:
        check_decay_parameters("linear_gates_step", "w_a", heads, a_log, dt_bias)
    fast = _triton(backend, x)
    return (reference if fast is None else fast).linear_gates_step(x, w_a, a_log, dt_bias, w_b)


def _check_splits(splits: AttentionSplits) -> None:
    """That ``splits`` are what the attention's split operators return, which the merge's
    launch reads as such: contiguous ``[B, Hq, S]`` maxima and totals, ``[B, Hq, S, Dv]``
    weighted values, float32 (float64 from float64 inputs)."""
    top, total, acc = splits
    if acc.dim() != 4 or top.shape != acc.shape[:3] or total.shape != acc.shape[:3]:
        raise ValueError(f"merge_step needs splits of max and total [B, Hq, S] and acc "
                         f"[B, Hq, S, Dv]; got {list(top.shape)}, {list(total.shape)}, "
                         f"{list(acc.shape)}")
    if not all(t.is_contiguous() and t.dtype in (torch.float32, torch.float64)
               for t in splits):
        raise ValueError("merge_step needs contiguous float32 or float64 splits, as "
                         "hybrid_attention_splits returns them")


def merge_step(q: torch.Tensor, mix_weight: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor | AttentionSplits, gamma: torch.Tensor, eps: float, norm_a: bool,
               norm_b: bool, out_dtype: torch.dtype, *, backend: Backend = "auto",
               ) -> torch.Tensor:
    """The NAtS-L merge of one token's branches ``a``, ``b`` ``[B, Hq, D]`` with its mix
    logits, the product of ``q`` ``[B, Dq]`` by ``mix_weight`` ``[2 Hq, Dq]``, taken in the
    same launch, as is the combine of ``b`` where it comes as the softmax branch's
    :class:`AttentionSplits`; see :func:`.reference.decode.merge_step`."""
    if isinstance(b, AttentionSplits):
        _check_splits(b)
        b_shape = (*b.acc.shape[:2], b.acc.shape[-1])
    else:
        b_shape = tuple(b.shape)
    if a.dim() != 3 or b_shape != tuple(a.shape) or q.dim() != 2 or q.shape[0] != a.shape[0] \
            or mix_weight.shape != (2 * a.shape[1], q.shape[1]) or gamma.shape != a.shape[2:]:
        raise ValueError(f"merge_step needs q [B, Dq], mix_weight [2 Hq, Dq], a and b "
                         f"[B, Hq, D], gamma [D]; got {list(q.shape)}, "
                         f"{list(mix_weight.shape)}, {list(a.shape)}, {list(b_shape)}, "
                         f"{list(gamma.shape)}")
    fast = _triton(backend, a)
    return (reference if fast is None else fast).merge_step(q, mix_weight, a, b, gamma, eps,
                                                            norm_a, norm_b, out_dtype)


def short_conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, *,
                    backend: Backend = "auto") -> torch.Tensor:
    """See :func:`.reference.decode.short_conv_step`."""
    fast = _triton(backend, x)
    return (reference if fast is None else fast).short_conv_step(x, window, weight)


def append_to_open_chunk(position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         x: torch.Tensor, g: torch.Tensor, chunk_k: torch.Tensor,
                         chunk_v: torch.Tensor, pool_sum: torch.Tensor,
                         pool_max: torch.Tensor | None, chunk_log_decay: torch.Tensor,
                         open_len: torch.Tensor, *, backend: Backend = "auto") -> None:
    """See :func:`.reference.decode.append_to_open_chunk`."""
    fast = _triton(backend, x)
    (reference if fast is None else fast).append_to_open_chunk(
        position, keys, values, x, g, chunk_k, chunk_v, pool_sum, pool_max, chunk_log_decay,
        open_len)
