"""The linear-attention operators a layer can run (``NatsConfig.linear_op``).

One place knows, per operator, its gates, how q and k enter it, the parallel (chunked,
routed) call, the state it carries and the one-token decode step, so that the NAtS-L
layer's linear branch and the plain linear layer ("linear") run the same operator:

==========================  =================  ==============  ======================
operator                    gates              q, k            state ``[B, H, Dk, .]``
==========================  =================  ==============  ======================
``gated_deltanet``          decay g, beta      L2-normalised   ``Dv``
``deltanet``                beta (g = 0)       L2-normalised   ``Dv``
``gated_linear_attention``  decay g            L2-normalised   ``Dv``
``linear_attention``        none (g = 0)       raw (ELU+1)     ``Dv + 1`` (normaliser)
==========================  =================  ==============  ======================

Gated linear attention L2-normalises q and k like the delta rules, for three reasons:
its state is a decayed sum of ``k v^T`` with no delta correction to bound it, so unit
keys bound the state by ``|v| / (1 - a)`` whatever the projections learn; scores
``q.k`` in ``[-1, 1]`` keep the decay, not the feature norms, in charge of how far back
a head reads (as in Gated DeltaNet, where the paper pairs the scalar decay with unit
keys); and a search that swaps the operator then changes the recurrence only, not the
scale of what goes into it. Linear attention passes raw q and k: its ELU+1 feature map
(applied inside the operator) needs signed inputs, and its normaliser already removes
the scale of q.

Every operator reports a per-token log decay ``g`` (zeros where it has no decay gate),
so the hybrid cache restores a softmax chunk's snapshot by ``exp(sum g)`` for all of
them (``exp(0) = 1`` without a gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nats.config import NatsConfig
from nats.kernels import Backend, l2_norm, linear_gates, num_chunks
from nats.kernels.decode import linear_gates_step
from nats.kernels.linear_ops import LinearOpSpec, linear_op_spec

from .norms import upcast
from .routing import forced_routes


class TokenGates(NamedTuple):
    """Per-token gates ``[B, T, H]``: log decay ``g`` (zeros without a decay gate) and the
    delta rule's write strength ``beta`` (None for operators without one)."""

    g: torch.Tensor
    beta: torch.Tensor | None

    def window(self, index: slice | int) -> TokenGates:
        """The gates of tokens ``index`` (an int drops the time axis)."""
        return TokenGates(self.g[:, index], None if self.beta is None else self.beta[:, index])


class LinearGates(nn.Module):
    """The gate parameters of one operator.

    Decay ``g = -exp(A_log) softplus(W_a x + dt_bias)`` (Mamba2's parameterisation) and
    write strength ``beta = sigmoid(W_b x)`` (the operator :func:`nats.kernels.linear_gates`);
    an operator has the ones it uses. The parameter names are those of the Gated DeltaNet
    layers saved before the operator became a choice, so their checkpoints load unchanged.
    """

    def __init__(self, d_model: int, n_heads: int, decay: bool, write: bool,
                 backend: Backend = "auto") -> None:
        super().__init__()
        self.n_heads, self.backend = n_heads, backend
        if decay:
            self.a_proj = nn.Linear(d_model, n_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(n_heads))
            self.dt_bias = nn.Parameter(torch.empty(n_heads))
            # Made on the parameters' device (meta for a model built without memory), not
            # left to the default device: a library may have replaced torch.linspace.
            with torch.no_grad():
                # Decay rates spread over heads and time steps in [1e-3, 1e-1], as in GDN.
                self.A_log.copy_(torch.log(torch.linspace(1.0, 16.0, n_heads,
                                                          device=self.A_log.device)))
                dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), n_heads,
                                              device=self.dt_bias.device))
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        if write:
            self.b_proj = nn.Linear(d_model, n_heads, bias=False)

    def _gate_parameters(self) -> tuple[torch.Tensor | None, ...]:
        """``(W_a, A_log, dt_bias, W_b)``, None for the gate this operator lacks."""
        decay = hasattr(self, "a_proj")
        return (self.a_proj.weight if decay else None, self.A_log if decay else None,
                self.dt_bias if decay else None,
                self.b_proj.weight if hasattr(self, "b_proj") else None)

    def _gates(self, g: torch.Tensor | None, beta: torch.Tensor | None,
               x: torch.Tensor) -> TokenGates:
        if g is None:
            g = upcast(x).new_zeros(*x.shape[:-1], self.n_heads)
        return TokenGates(g, beta)

    def forward(self, x: torch.Tensor) -> TokenGates:
        w_a, a_log, dt_bias, w_b = self._gate_parameters()
        return self._gates(*linear_gates(None if w_a is None else F.linear(x, w_a), a_log,
                                         dt_bias, None if w_b is None else F.linear(x, w_b),
                                         backend=self.backend), x)

    def step(self, x: torch.Tensor) -> TokenGates:
        """The gates ``[B, H]`` of one token ``x`` ``[B, D]`` (decoding, no gradients): one
        kernel takes the projections too."""
        return self._gates(*linear_gates_step(x, *self._gate_parameters(), backend=self.backend), x)


