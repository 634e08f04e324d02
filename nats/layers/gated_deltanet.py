"""Gated DeltaNet: the plain linear-attention layer, and the gates NAtS-L shares with it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nats.cache import DeltaLayerCache
from nats.config import NatsConfig
from nats.kernels import hybrid_gated_delta_rule, num_chunks
from nats.kernels.decode import gated_delta_rule_step

from .norms import l2_norm, rms_norm, upcast
from .projections import GatedOutput, QKVProjection
from .routing import forced_routes


class DeltaGates(nn.Module):
    """Per-token log decay ``g = -exp(A_log) softplus(W_a x + dt_bias)`` and write strength
    ``beta = sigmoid(W_b x)``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        # Decay rates spread over heads and time steps in [1e-3, 1e-1], as in Mamba2/GDN.
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, n_heads)))
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), n_heads))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = -upcast(self.A_log).exp() * F.softplus(upcast(self.a_proj(x)) + self.dt_bias)
        return g, torch.sigmoid(upcast(self.b_proj(x)))


def all_linear_routes(batch: int, seq_len: int, chunk_size: int, heads: int,
                      device: torch.device) -> torch.Tensor:
    """Every chunk writes to the state: what plain Gated DeltaNet is."""
    return forced_routes("linear", batch, 0, num_chunks(seq_len, chunk_size), heads, device)


def linear_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int):
    """``[B, T, H*D]`` projections as linear heads ``[B, T, H, D]``, q and k L2-normalised."""
    shape = (*q.shape[:2], heads, -1)
    return l2_norm(q.view(shape)), l2_norm(k.view(shape)), v.view(shape)


class GatedDeltaNet(nn.Module):
    """Plain Gated DeltaNet layer (the all-linear baseline), same projections as NAtS-L."""

    def __init__(self, cfg: NatsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, dk, dv = cfg.n_heads, cfg.head_dim_k, cfg.head_dim_v
        self.qkv = QKVProjection(cfg.d_model, (h * dk, h * dk, h * dv), cfg.conv_size)
        self.gates = DeltaGates(cfg.d_model, h)
        self.out = GatedOutput(cfg.d_model, h, dv)

    def _mix(self, x: torch.Tensor, qkv, initial_state=None):
        q, k, v = linear_heads(*qkv, self.cfg.n_heads)
        g, beta = self.gates(x)
        routes = all_linear_routes(x.shape[0], x.shape[1], self.cfg.chunk_size, self.cfg.n_heads,
                                   x.device)
        o, state = hybrid_gated_delta_rule(q, k, v, g, beta, routes, self.cfg.chunk_size,
                                           initial_state=initial_state, output_final_state=True,
                                           backend=self.cfg.backend)
        return self.out(rms_norm(o, self.cfg.norm_eps), x), state

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self._mix(x, self.qkv(x))[0], None

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, None, DeltaLayerCache]:
        qkv, conv = self.qkv.prefill(x)
        y, state = self._mix(x, qkv)
        return y, None, DeltaLayerCache(conv=conv, state=state)

    def step(self, x: torch.Tensor, cache: DeltaLayerCache, position: int) -> torch.Tensor:
        qkv, cache.conv = self.qkv.step(x, cache.conv)
        q, k, v = linear_heads(*qkv, self.cfg.n_heads)
        g, beta = self.gates(x)
        o, cache.state = gated_delta_rule_step(cache.state, q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                               beta[:, 0], self.cfg.head_dim_k**-0.5)
        return self.out(rms_norm(o[:, None].to(x.dtype), self.cfg.norm_eps), x)
