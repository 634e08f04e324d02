"""Hybrid softmax / linear attention operators of NAtS-L.

The public operators take a ``backend`` (``"auto"``, ``"reference"``, ``"triton"``), and
so do the one-token decode operators of :mod:`.decode`. The plain baselines and the
token-by-token oracles come from :mod:`.reference`.
"""

from .ops import (
    BACKENDS,
    Backend,
    hybrid_gated_delta_rule,
    hybrid_gated_linear_attention,
    hybrid_linear_attention,
    hybrid_softmax_attention,
    l2_norm,
    linear_gates,
    merge_branches,
    resolve_backend,
    rms_norm,
    short_conv,
)
from .reference import (
    CHUNK_SIZES,
    LINEAR,
    SOFTMAX,
    causal_softmax_attention,
    causal_softmax_attention_recurrent,
    gated_delta_rule,
    gated_delta_rule_recurrent,
    gated_linear_attention,
    gated_linear_attention_recurrent,
    hybrid_gated_delta_rule_recurrent,
    hybrid_gated_linear_attention_recurrent,
    hybrid_linear_attention_recurrent,
    hybrid_softmax_attention_recurrent,
    linear_attention,
    linear_attention_recurrent,
    num_chunks,
)

__all__ = [
    "BACKENDS",
    "CHUNK_SIZES",
    "LINEAR",
    "SOFTMAX",
    "Backend",
    "causal_softmax_attention",
    "causal_softmax_attention_recurrent",
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
    "l2_norm",
    "linear_attention",
    "linear_attention_recurrent",
    "linear_gates",
    "merge_branches",
    "num_chunks",
    "resolve_backend",
    "rms_norm",
    "short_conv",
]
