"""Random inputs of gated linear attention and ELU+1 linear attention, for their tests."""

from __future__ import annotations

import torch

from .inputs import gdr_inputs


def gla_inputs(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
               dtype: torch.dtype = torch.float64, seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k (L2-normalised), v, a mild log decay g and a random initial state, as for the
    gated delta rule (no beta)."""
    x = gdr_inputs(batch, seq_len, heads, d_k, d_v, dtype=dtype, seed=seed)
    del x["beta"]
    return x


def la_inputs(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
              dtype: torch.dtype = torch.float64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Raw q, k (the operator applies phi), v, and an initial state ``[B, H, Dk, Dv + 1]``
    whose normaliser column is positive, as a state built from phi(k) >= 0 is."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    z = 0.5 + 2 * torch.rand(batch, heads, d_k, 1, generator=gen, dtype=dtype)
    return {
        "q": randn(batch, seq_len, heads, d_k),
        "k": randn(batch, seq_len, heads, d_k),
        "v": randn(batch, seq_len, heads, d_v),
        "initial_state": torch.cat([randn(batch, heads, d_k, d_v), z], -1),
    }
