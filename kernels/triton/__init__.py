"""Triton implementations of the hybrid operators (same contracts as :mod:`..reference`)."""

from .softmax_attention import hybrid_softmax_attention

__all__ = ["hybrid_softmax_attention"]
