"""Gated linear attention and ELU+1 linear attention (chunked references) held to NATSL.md.

Both follow the routed semantics of the gated delta rule: every chunk decays the carried
state, only chunks routed to linear write into it, and a query sees its own chunk from
the chunk-start state. Each test compares against a computation that does not go through
the chunked references: the token-by-token oracles, the decode steps run token by token,
or numbers worked out by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import nats.kernels as nk
from nats.kernels import LINEAR, SOFTMAX, num_chunks
from nats.kernels import reference as ref
from nats.kernels.decode import gated_linear_attention_step, linear_attention_step

from .inputs import F64, ROUTE_KINDS, grads, make_routes, rel_rms_error
from .linear_inputs import gla_inputs, la_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, HEADS, D_K, D_V = 2, 2, 8, 6


@dataclass(frozen=True)
class Op:
    """One operator: its inputs, chunked reference, token-by-token oracle and public op."""

    name: str
    inputs: Callable[..., dict[str, torch.Tensor]]
    chunked: Callable
    oracle: Callable
    public: Callable

    def __str__(self) -> str:
        return self.name


GLA = Op("gla", gla_inputs, ref.hybrid_gated_linear_attention,
         ref.hybrid_gated_linear_attention_recurrent, nk.hybrid_gated_linear_attention)
LA = Op("la", la_inputs, ref.hybrid_linear_attention, ref.hybrid_linear_attention_recurrent,
        nk.hybrid_linear_attention)
OPS = [GLA, LA]


def leaves(inputs: dict[str, torch.Tensor], routes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fresh leaf copies of the inputs and routes that require grad (routes last)."""
    return {name: x.detach().clone().requires_grad_()
            for name, x in {**inputs, "routes": routes}.items()}


# --- against the token-by-token oracles ---------------------------------------------------

ORACLE_CASES = [(1, 16), (37, 16), (70, 32), (130, 64), (261, 256)]


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("kind", ROUTE_KINDS)
@pytest.mark.parametrize(("seq_len", "chunk_size"), ORACLE_CASES)
def test_matches_oracle_float64(op: Op, seq_len: int, chunk_size: int, kind: str) -> None:
    """Outputs, final state and the gradient of every input, routes included."""
    args = leaves(op.inputs(BATCH, seq_len, HEADS, D_K, D_V, seed=seq_len),
                  make_routes(BATCH, seq_len, chunk_size, HEADS, kind, seed=chunk_size))
    out = op.chunked(**args, chunk_size=chunk_size, output_final_state=True, route_grad="both")
    expected = op.oracle(**args, chunk_size=chunk_size, output_final_state=True)

    torch.testing.assert_close(out, expected, **F64)
    wrt = tuple(args.values())
    for name, got, want in zip(args, grads(out, wrt), grads(expected, wrt), strict=True):
        torch.testing.assert_close(got, want, **F64, msg=f"gradient of {name}")


@pytest.mark.parametrize("op", OPS, ids=str)
def test_matches_oracle_float32(op: Op) -> None:
    """float32 inputs compute in float32 and stay close to the float64 oracle."""
    seq_len, chunk_size = 130, 32
    inputs = op.inputs(BATCH, seq_len, HEADS, D_K, D_V, seed=3)
    routes = make_routes(BATCH, seq_len, chunk_size, HEADS, "random", seed=4)
    args32 = leaves({n: x.float() for n, x in inputs.items()}, routes.float())
    args64 = leaves(inputs, routes)

    out = op.chunked(**args32, chunk_size=chunk_size, output_final_state=True,
                     route_grad="both")
    expected = op.oracle(**args64, chunk_size=chunk_size, output_final_state=True)

    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    for got, want in zip(out, expected, strict=True):
        assert rel_rms_error(got, want) < 1e-5
    for name, got, want in zip(args32, grads(out, tuple(args32.values())),
                               grads(expected, tuple(args64.values())), strict=True):
        assert rel_rms_error(got, want) < 1e-4, f"gradient of {name}"


