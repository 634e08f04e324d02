"""Plain causal softmax attention: the all-softmax baseline layer.

It takes its queries, keys and values through the same projection with a short causal
convolution as NAtS-L and the linear layers, so the baselines differ only in the mixer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nats.cache import SoftmaxLayerCache
from nats.config import NatsConfig
from nats.kernels.decode import decode_attention

from .norms import RMSNorm
from .projections import QKVProjection
from .rotary import apply_rotary


class SoftmaxAttention(nn.Module):
    """Causal attention over ``SiLU(conv(W x))`` with q/k RMSNorm and optional rotary
    embedding.

    It has the channel budget of a NAtS-L layer: ``n_heads * r`` heads of width
    ``head_dim_k / r`` (values ``head_dim_v / r``).
    """

    def __init__(self, cfg: NatsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads = cfg.n_heads * cfg.softmax_heads_per_head
        dk, dv = cfg.softmax_head_dim_k, cfg.softmax_head_dim_v
        self.dims = (self.heads * dk, self.heads * dk, self.heads * dv)
        self.qkv = QKVProjection(cfg.d_model, self.dims, cfg.conv_size)
        self.q_norm, self.k_norm = RMSNorm(dk, cfg.norm_eps), RMSNorm(dk, cfg.norm_eps)
        self.out = nn.Linear(self.heads * dv, cfg.d_model, bias=False)

    def _heads(self, x: torch.Tensor, qkv: tuple[torch.Tensor, ...], start: int):
        q, k, v = qkv
        shape = (*x.shape[:2], self.heads, -1)
        q, k = self.q_norm(q.view(shape)), self.k_norm(k.view(shape))
        if self.cfg.rope:
            q = apply_rotary(q, start, self.cfg.rope_theta)
            k = apply_rotary(k, start, self.cfg.rope_theta)
        return q, k, v.view(shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.prefill(x)[0], None

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, None, SoftmaxLayerCache]:
        qkv, conv = self.qkv.prefill(x)
        q, k, v = self._heads(x, qkv, 0)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        cache = SoftmaxLayerCache(k=k.transpose(1, 2).contiguous(),
                                  v=v.transpose(1, 2).contiguous(), length=x.shape[1],
                                  conv=conv)
        return self.out(o.transpose(1, 2).flatten(2)), None, cache

    def step(self, x: torch.Tensor, cache: SoftmaxLayerCache, position: int) -> torch.Tensor:
        qkv, cache.conv = self.qkv.step(x, cache.conv)
        q, k, v = self._heads(x, qkv, position)
        cache.append(k[:, 0], v[:, 0])
        n = cache.length
        o = decode_attention(q[:, 0], [cache.k[:, :, :n]], [cache.v[:, :, :n]],
                             q.shape[-1] ** -0.5, [None])
        return self.out(o.flatten(1)[:, None].to(x.dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Refuse, in one line, weights saved before this layer had its short convolution
        (one ``qkv.weight`` where there are now ``qkv.proj`` and ``qkv.conv``)."""
        if f"{prefix}qkv.weight" in state_dict:
            raise ValueError(
                f"weights from before plain softmax layers had short convolutions: unexpected "
                f"key {prefix}qkv.weight, missing {prefix}qkv.proj.weight and "
                f"{prefix}qkv.conv.weight; retrain (or re-export) the model")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
