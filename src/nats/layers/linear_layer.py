"""The plain linear-attention layer (layer type "linear"): the all-linear baseline.

Its operator is ``NatsConfig.linear_op`` (Gated DeltaNet by default). Same projections as
NAtS-L, every chunk written to the state.
"""

from __future__ import annotations

import torch
from torch import nn

from nats.cache import LinearLayerCache
from nats.config import NatsConfig
from nats.kernels import rms_norm

from .linear_ops import LinearOperator
from .projections import GatedOutput, QKVProjection


class LinearLayer(nn.Module):
    """One linear-attention operator over ``n_heads`` heads, gated output."""

    def __init__(self, cfg: NatsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, dk, dv = cfg.n_heads, cfg.head_dim_k, cfg.head_dim_v
        self.qkv = QKVProjection(cfg.d_model, (h * dk, h * dk, h * dv), cfg.conv_size,
                                 cfg.backend)
        self.linear = LinearOperator.from_config(cfg)
        self.gates = self.linear.gates(cfg.d_model)
        self.out = GatedOutput(cfg.d_model, h, dv, cfg.output_gate)

    def _mix(self, x: torch.Tensor, qkv):
        o, state = self.linear.parallel(*self.linear.features(*qkv), self.gates(x),
                                        output_final_state=True)
        return self.out(rms_norm(o, eps=self.cfg.norm_eps, backend=self.cfg.backend), x), state

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self._mix(x, self.qkv(x))[0], None

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, None, LinearLayerCache]:
        qkv, conv = self.qkv.prefill(x)
        y, state = self._mix(x, qkv)
        return y, None, LinearLayerCache(conv=conv, state=state.contiguous())

    def step(self, x: torch.Tensor, cache: LinearLayerCache, position: torch.Tensor,
             ) -> torch.Tensor:
        """One token; updates the cache in place (``position`` is not needed)."""
        q, k, v = self.linear.features(*self.qkv.step(x, cache.conv))
        o, _ = self.linear.step(cache.state, q[:, 0], k[:, 0], v[:, 0],
                                self.gates.step(x[:, 0]), out=cache.state)
        return self.out(rms_norm(o[:, None].to(x.dtype), eps=self.cfg.norm_eps,
                                 backend=self.cfg.backend), x)

    def advance(self, cache: LinearLayerCache, position: int) -> None:
        """Nothing to do between steps: the state is all there is."""