QK_NORM_EPS = 1e-6
"""The eps of the L2 norm that makes q and k unit vectors for the operators that take
them so."""


def all_linear_routes(batch: int, seq_len: int, chunk_size: int, heads: int,
                      device: torch.device) -> torch.Tensor:
    """Every chunk writes to the state: what the plain (unrouted) operator is."""
    return forced_routes("linear", batch, 0, num_chunks(seq_len, chunk_size), heads, device)


@dataclass(frozen=True)
class LinearOperator:
    """The operator ``name`` over ``heads`` linear heads of width ``d_k`` / ``d_v``."""

    name: str
    heads: int
    d_k: int
    d_v: int
    chunk_size: int
    backend: str = "auto"
    route_grad: str = "selected"

    @classmethod
    def from_config(cls, cfg: NatsConfig) -> LinearOperator:
        return cls(cfg.linear_op, cfg.n_heads, cfg.head_dim_k, cfg.head_dim_v, cfg.chunk_size,
                   cfg.backend, cfg.route_grad)

    @property
    def spec(self) -> LinearOpSpec:
        """The registered operator (``nats.kernels.linear_ops``)."""
        return linear_op_spec(self.name)

    @property
    def scale(self) -> float:
        return self.d_k**-0.5

    @property
    def state_width(self) -> int:
        """Columns of the state: ``d_v``, plus the normaliser's for operators with one."""
        return self.d_v + self.spec.normaliser

    def gates(self, d_model: int) -> LinearGates:
        return LinearGates(d_model, self.heads, decay=self.spec.decays, write=self.spec.delta,
                           backend=self.backend)

    @property
    def unit_qk(self) -> bool:
        """Whether the operator takes q and k as unit vectors (:data:`QK_NORM_EPS`); the
        normalised operators take them as they are."""
        return not self.spec.normaliser

    def features(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``[B, T, H*D]`` projections as heads ``[B, T, H, D]``, q and k as the operator
        takes them (module docstring)."""
        shape = (*q.shape[:2], self.heads, -1)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if not self.unit_qk:
            return q, k, v
        return (l2_norm(q, QK_NORM_EPS, backend=self.backend),
                l2_norm(k, QK_NORM_EPS, backend=self.backend), v)

    def initial_state(self, batch: int, device: torch.device) -> torch.Tensor:
        """The empty float32 state ``[B, H, Dk, state_width]``."""
        return torch.zeros(batch, self.heads, self.d_k, self.state_width, device=device)

    def parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: TokenGates,
                 routes: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                 output_final_state: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunked operator over heads from :meth:`features`; ``routes`` ``[B, N, H, 2]``
        (None: every chunk writes, the plain operator). Returns ``(o, final_state)``."""
        if routes is None:
            routes = all_linear_routes(q.shape[0], q.shape[1], self.chunk_size, self.heads,
                                       q.device)
        return self.spec.parallel(q, k, v, gates.g, gates.beta, routes, self.chunk_size,
                                  self.scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  route_grad=self.route_grad, backend=self.backend)

    def step(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             gates: TokenGates, out: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, gates of that token ``[B, H]``.
        Returns ``(o [B, H, Dv], new_state)``; the new state goes into ``out`` when given
        (``out=state``: in place)."""
        return self.spec.step(state, q, k, v, gates.g, gates.beta, self.scale, out=out,
                              backend=self.backend)
