"""Triton implementations of the hybrid operators (same contracts as :mod:`..reference`)."""

from .gated_delta_rule import hybrid_gated_delta_rule
from .gated_linear_attention import hybrid_gated_linear_attention
from .softmax_attention import hybrid_softmax_attention

__all__ = ["hybrid_gated_delta_rule", "hybrid_gated_linear_attention", "hybrid_softmax_attention"]
