"""Plain PyTorch references of every operator, and their token-by-token oracles."""

from .chunks import CHUNK_SIZES, LINEAR, SOFTMAX, chunk_ids, num_chunks
from .gated_delta_rule import gated_delta_rule, hybrid_gated_delta_rule
from .gated_linear_attention import gated_linear_attention, hybrid_gated_linear_attention
from .linear_attention import hybrid_linear_attention, linear_attention
from .recurrent import (
    causal_softmax_attention_recurrent,
    gated_delta_rule_recurrent,
    gated_linear_attention_recurrent,
    hybrid_gated_delta_rule_recurrent,
    hybrid_gated_linear_attention_recurrent,
    hybrid_linear_attention_recurrent,
    hybrid_softmax_attention_recurrent,
    linear_attention_recurrent,
)
from .softmax_attention import causal_softmax_attention, hybrid_softmax_attention

__all__ = [
    "CHUNK_SIZES",
    "LINEAR",
    "SOFTMAX",
    "causal_softmax_attention",
    "causal_softmax_attention_recurrent",
    "chunk_ids",
    "gated_delta_rule",
    "gated_delta_rule_recurrent",
    "gated_linear_attention",
    "gated_linear_attention_recurrent",
    "hybrid_gated_delta_rule",
    "hybrid_gated_delta_rule_recurrent",
    "hybrid_gated_linear_attention",
    "hybrid_gated_linear_attention_recurrent",
    "hybrid_linear_attention",
    "hybrid_linear_attention_recurrent",
    "hybrid_softmax_attention",
    "hybrid_softmax_attention_recurrent",
    "linear_attention",
    "linear_attention_recurrent",
    "num_chunks",
]
