"""Public hybrid operators: one signature, a ``backend`` that picks the implementation.

``"auto"`` takes the Triton kernels for CUDA tensors and the plain PyTorch reference
otherwise; ``"reference"`` and ``"triton"`` force one.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

import torch

from . import reference
from .reference import norms as reference_norms
from .reference.chunks import RouteGrad, check_route_chunks, num_chunks
from .reference.linear_attention import normalised_linear_attention
from .reference.routes import ChunkRoutes, RouteBudget

Backend = Literal["auto", "reference", "triton"]
BACKENDS = ("auto", "reference", "triton")


def resolve_backend(backend: Backend, x: torch.Tensor) -> str:
    """The implementation ``backend`` means for tensors on ``x``'s device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda else "reference"
    return backend


def _implementation(backend: Backend, x: torch.Tensor, name: str):
    """The operator ``name`` of the backend chosen for ``x``.

    Under ``torch.compile`` the Triton path is left to run eagerly: its kernels are fused
    already, and TorchDynamo tracing into them retypes float arguments (as float64), which
    the kernels' loop-carried float32 values do not accept.
    """
    if resolve_backend(backend, x) == "reference":
        return getattr(reference, name)
    from . import triton as triton_ops  # imported lazily: Triton is optional on the CPU path

    return torch.compiler.disable(getattr(triton_ops, name))


def hybrid_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             routes: torch.Tensor, chunk_size: int, scale: float | None = None,
                             *, route_grad: RouteGrad = "selected",
                             backend: Backend = "auto",
                             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax branch of NAtS-L; see :func:`reference.hybrid_softmax_attention`."""
    impl = _implementation(backend, q, "hybrid_softmax_attention")
    return impl(q, k, v, routes, chunk_size, scale, route_grad=route_grad, cu_seqlens=cu_seqlens)


def hybrid_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                            scale: float | None = None, initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False, *,
                            route_grad: RouteGrad = "selected", backend: Backend = "auto",
                            cu_seqlens: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear branch of NAtS-L; see :func:`reference.hybrid_gated_delta_rule`."""
    impl = _implementation(backend, q, "hybrid_gated_delta_rule")
    return impl(q, k, v, g, beta, routes, chunk_size, scale, initial_state, output_final_state,
                route_grad=route_grad, cu_seqlens=cu_seqlens)


def hybrid_gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  g: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                                  scale: float | None = None,
                                  initial_state: torch.Tensor | None = None,
                                  output_final_state: bool = False, *,
                                  route_grad: RouteGrad = "selected", backend: Backend = "auto",
                                  cu_seqlens: torch.Tensor | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed gated linear attention; see :func:`reference.hybrid_gated_linear_attention`."""
    impl = _implementation(backend, q, "hybrid_gated_linear_attention")
    return impl(q, k, v, g, routes, chunk_size, scale, initial_state, output_final_state,
                route_grad=route_grad, cu_seqlens=cu_seqlens)


def hybrid_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            routes: torch.Tensor, chunk_size: int,
                            initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False, *, eps: float = 1e-6,
                            route_grad: RouteGrad = "selected", backend: Backend = "auto",
                            cu_seqlens: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed ELU+1 linear attention, state ``[B, H, Dk, Dv + 1]`` (last column: the
    normaliser); see :func:`reference.hybrid_linear_attention`. Every backend runs the same
    composition over its own gated linear attention."""
    gla = _implementation(backend, q, "hybrid_gated_linear_attention")
    aligned = 1 if resolve_backend(backend, q) == "reference" else 64
    return normalised_linear_attention(gla, q, k, v, routes, chunk_size, initial_state,
                                       output_final_state, eps=eps, route_grad=route_grad,
                                       cu_seqlens=cu_seqlens, width_multiple=aligned)


def _fused(backend: Backend, x: torch.Tensor, name: str) -> ModuleType:
    """The module ``name`` (``norms``, ``short_conv``, ``moments``, ``routes``) that runs
    on ``x``: its Triton kernels, but the plain form for float64 (exact tests) and under
    ``torch.compile``, which fuses the plain form with its neighbours instead."""
    if (resolve_backend(backend, x) == "triton" and x.dtype != torch.float64
            and not torch.compiler.is_compiling()):
        # imported lazily: Triton is optional on the CPU path
        return importlib.import_module(f".triton.{name}", __package__)
    return importlib.import_module(f".reference.{name}", __package__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             backend: Backend = "auto") -> torch.Tensor:
    """RMS normalisation of the last dimension; see :func:`reference.norms.rms_norm`."""
    return _fused(backend, x, "norms").rms_norm(x, weight, eps)


def l2_norm(x: torch.Tensor, eps: float = 1e-6, *, backend: Backend = "auto") -> torch.Tensor:
    """L2 normalisation of the last dimension; see :func:`reference.norms.l2_norm`."""
    return _fused(backend, x, "norms").l2_norm(x, eps)


