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
from nats.kernels.decode import hybrid_attention_decode

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
        self.qkv = QKVProjection(cfg.d_model, self.dims, cfg.conv_size, cfg.backend)
        self.q_norm, self.k_norm = (RMSNorm(dk, cfg.norm_eps, cfg.backend),
                                     RMSNorm(dk, cfg.norm_eps, cfg.backend))
        self.out = nn.Linear(self.heads * dv, cfg.d_model, bias=False)

    def _heads(self, x: torch.Tensor, qkv: tuple[torch.Tensor, ...],
               start: int | torch.Tensor):
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
        # Contiguous heads: with v a strided slice of the projection, SDPA falls back to its
        # math kernel, which materialises the [T, T] scores.
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)),
                                           is_causal=True)
        cache = SoftmaxLayerCache.from_prompt(k.transpose(1, 2), v.transpose(1, 2), conv)
        return self.out(o.transpose(1, 2).flatten(2)), None, cache

    def step(self, x: torch.Tensor, cache: SoftmaxLayerCache, position: torch.Tensor,
             ) -> torch.Tensor:
        """One token at ``position`` (a device scalar); writes it into the cache."""
        q, k, v = self._heads(x, self.qkv.step(x, cache.conv), position)
        at = position.view(1)
        cache.k.index_copy_(2, at, k.transpose(1, 2))
        cache.v.index_copy_(2, at, v.transpose(1, 2))
        # The whole cache is one stored segment of a single head per query head (r = 1).
        o = hybrid_attention_decode(q[:, 0], cache.k[:, :, None], cache.v[:, :, None],
                                    (at + 1).expand(q.shape[0], q.shape[2]),
                                    backend=self.cfg.backend)
        return self.out(o.flatten(1)[:, None].to(x.dtype))

    def advance(self, cache: SoftmaxLayerCache, position: int) -> None:
        """Host bookkeeping after a step (see :meth:`NatsAttention.advance`)."""
        cache.advance()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Refuse, in one line, weights saved before this layer had its short convolution
        (one ``qkv.weight`` where there are now ``qkv.proj`` and ``qkv.conv``)."""
        if f"{prefix}qkv.weight" in state_dict:
            raise ValueError(
                f"weights from before plain softmax layers had short convolutions: unexpected "
                f"key {prefix}qkv.weight, missing {prefix}qkv.proj.weight and "
                f"{prefix}qkv.conv.weight; retrain (or re-export) the model")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