@pytest.mark.parametrize("op", OPS, ids=str)
def test_selected_route_grad_is_both_times_one_hot(op: Op) -> None:
    """Default ``route_grad="selected"``: the "both" gradient at the chosen option only."""
    seq_len, chunk_size = 70, 16
    args = leaves(op.inputs(BATCH, seq_len, HEADS, D_K, D_V),
                  make_routes(BATCH, seq_len, chunk_size, HEADS, "random"))
    wrt = tuple(args.values())
    out_both = op.chunked(**args, chunk_size=chunk_size, output_final_state=True,
                          route_grad="both")
    out_selected = op.chunked(**args, chunk_size=chunk_size, output_final_state=True)
    *inputs_both, routes_both = grads(out_both, wrt)
    *inputs_selected, routes_selected = grads(out_selected, wrt)

    torch.testing.assert_close(out_selected, out_both, rtol=0, atol=0)
    for got, want in zip(inputs_selected, inputs_both, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(routes_selected, routes_both * args["routes"], rtol=0, atol=0)
    assert not routes_both[..., SOFTMAX].any()
    unselected = args["routes"][..., LINEAR] == 0
    assert unselected.any() and routes_both[..., LINEAR][unselected].abs().min() > 0


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_gradcheck(op: Op, kind: str) -> None:
    """Finite differences in float64, routes and initial state included."""
    seq_len, chunk_size = 17, 16
    args = leaves(op.inputs(1, seq_len, 1, 2, 2), make_routes(1, seq_len, chunk_size, 1, kind))

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return op.chunked(**dict(zip(args, xs, strict=True)), chunk_size=chunk_size,
                          output_final_state=True, route_grad="both")

    assert torch.autograd.gradcheck(fn, tuple(args.values()))


@pytest.mark.parametrize("op", OPS, ids=str)
def test_varlen_is_per_sequence(op: Op) -> None:
    """The packed reference equals the dense one run on every sequence alone."""
    lengths, chunk = (9, 40, 20), 16
    x = op.inputs(len(lengths), max(lengths), HEADS, D_K, D_V, seed=5)
    h0 = x.pop("initial_state")
    packed = {n: torch.cat([t[i : i + 1, :n_i] for i, n_i in enumerate(lengths)], 1)
              for n, t in x.items()}
    counts = [num_chunks(n, chunk) for n in lengths]
    routes = make_routes(1, sum(counts) * chunk, chunk, HEADS, "random")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, state = op.chunked(**packed, routes=routes, chunk_size=chunk, initial_state=h0,
                          output_final_state=True, cu_seqlens=cu)
    for i, r in enumerate(routes.split(counts, 1)):
        alone = {n: t[i : i + 1, : lengths[i]] for n, t in x.items()}
        o_i, s_i = op.oracle(**alone, routes=r, chunk_size=chunk, initial_state=h0[i : i + 1],
                             output_final_state=True)
        torch.testing.assert_close(o.split(lengths, 1)[i], o_i, **F64)
        torch.testing.assert_close(state[i : i + 1], s_i, **F64)


# --- degenerate cases and hand-computed values -------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_gla_all_linear_is_plain_and_all_softmax_restarts_each_chunk(chunk_size: int) -> None:
    """Head 0 routes every chunk to linear (plain gated linear attention); head 1 every
    chunk to softmax: it sees only its own chunk, from the decayed initial state."""
    seq_len = 70
    inputs = gla_inputs(BATCH, seq_len, HEADS, D_K, D_V)
    routes = torch.cat([make_routes(BATCH, seq_len, chunk_size, 1, "linear"),
                        make_routes(BATCH, seq_len, chunk_size, 1, "softmax")], dim=2)
    out, final = ref.hybrid_gated_linear_attention(**inputs, routes=routes,
                                                   chunk_size=chunk_size,
                                                   output_final_state=True)

    plain, plain_final = ref.gated_linear_attention_recurrent(**inputs, output_final_state=True)
    torch.testing.assert_close(out[:, :, 0], plain[:, :, 0], **F64)
    torch.testing.assert_close(final[:, 0], plain_final[:, 0], **F64)
    g, state = inputs["g"], inputs["initial_state"]
    for start in range(0, seq_len, chunk_size):
        t = slice(start, start + chunk_size)
        decayed = state * g[:, :start].sum(1).exp()[..., None, None]
        chunk_out, _ = ref.gated_linear_attention_recurrent(
            *(inputs[n][:, t] for n in ("q", "k", "v", "g")), initial_state=decayed)
        torch.testing.assert_close(out[:, t, 1], chunk_out[:, :, 1], **F64)
    torch.testing.assert_close(final[:, 1], (state * g.sum(1).exp()[..., None, None])[:, 1],
                               **F64)


def test_plain_baselines_match_oracles() -> None:
    """``gated_linear_attention`` / ``linear_attention`` (every chunk writes) against the
    unrouted token-by-token forms."""
    gla = gla_inputs(BATCH, 37, HEADS, D_K, D_V)
    torch.testing.assert_close(
        ref.gated_linear_attention(**gla, output_final_state=True, chunk_size=16),
        ref.gated_linear_attention_recurrent(**gla, output_final_state=True), **F64)
    la = la_inputs(BATCH, 37, HEADS, D_K, D_V)
    torch.testing.assert_close(ref.linear_attention(**la, output_final_state=True),
                               ref.linear_attention_recurrent(**la, output_final_state=True),
                               **F64)


def test_hand_computed_gla() -> None:
    """T = 2, Dk = 2, Dv = 1, scale 1, zero initial state, q = [1, 1].

    ``S_0 = k_0 v_0 = [2, 0]`` (a_0 acts on the zero state); ``S_1 = 0.5 S_0 + k_1 v_1 =
    [1, 0] + [0, 3] = [1, 3]``. So ``o = [2, 4]`` and the final state is ``[1, 3]``.
    """
    def tensor(values: list, *shape: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64).view(*shape)

    q = tensor([1.0, 1.0, 1.0, 1.0], 1, 2, 1, 2)
    k = tensor([1.0, 0.0, 0.0, 1.0], 1, 2, 1, 2)
    v = tensor([2.0, 3.0], 1, 2, 1, 1)
    g = tensor([math.log(0.9), math.log(0.5)], 1, 2, 1)
    routes = tensor([0.0, 1.0], 1, 1, 1, 2)
    out, final = ref.hybrid_gated_linear_attention(q, k, v, g, routes, 16, scale=1.0,
                                                   output_final_state=True)
    torch.testing.assert_close(out.flatten(), tensor([2.0, 4.0], 2), **F64)
    torch.testing.assert_close(final.flatten(), tensor([1.0, 3.0], 2), **F64)


@pytest.mark.parametrize("chunk0", [SOFTMAX, LINEAR])
def test_hand_computed_linear_attention(chunk0: int) -> None:
    """T = 17, chunk 16, Dk = Dv = 1, q = k = 0 (phi = 1), v_t = t, eps = 0.

    Every output is the mean of the values it sees: ``o_t = t / 2`` in chunk 0. Token 16
    sees tokens 0..16 (mean 8) if chunk 0 went to linear, only itself (16) if it went to
    softmax. The final state is ``[sum of values seen, count]``.
    """
    zeros = torch.zeros(1, 17, 1, 1, dtype=torch.float64)
    v = torch.arange(17, dtype=torch.float64).view(1, 17, 1, 1)
    routes = torch.zeros(1, 2, 1, 2, dtype=torch.float64)
    routes[0, 0, 0, chunk0] = 1
    routes[0, 1, 0, LINEAR] = 1
    out, final = ref.hybrid_linear_attention(zeros, zeros, v, routes, 16,
                                             output_final_state=True, eps=0.0)
    last, seen = (8.0, [136.0, 17.0]) if chunk0 == LINEAR else (16.0, [16.0, 1.0])
    want = torch.tensor([t / 2 for t in range(16)] + [last], dtype=torch.float64)
    torch.testing.assert_close(out.flatten(), want, **F64)
    torch.testing.assert_close(final.flatten(), torch.tensor(seen, dtype=torch.float64), **F64)


# --- decode steps --------------------------------------------------------------------------


def test_gla_decode_steps_match_oracle() -> None:
    """Stepping token by token from the initial state gives the oracle's outputs and state."""
    x = gla_inputs(BATCH, 23, HEADS, D_K, D_V, dtype=torch.float32)
    want, want_state = ref.gated_linear_attention_recurrent(**x, scale=0.7,
                                                            output_final_state=True)
    state = x["initial_state"]
    for t in range(23):
        o, state = gated_linear_attention_step(state, *(x[n][:, t] for n in "qkvg"), 0.7)
        assert rel_rms_error(o, want[:, t]) < 1e-6
    assert rel_rms_error(state, want_state) < 1e-6


def test_linear_attention_decode_steps_match_oracle() -> None:
    x = la_inputs(BATCH, 23, HEADS, D_K, D_V, dtype=torch.float32)
    want, want_state = ref.linear_attention_recurrent(**x, output_final_state=True, eps=1e-3)
    state = x["initial_state"]
    for t in range(23):
        o, state = linear_attention_step(state, *(x[n][:, t] for n in "qkv"), eps=1e-3)
        assert o.shape == (BATCH, HEADS, D_V)
        assert rel_rms_error(o, want[:, t]) < 1e-6
    assert state.shape == (BATCH, HEADS, D_K, D_V + 1)
    assert rel_rms_error(state, want_state) < 1e-6


# --- causality ---------------------------------------------------------------------------

CAUSAL_T, CAUSAL_CHUNK = 40, 16


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("j", [5, 20, 39], ids=lambda j: f"token{j}")
def test_later_token_leaves_earlier_outputs(op: Op, j: int) -> None:
    """Perturbing every input of token ``j`` changes no output before ``j``."""
    inputs = op.inputs(BATCH, CAUSAL_T, HEADS, D_K, D_V)
    routes = make_routes(BATCH, CAUSAL_T, CAUSAL_CHUNK, HEADS, "random")
    out, _ = op.chunked(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK)
    for name in ("q", "k", "v", "g"):
        if name in inputs:
            inputs[name] = inputs[name].clone()
            inputs[name][:, j] -= 0.5  # keeps g <= 0
    perturbed, _ = op.chunked(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK)
    torch.testing.assert_close(perturbed[:, :j], out[:, :j], rtol=0, atol=1e-13)
    assert not torch.allclose(perturbed[:, j], out[:, j])


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("chunk", range(num_chunks(CAUSAL_T, CAUSAL_CHUNK)))
def test_route_changes_only_later_chunks(op: Op, chunk: int) -> None:
    """Flipping the route of chunk ``c`` changes outputs after chunk ``c`` and no other."""
    inputs = op.inputs(BATCH, CAUSAL_T, HEADS, D_K, D_V)
    routes = make_routes(BATCH, CAUSAL_T, CAUSAL_CHUNK, HEADS, "random")
    flipped = routes.clone()
    flipped[:, chunk] = routes[:, chunk].flip(-1)
    out, final = op.chunked(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK,
                            output_final_state=True)
    out_f, final_f = op.chunked(**inputs, routes=flipped, chunk_size=CAUSAL_CHUNK,
                                output_final_state=True)
    end = min((chunk + 1) * CAUSAL_CHUNK, CAUSAL_T)
    torch.testing.assert_close(out_f[:, :end], out[:, :end], rtol=0, atol=0)
    if end < CAUSAL_T:
        assert not torch.allclose(out_f[:, end:], out[:, end:])
    assert not torch.allclose(final_f, final)


# --- input checks and the public dispatch ------------------------------------------------


def _valid(op: Op) -> dict[str, object]:
    return {**op.inputs(1, 20, 2, 4, 3), "routes": make_routes(1, 20, 16, 2, "random"),
            "chunk_size": 16}


@pytest.mark.parametrize(("op", "changes", "match"), [
    (GLA, {"g": torch.zeros(1, 20, 2, 1)}, r"g must be \[B, T, H\] = \[1, 20, 2\]"),
    (GLA, {"initial_state": torch.zeros(1, 2, 4, 4)},
     r"initial_state must be \[B, H, Dk, Dv\] = \[1, 2, 4, 3\]"),
    (GLA, {"chunk_size": 8}, r"chunk_size must be one of"),
    (GLA, {"route_grad": "none"}, r"route_grad must be one of"),
    (LA, {"initial_state": torch.zeros(1, 2, 4, 3)},
     r"initial_state must be \[B, H, Dk, Dv \+ 1\] .* Dv = 3, got \[1, 2, 4, 3\]"),
    (LA, {"routes": torch.zeros(1, 1, 2, 2)}, r"routes must have shape \[B=1, N=2, H, 2\]"),
], ids=["gla-g", "gla-state", "gla-chunk", "gla-route-grad", "la-state", "la-routes"])
def test_bad_input_names_the_problem(op: Op, changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        op.chunked(**{**_valid(op), **changes})


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_public_op_on_cpu_is_the_reference(op: Op, backend: str) -> None:
    args = _valid(op)
    torch.testing.assert_close(op.public(**args, output_final_state=True, backend=backend),
                               op.chunked(**args, output_final_state=True), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"backend must be one of .*, got 'bogus'"):
        op.public(**args, backend="bogus")