def qk_norms(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             parts: int, q_eps: float, k_eps: float, l2_eps: float, *,
             backend: Backend = "auto",
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax heads' RMS norms and the linear heads' L2 norms of a layer's shared q
    and k ``[..., H, D]``, from one read of each and one launch for all four;
    see :func:`reference.norms.qk_norms`."""
    if q.shape != k.shape or q.dtype != k.dtype:
        raise ValueError(f"qk_norms needs q and k of one shape and dtype, got "
                         f"{list(q.shape)} {q.dtype} and {list(k.shape)} {k.dtype}")
    sub = q.shape[-1] // parts
    if q.shape[-1] % parts or q_weight.shape != (sub,) or k_weight.shape != (sub,):
        raise ValueError(f"qk_norms needs heads of D = {q.shape[-1]} in {parts} equal parts "
                         f"and weights of D / parts, got {list(q_weight.shape)} and "
                         f"{list(k_weight.shape)}")
    return _fused(backend, q, "norms").qk_norms(q, k, q_weight, k_weight, parts, q_eps, k_eps,
                                                l2_eps)


def merge_branches(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
                   gamma: torch.Tensor, eps: float, norm_a: bool, norm_b: bool,
                   out_dtype: torch.dtype, *, gamma_b: torch.Tensor | None = None,
                   logits: bool = False, backend: Backend = "auto") -> torch.Tensor:
    """The NAtS-L merge of two branches; see :func:`reference.norms.merge_branches`
    (``logits``: the branch weights as the softmax of ``weights``, taken inside the merge).

    A weight per branch (``gamma_b``, only converted official checkpoints have one) has
    no Triton kernel: it runs the reference, a few elementwise operations, on any device.
    """
    if gamma_b is not None:
        return reference_norms.merge_branches(a, b, weights, gamma, eps, norm_a, norm_b,
                                              out_dtype, gamma_b, logits)
    return _fused(backend, a, "norms").merge_branches(a, b, weights, gamma, eps, norm_a, norm_b,
                                                      out_dtype, logits=logits)


def linear_gates(a: torch.Tensor | None, a_log: torch.Tensor | None,
                 dt_bias: torch.Tensor | None, b: torch.Tensor | None, *,
                 backend: Backend = "auto") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear operator's decay ``g`` and write strength ``beta`` from their projections
    ``[..., H]`` (either may be None); see :func:`reference.gates.linear_gates`."""
    if a is not None and b is not None and a.shape != b.shape:
        raise ValueError(f"linear_gates needs a and b of one shape [..., H], got "
                         f"{list(a.shape)} and {list(b.shape)}")
    x = a if a is not None else b
    if x is None:
        return None, None
    if a is not None:
        check_decay_parameters("linear_gates", "a", x.shape[-1], a_log, dt_bias)
    return _fused(backend, x, "gates").linear_gates(a, a_log, dt_bias, b)


def check_decay_parameters(op: str, given: str, heads: int, a_log: torch.Tensor | None,
                           dt_bias: torch.Tensor | None) -> None:
    """Raise unless ``a_log`` and ``dt_bias`` are ``[heads]``, as the decay gate ``given``
    to ``op`` needs them."""
    if not (a_log is not None and dt_bias is not None
            and a_log.shape == dt_bias.shape == (heads,)):
        raise ValueError(f"{op} needs a_log and dt_bias of shape [{heads}] with {given}")


def moments_accumulate(x: torch.Tensor, pending: torch.Tensor, *,
                       backend: Backend = "auto") -> None:
    """Add the rows of ``x`` ``[..., C]`` to running-moment sums ``pending`` ``[1 + 2C]``
    (float64, in place); see :func:`reference.moments.moments_accumulate`."""
    _fused(backend, x, "moments").moments_accumulate(x, pending)


def moments_commit(sums: torch.Tensor, pending: torch.Tensor, running_mean: torch.Tensor,
                   running_var: torch.Tensor, commits: torch.Tensor | None, momentum: float,
                   *, backend: Backend = "auto") -> None:
    """Fold running-moment sums into the running mean and variance and zero ``pending``;
    see :func:`reference.moments.moments_commit`."""
    _fused(backend, running_mean, "moments").moments_commit(
        sums, pending, running_mean, running_var, commits, momentum)


def chunk_routes(logits: torch.Tensor, seq_len: int, chunk_size: int, *,
                 budget: RouteBudget | None = None, forced: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None, tau: float | None = None,
                 backend: Backend = "auto") -> ChunkRoutes:
    """A NAtS-L layer's routes, the scorer's probabilities and the pass's statistics from
    its scorer's ``[B, N, H, 2]`` logits; see :func:`reference.routes.chunk_routes`."""
    if logits.dim() != 4 or logits.shape[-1] != 2:
        raise ValueError(f"chunk_routes needs logits [B, N, H, 2], got {list(logits.shape)}")
    check_route_chunks(logits, num_chunks(seq_len, chunk_size), seq_len, chunk_size)
    for name, t in (("forced", forced), ("noise", noise)):
        if t is not None and t.shape != logits.shape:
            raise ValueError(f"chunk_routes needs {name} of the logits' shape "
                             f"{list(logits.shape)}, got {list(t.shape)}")
    heads = logits.shape[2]
    if budget is not None and not (budget.bias.shape == budget.running_mean.shape
                                   == budget.running_var.shape == (heads,)):
        raise ValueError(f"chunk_routes needs a budget of [{heads}] per routing head")
    return _fused(backend, logits, "routes").chunk_routes(logits, seq_len, chunk_size,
                                                          budget, forced, noise, tau)


def short_conv(x: torch.Tensor, weight: torch.Tensor, *,
               backend: Backend = "auto") -> torch.Tensor:
    """``SiLU`` of the causal depthwise convolution of ``x`` ``[B, T, C]`` by ``weight``
    ``[C, K]``; see :func:`reference.short_conv.short_conv`."""
    return _fused(backend, x, "short_conv").short_conv(x, weight)
