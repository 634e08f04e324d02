"""The registry of linear-attention operators: one :class:`LinearOpSpec` per operator.

Everything above the kernels that depends on which operator runs (the config's choices,
the layers' gates and calls, the cost model, decoding, the shared tests) reads the spec,
so adding an operator is: its kernels (a routed chunked form, a one-token step, a
token-by-token oracle), one :func:`register_linear_op` call, and the shared operator
tests (``tests/nats/test_linear_ops.py``) run on it. docs/LINEAR_OPS.md describes the
built-in ones.

Every spec's callables take the same arguments, whichever gates the operator uses:

* ``parallel(q, k, v, g, beta, routes, chunk_size, scale, *, initial_state,
  output_final_state, route_grad, backend) -> (o, final_state)``: the routed chunked form
  (NATSL.md), q, k, v ``[B, T, H, D]``, gates ``[B, T, H]``;
* ``step(state, q, k, v, g, beta, scale, *, out, backend) -> (o, new_state)``: one token;
* ``recurrent(q, k, v, g, beta, scale) -> (o, final_state)``: the plain (unrouted)
  operator token by token, the oracle the tests hold the other two to.

``g`` is the log decay (zeros for an operator without a decay gate), ``beta`` the delta
rule's write strength (None without one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .decode import gated_delta_rule_step, gated_linear_attention_step, linear_attention_step
from .ops import hybrid_gated_delta_rule, hybrid_gated_linear_attention, hybrid_linear_attention
from .reference import (
    gated_delta_rule_recurrent,
    gated_linear_attention_recurrent,
    linear_attention_recurrent,
)

Outputs = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class LinearOpSpec:
    """What the rest of the package needs to know about one linear-attention operator."""

    name: str
    """The ``NatsConfig.linear_op`` value."""
    title: str
    """How documents and reports name it."""
    decays: bool
    """A data-dependent decay gate ``g`` (the layers then learn one)."""
    delta: bool
    """The delta rule's write strength ``beta`` (the layers then learn one)."""
    normaliser: bool
    """The state carries a normaliser column (``Dv + 1`` columns); q and k enter raw
    instead of L2-normalised (the feature map needs their sign and scale)."""
    flops_per_state_entry: int
    """FLOPs per token per state entry of the recurrent form (``nats.cost_model``)."""
    parallel: Callable[..., Outputs]
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    recurrent: Callable[..., Outputs]


LINEAR_OP_SPECS: dict[str, LinearOpSpec] = {}
"""Registered operators by name, in registration order (the built-in ones first)."""


def register_linear_op(spec: LinearOpSpec) -> None:
    """Make ``spec`` a choice of ``NatsConfig.linear_op``; a taken name is an error."""
    if spec.name in LINEAR_OP_SPECS:
        raise ValueError(f"a linear operator named {spec.name!r} is already registered")
    LINEAR_OP_SPECS[spec.name] = spec


@contextlib.contextmanager
def registered(spec: LinearOpSpec) -> Iterator[LinearOpSpec]:
    """``spec`` registered while the block runs (tests, experiments)."""
    register_linear_op(spec)
    try:
        yield spec
    finally:
        del LINEAR_OP_SPECS[spec.name]


def linear_op_spec(name: str) -> LinearOpSpec:
    """The spec of ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    if name not in LINEAR_OP_SPECS:
        raise ValueError(f"linear_op = {name!r} is invalid: must be one of "
                         f"{tuple(LINEAR_OP_SPECS)}")
    return LINEAR_OP_SPECS[name]


def _gla_parallel(q, k, v, g, beta, routes, chunk_size, scale, **kw: Any) -> Outputs:
    return hybrid_gated_linear_attention(q, k, v, g, routes, chunk_size, scale, **kw)


def _gla_step(state, q, k, v, g, beta, scale, **kw: Any):
    return gated_linear_attention_step(state, q, k, v, g, scale, **kw)


def _gla_recurrent(q, k, v, g, beta, scale) -> Outputs:
    return gated_linear_attention_recurrent(q, k, v, g, scale)


def _la_parallel(q, k, v, g, beta, routes, chunk_size, scale, **kw: Any) -> Outputs:
    return hybrid_linear_attention(q, k, v, routes, chunk_size, **kw)


def _la_step(state, q, k, v, g, beta, scale, **kw: Any):
    return linear_attention_step(state, q, k, v, **kw)


def _la_recurrent(q, k, v, g, beta, scale) -> Outputs:
    return linear_attention_recurrent(q, k, v)


# The gated delta rule's functions take the spec's arguments as they are; the others
# adapt them to the gates their operator has.
# FLOPs per state entry: decay 1, delta read 2, write 2, output read 2 (nats.cost_model).
for _spec in (
    LinearOpSpec("gated_deltanet", "Gated DeltaNet", decays=True, delta=True, normaliser=False,
                 flops_per_state_entry=7, parallel=hybrid_gated_delta_rule,
                 step=gated_delta_rule_step, recurrent=gated_delta_rule_recurrent),
    # DeltaNet is the gated delta rule with g = 0 (the layers' gates give zeros).
    LinearOpSpec("deltanet", "DeltaNet", decays=False, delta=True, normaliser=False,
                 flops_per_state_entry=6, parallel=hybrid_gated_delta_rule,
                 step=gated_delta_rule_step, recurrent=gated_delta_rule_recurrent),
    LinearOpSpec("gated_linear_attention", "gated linear attention", decays=True, delta=False,
                 normaliser=False, flops_per_state_entry=5, parallel=_gla_parallel,
                 step=_gla_step, recurrent=_gla_recurrent),
    LinearOpSpec("linear_attention", "linear attention (ELU+1)", decays=False, delta=False,
                 normaliser=True, flops_per_state_entry=4, parallel=_la_parallel,
                 step=_la_step, recurrent=_la_recurrent),
):
    register_linear_op(_spec)
