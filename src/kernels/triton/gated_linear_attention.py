"""Routed gated linear attention in Triton, forward and backward.

Same semantics, outputs and gradients as
:func:`nats.kernels.reference.hybrid_gated_linear_attention`: every routing chunk decays
the carried state, only linear-routed chunks write to it, and every query sees its own
routing chunk from the routing-chunk-start state.

Design. This is the simple-GLA / Mamba2-SSD structure, and it is the chunked gated delta
rule without its WY transform: with ``w = 0`` and ``u = v`` the GDR kernels compute
exactly it, so they are reused with their ``DELTA`` switch off
(:mod:`.gated_delta_rule_fwd`, :mod:`.gated_delta_rule_bwd`): kernel chunks of
``BT = min(C, 64)`` tokens, ``R = C / BT`` of them per routing chunk, a decayed shadow of
the routing-chunk-start state, packed sequences with no host sync.

* forward: the within-slot cumulative gate (:func:`gate_cumsum`); the sequential state
  kernel (slot start states ``h``, ``h' = exp(gL) h + (k exp(gL - gc))^T v``, the route
  blend at each routing-chunk end); the parallel output kernel
  ``o = scale (exp(gc) q h + causal(q k^T exp(gc_i - gc_j)) v)``.
* backward: ``h`` saved (or recomputed, :data:`.gated_delta_rule.SAVE_STATES`); the reverse
  state kernel (``dh``, ``dv``, the route
  gradient, the shadow's gate gradient, ``dh0``); ``dq, dk`` and the per-token gate
  gradient in one parallel kernel; :func:`gate_grad` sums it back to ``dg``.

Between forward and backward the inputs, the float32 cumulative gate and (with
``SAVE_STATES``) the slot start states are saved.
``V`` may be any width (linear attention runs it at ``Dv + 1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.chunks import ROUTE_GRADS, RouteGrad
from . import gated_delta_rule
from .gated_delta_rule import DTYPES, HEAD_DIMS, KERNEL_CHUNK
from .gated_delta_rule_bwd import dqkwg, state_bwd
from .gated_delta_rule_fwd import output_fwd, slot_bounds, state_fwd
from .segments import segments_of
from .utils import ChunkMap, empty, packed, routed_batch

MAX_VALUE_DIM = 257
"""Widest value head: 256, or 256 + 1 for linear attention's normaliser column."""


@triton.jit
def _gate_cumsum_kernel(g, gc, cu, chunk_offsets, chunk_seq, H,
                        BT: tl.constexpr, R: tl.constexpr):
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    b_g = tl.load(g + o_t * H + i_h, mask=m_t, other=0).to(tl.float32)
    tl.store(gc + o_t * H + i_h, tl.cumsum(b_g, 0), mask=m_t)


@triton.jit
def _gate_grad_kernel(dgc, dgs, dg, cu, chunk_offsets, chunk_seq, H,
                      BT: tl.constexpr, R: tl.constexpr):
    """``g_t`` enters every ``gc_s`` of its slot with ``s >= t`` (a reverse cumulative sum)
    and, through the shadow, the whole routing chunk's decay (``dgs``)."""
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    r, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < eos
    b_d = tl.load(dgc + o_t * H + i_h, mask=m_t, other=0)
    b_dg = tl.sum(b_d, 0) - tl.cumsum(b_d, 0) + b_d + tl.load(dgs + r * H + i_h)
    tl.store(dg + o_t * H + i_h, b_dg.to(dg.dtype.element_ty), mask=m_t)


def gate_cumsum(g: torch.Tensor, cmap: ChunkMap, bt: int, r: int) -> torch.Tensor:
    """The cumulative log gate within each kernel chunk, float32 ``[1, T_total, H]``."""
    gc = empty(*g.shape, dtype=torch.float32, device=g.device)
    _gate_cumsum_kernel[(cmap.chunk_seq.numel() * r, g.shape[2])](
        g, gc, cmap.cu_seqlens, cmap.chunk_offsets, cmap.chunk_seq, g.shape[2], BT=bt, R=r)
    return gc


def gate_grad(dgc: torch.Tensor, dgs: torch.Tensor, dtype: torch.dtype, cmap: ChunkMap,
              bt: int, r: int) -> torch.Tensor:
    """``dg`` from the per-token gradient of ``gc`` and the shadow's per routing chunk."""
    dg = empty(*dgc.shape, dtype=dtype, device=dgc.device)
    _gate_grad_kernel[(cmap.chunk_seq.numel() * r, dgc.shape[2])](
        dgc, dgs, dg, cmap.cu_seqlens, cmap.chunk_offsets, cmap.chunk_seq, dgc.shape[2],
        BT=bt, R=r)
    return dg


