"""Linear side of NAtS-L in Triton: the hybrid chunked gated delta rule, forward and backward.

Same semantics, outputs and gradients as :func:`nats.kernels.reference.hybrid_gated_delta_rule`:
every routing chunk decays the carried state, only linear-routed chunks write to it
(``S_{c+1} = Gamma_c S_c + z[c, LA] write_c``), and every query sees its own routing chunk
through the delta rule from the routing-chunk-start state.

Design. Kernels work on kernel chunks of ``BT = min(C, 64)`` tokens (the WY/UT inverse
is ``BT x BT``); a routing chunk of ``C`` tokens spans ``R = C / BT`` of them. Within a
routing chunk the running state carries from kernel chunk to kernel chunk (the own-chunk
delta rule goes on) while a decayed *shadow* of the routing-chunk-start state is kept; at
the routing-chunk end the carried state is ``z * running + (1 - z) * shadow``. The
backward mirrors this (:mod:`.gated_delta_rule_bwd`). Dense batches run as packed ones
(``B`` sequences of ``T``), so one code path serves ``cu_seqlens`` too, with no host sync.

Memory: the forward saves its inputs, the within-chunk cumulative gate (float32), the
inverted ``BT x BT`` WY matrices (in the inputs' dtype, see ``HALF_A``) and, with
:data:`SAVE_STATES`, ``w``, the kernel-chunk start states ``h`` and ``v_new`` it computed
anyway (inputs' dtype); without it the backward recomputes them with the forward kernels.
"""

from __future__ import annotations

import torch

from ..reference.chunks import ROUTE_GRADS, RouteGrad
from .gated_delta_rule_bwd import dqkwg, state_bwd, wy_bwd
from .gated_delta_rule_fwd import output_fwd, state_fwd, wy_fwd
from .segments import segments_of
from .utils import ChunkMap, packed, routed_batch

KERNEL_CHUNK = 64
"""Largest kernel chunk: longer routing chunks are walked in pieces of this many tokens."""

SAVE_STATES = True
"""Keep ``w``, ``h`` and ``v_new`` from the forward for the backward (this module and
:mod:`.gated_linear_attention`, which keeps ``h``). They cost ``(2 Dk + Dv + 2 Dk Dv / BT)``
values per token and head, four times ``q`` at ``Dk = Dv = 128``, ``BT = 64``; recomputing
them costs the backward two launches (``w, u`` and the serial state kernel; their share of
the time: docs/BENCHMARKS.md). Set it False to trade that time for the memory, as fla does."""

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)


class _HybridGatedDeltaRule(torch.autograd.Function):
    """Packed ``[1, T_total, H, *]`` inputs, routes ``z = routes[..., LA]`` as ``[N, H]``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, z: torch.Tensor, h0: torch.Tensor | None, cmap: ChunkMap,
                segmap: ChunkMap | None, chunk_size: int, scale: float,
                output_final_state: bool, all_dz: bool,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bt = min(chunk_size, KERNEL_CHUNK)
        r = chunk_size // bt
        gc, a, w, u = wy_fwd(k, v, g, beta, cmap, bt, r)
        h, v_new, ht = state_fwd(k, w, u, gc, z, h0, output_final_state, cmap, bt, r, segmap)
        o = output_fwd(q, k, v_new, gc, h, scale, v.dtype, cmap, bt, r)
        ctx.save_for_backward(q, k, v, g, beta, z, h0, gc, a,
                              *((w, h, v_new) if SAVE_STATES else ()))
        ctx.cmap, ctx.segmap, ctx.bt, ctx.r = cmap, segmap, bt, r
        ctx.scale, ctx.all_dz = scale, all_dz
        return o, ht

    @staticmethod
    def backward(ctx, do: torch.Tensor, dht: torch.Tensor | None):
        q, k, v, g, beta, z, h0, gc, a, *states = ctx.saved_tensors
        cmap, segmap, bt, r, scale = ctx.cmap, ctx.segmap, ctx.bt, ctx.r, ctx.scale
        do = do.contiguous()
        if states:
            w, h, v_new = states
        else:
            _, _, w, u = wy_fwd(k, v, g, beta, cmap, bt, r, saved=(gc, a))
            h, v_new, _ = state_fwd(k, w, u, gc, z, h0, False, cmap, bt, r, segmap)
        dh, dv_new, dz, dgs, dh0 = state_bwd(
            q, k, w, do, v_new, gc, z, h, None if dht is None else dht.contiguous(),
            h0 is not None and ctx.needs_input_grad[6], ctx.all_dz, scale, cmap, bt, r,
            segmap)
        dq, dk_part, dw, dgc = dqkwg(q, k, v_new, do, dv_new, gc, h, dh, scale, cmap, bt, r)
        dk, dv, dbeta, dg = wy_bwd(k, v, g, beta, gc, a, dw, dv_new, dk_part, dgc, dgs,
                                   cmap, bt, r)
        dh0 = None if dh0 is None else dh0.to(h0.dtype)
        return dq, dk, dv, dg, dbeta, dz.to(z.dtype), dh0, None, None, None, None, None, None


def hybrid_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                            scale: float | None = None, initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False, *,
                            route_grad: RouteGrad = "selected",
                            cu_seqlens: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear branch of NAtS-L; see :func:`nats.kernels.reference.hybrid_gated_delta_rule`.

    fp16 / bf16 / fp32 inputs; float32 state and accumulation. With ``cu_seqlens`` the
    batch is packed (``B == 1``) and states are ``[n_seq, H, Dk, Dv]``.
    """
    batch, seq_len, heads, d_k = _check(q, k, v, g, beta, route_grad)
    d_v = v.shape[-1]
    cmap, z = routed_batch(batch, seq_len, heads, d_k, d_v, routes, chunk_size, initial_state,
                           cu_seqlens)
    o, final_state = _HybridGatedDeltaRule.apply(
        packed(q), packed(k), packed(v), packed(g), packed(beta), z,
        None if initial_state is None else initial_state.contiguous(), cmap,
        segments_of(batch, seq_len, heads, d_v, chunk_size, q.device, cu_seqlens), chunk_size,
        d_k**-0.5 if scale is None else scale, output_final_state, route_grad == "both")
    return o.reshape(batch, seq_len, heads, d_v), final_state


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, route_grad: str) -> tuple[int, int, int, int]:
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, Dk] and v [B, T, H, Dv]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"g and beta must be [B, T, H] = {list(q.shape[:3])}, got "
                         f"{list(g.shape)} and {list(beta.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of {DTYPES}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    for name, d in (("Dk", q.shape[-1]), ("Dv", v.shape[-1])):
        if d not in HEAD_DIMS:
            raise ValueError(f"{name} must be one of {HEAD_DIMS}, got {d}")
    if route_grad not in ROUTE_GRADS:
        raise ValueError(f"route_grad must be one of {ROUTE_GRADS}, got {route_grad!r}")
    return q.shape[:4]