class _HybridGatedLinearAttention(torch.autograd.Function):
    """Packed ``[1, T_total, H, *]`` inputs, routes ``z = routes[..., LA]`` as ``[N, H]``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                z: torch.Tensor, h0: torch.Tensor | None, cmap: ChunkMap,
                segmap: ChunkMap | None, chunk_size: int, scale: float,
                output_final_state: bool, all_dz: bool,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bt = min(chunk_size, KERNEL_CHUNK)
        r = chunk_size // bt
        gc = gate_cumsum(g, cmap, bt, r)
        h, _, ht = state_fwd(k, None, v, gc, z, h0, output_final_state, cmap, bt, r, segmap)
        o = output_fwd(q, k, v, gc, h, scale, v.dtype, cmap, bt, r)
        ctx.save_for_backward(q, k, v, g, z, h0, gc,
                              *((h,) if gated_delta_rule.SAVE_STATES else ()))
        ctx.cmap, ctx.segmap, ctx.bt, ctx.r = cmap, segmap, bt, r
        ctx.scale, ctx.all_dz = scale, all_dz
        return o, ht

    @staticmethod
    def backward(ctx, do: torch.Tensor, dht: torch.Tensor | None):
        q, k, v, g, z, h0, gc, *states = ctx.saved_tensors
        cmap, segmap, bt, r, scale = ctx.cmap, ctx.segmap, ctx.bt, ctx.r, ctx.scale
        do = do.contiguous()
        h = (states[0] if states
             else state_fwd(k, None, v, gc, z, h0, False, cmap, bt, r, segmap)[0])
        dh, dv, dz, dgs, dh0 = state_bwd(
            q, k, None, do, v, gc, z, h, None if dht is None else dht.contiguous(),
            h0 is not None and ctx.needs_input_grad[5], ctx.all_dz, scale, cmap, bt, r,
            segmap)
        dq, dk, _, dgc = dqkwg(q, k, v, do, None, gc, h, dh, scale, cmap, bt, r)
        dg = gate_grad(dgc, dgs, g.dtype, cmap, bt, r) if ctx.needs_input_grad[3] else None
        dh0 = None if dh0 is None else dh0.to(h0.dtype)
        return (dq, dk.to(k.dtype), dv.to(v.dtype), dg, dz.to(z.dtype), dh0,
                None, None, None, None, None, None)


def hybrid_gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  g: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                                  scale: float | None = None,
                                  initial_state: torch.Tensor | None = None,
                                  output_final_state: bool = False, *,
                                  route_grad: RouteGrad = "selected",
                                  cu_seqlens: torch.Tensor | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed gated linear attention; see
    :func:`nats.kernels.reference.hybrid_gated_linear_attention`.

    fp16 / bf16 / fp32 inputs; float32 state and accumulation. With ``cu_seqlens`` the
    batch is packed (``B == 1``) and states are ``[n_seq, H, Dk, Dv]``.
    """
    batch, seq_len, heads, d_k = _check(q, k, v, g, route_grad)
    d_v = v.shape[-1]
    cmap, z = routed_batch(batch, seq_len, heads, d_k, d_v, routes, chunk_size, initial_state,
                           cu_seqlens)
    o, final_state = _HybridGatedLinearAttention.apply(
        packed(q), packed(k), packed(v), packed(g), z,
        None if initial_state is None else initial_state.contiguous(), cmap,
        segments_of(batch, seq_len, heads, d_v, chunk_size, q.device, cu_seqlens), chunk_size,
        d_k**-0.5 if scale is None else scale, output_final_state, route_grad == "both")
    return o.reshape(batch, seq_len, heads, d_v), final_state


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           route_grad: str) -> tuple[int, int, int, int]:
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, Dk] and v [B, T, H, Dv]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if g.shape != q.shape[:3]:
        raise ValueError(f"g must be [B, T, H] = {list(q.shape[:3])}, got {list(g.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {DTYPES}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"Dk must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if not 1 <= v.shape[-1] <= MAX_VALUE_DIM:
        raise ValueError(f"Dv must be 1 to {MAX_VALUE_DIM}, got {v.shape[-1]}")
    if route_grad not in ROUTE_GRADS:
        raise ValueError(f"route_grad must be one of {ROUTE_GRADS}, got {route_grad!r}")
    return q.shape[:4]
