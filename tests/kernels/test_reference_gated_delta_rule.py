"""The linear branch of NAtS-L (chunked gated delta rule with routes) held to NATSL.md.

Every chunk decays the carried state by its gates; only chunks routed to linear also
write into it. Within its own chunk a query runs the plain gated delta rule from the
chunk-start state. Each test compares against a computation that does not go through
the chunked reference: the token-by-token oracles, or numbers worked out by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import nats.kernels as nk
from nats.kernels import CHUNK_SIZES, LINEAR, SOFTMAX, num_chunks
from nats.kernels import reference as ref

from .inputs import (
    F64,
    ORACLE_CASES,
    ROUTE_KINDS,
    gdr_inputs,
    grads,
    make_routes,
    rel_rms_error,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, HEADS, D_K, D_V = 2, 2, 8, 6
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "routes")

GdrFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def leaves(inputs: dict[str, torch.Tensor], routes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fresh leaf copies of the inputs and routes that require grad, in GRAD_NAMES order."""
    return {name: x.detach().clone().requires_grad_()
            for name, x in {**inputs, "routes": routes}.items()}


# --- against the token-by-token oracle ----------------------------------------------------


@pytest.mark.parametrize("kind", ROUTE_KINDS)
@pytest.mark.parametrize(("seq_len", "chunk_size"), ORACLE_CASES)
def test_matches_oracle_float64(seq_len: int, chunk_size: int, kind: str) -> None:
    """Outputs, final state and the gradient of every input, routes included."""
    args = leaves(gdr_inputs(BATCH, seq_len, HEADS, D_K, D_V, seed=seq_len),
                  make_routes(BATCH, seq_len, chunk_size, HEADS, kind, seed=chunk_size))
    wrt = tuple(args[name] for name in GRAD_NAMES)

    out = ref.hybrid_gated_delta_rule(**args, chunk_size=chunk_size, output_final_state=True,
                                      route_grad="both")
    expected = ref.hybrid_gated_delta_rule_recurrent(**args, chunk_size=chunk_size,
                                                     output_final_state=True)

    torch.testing.assert_close(out, expected, **F64)
    for name, got, want in zip(GRAD_NAMES, grads(out, wrt), grads(expected, wrt), strict=True):
        torch.testing.assert_close(got, want, **F64, msg=f"gradient of {name}")


@pytest.mark.parametrize(("seq_len", "chunk_size"), [(70, 16), (130, 64), (261, 256)])
def test_matches_oracle_float32(seq_len: int, chunk_size: int) -> None:
    """float32 inputs compute in float32 and stay close to the float64 oracle."""
    inputs = gdr_inputs(BATCH, seq_len, HEADS, D_K, D_V, seed=seq_len)
    routes = make_routes(BATCH, seq_len, chunk_size, HEADS, "random", seed=chunk_size)
    args32 = leaves({n: x.float() for n, x in inputs.items()}, routes.float())
    args64 = leaves(inputs, routes)

    out = ref.hybrid_gated_delta_rule(**args32, chunk_size=chunk_size, output_final_state=True,
                                      route_grad="both")
    expected = ref.hybrid_gated_delta_rule_recurrent(**args64, chunk_size=chunk_size,
                                                     output_final_state=True)

    assert out[0].dtype == torch.float32
    for got, want in zip(out, expected, strict=True):
        assert rel_rms_error(got, want) < 1e-5
    for name, got, want in zip(GRAD_NAMES,
                               grads(out, tuple(args32[n] for n in GRAD_NAMES)),
                               grads(expected, tuple(args64[n] for n in GRAD_NAMES)),
                               strict=True):
        assert rel_rms_error(got, want) < 1e-4, f"gradient of {name}"


def test_selected_route_grad_is_both_times_one_hot() -> None:
    """Default ``route_grad="selected"``: the "both" gradient at the chosen option only.

    The linear operator never gives a gradient to the softmax option's column.
    """
    seq_len, chunk_size = 70, 16
    args = leaves(gdr_inputs(BATCH, seq_len, HEADS, D_K, D_V),
                  make_routes(BATCH, seq_len, chunk_size, HEADS, "random"))
    wrt = tuple(args[name] for name in GRAD_NAMES)

    out_both = ref.hybrid_gated_delta_rule(**args, chunk_size=chunk_size,
                                           output_final_state=True, route_grad="both")
    out_selected = ref.hybrid_gated_delta_rule(**args, chunk_size=chunk_size,
                                               output_final_state=True)
    *inputs_both, routes_both = grads(out_both, wrt)
    *inputs_selected, routes_selected = grads(out_selected, wrt)

    torch.testing.assert_close(out_selected, out_both, rtol=0, atol=0)
    for got, want in zip(inputs_selected, inputs_both, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(routes_selected, routes_both * args["routes"], rtol=0, atol=0)
    assert not routes_both[..., SOFTMAX].any()
    # Not vacuous: "both" does give the unselected linear option a gradient.
    unselected = args["routes"][..., LINEAR] == 0
    assert unselected.any() and routes_both[..., LINEAR][unselected].abs().min() > 0


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_gradcheck(kind: str) -> None:
    """Finite differences in float64, routes and initial state included.

    Routing chunk 0 to softmax, then to linear, checks the route derivative at 0 and 1.
    """
    seq_len, chunk_size = 17, 16
    inputs = gdr_inputs(1, seq_len, 1, 2, 2)
    args = leaves(inputs, make_routes(1, seq_len, chunk_size, 1, kind))

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs = dict(zip(GRAD_NAMES, xs, strict=True))
        return ref.hybrid_gated_delta_rule(**kwargs, chunk_size=chunk_size,
                                           output_final_state=True, route_grad="both")

    assert torch.autograd.gradcheck(fn, tuple(args[name] for name in GRAD_NAMES))


@pytest.mark.parametrize("with_initial_state", [True, False])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_plain_chunked_baseline_matches_oracle(chunk_size: int, with_initial_state: bool) -> None:
    """``gated_delta_rule`` (every chunk writes) against ``gated_delta_rule_recurrent``."""
    inputs = gdr_inputs(BATCH, 37, HEADS, D_K, D_V)
    if not with_initial_state:
        del inputs["initial_state"]
    args = {name: x.requires_grad_() for name, x in inputs.items()}

    out = ref.gated_delta_rule(**args, output_final_state=True, chunk_size=chunk_size)
    expected = ref.gated_delta_rule_recurrent(**args, output_final_state=True)

    torch.testing.assert_close(out, expected, **F64)
    wrt = tuple(args.values())
    for got, want in zip(grads(out, wrt), grads(expected, wrt), strict=True):
        torch.testing.assert_close(got, want, **F64)


# --- degenerate cases and hand-computed values -------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("impl", [ref.hybrid_gated_delta_rule,
                                  ref.hybrid_gated_delta_rule_recurrent])
def test_all_linear_is_plain_and_all_softmax_restarts_each_chunk(impl: GdrFn,
                                                                   chunk_size: int) -> None:
    """Head 0 routes every chunk to linear, head 1 every chunk to softmax.

    Head 0 is then the plain gated delta rule. Head 1 sees only its own chunk, starting
    from the initial state decayed by every earlier gate, and carries no write out.
    """
    seq_len = 70
    inputs = gdr_inputs(BATCH, seq_len, HEADS, D_K, D_V)
    routes = torch.cat([make_routes(BATCH, seq_len, chunk_size, 1, "linear"),
                        make_routes(BATCH, seq_len, chunk_size, 1, "softmax")], dim=2)

    out, final = impl(**inputs, routes=routes, chunk_size=chunk_size, output_final_state=True)

    plain, plain_final = ref.gated_delta_rule_recurrent(**inputs, output_final_state=True)
    torch.testing.assert_close(out[:, :, 0], plain[:, :, 0], **F64)
    torch.testing.assert_close(final[:, 0], plain_final[:, 0], **F64)

    g, state = inputs["g"], inputs["initial_state"]
    for start in range(0, seq_len, chunk_size):
        t = slice(start, start + chunk_size)
        decayed = state * g[:, :start].sum(1).exp()[..., None, None]
        chunk_out, _ = ref.gated_delta_rule_recurrent(
            *(inputs[n][:, t] for n in ("q", "k", "v", "g", "beta")), initial_state=decayed)
        torch.testing.assert_close(out[:, t, 1], chunk_out[:, :, 1], **F64)
    torch.testing.assert_close(final[:, 1], (state * g.sum(1).exp()[..., None, None])[:, 1],
                               **F64)


def test_hand_computed_delta_rule() -> None:
    """T = 2, Dk = 2, Dv = 1, scale 1, zero initial state; the delta rule by hand.

    ``S_0 = b_0 v_0 k_0 = 0.5 * 2 * [1, 0] = [1, 0]``.
    ``S_1 = a_1 (S_0 - b_1 k_1 (k_1.S_0)) + b_1 v_1 k_1`` with ``k_1 = [0.6, 0.8]``:
    ``k_1.S_0 = 0.6``, ``S_0 - 0.5 * 0.6 * k_1 = [0.82, -0.24]``, times ``a_1 = 0.5`` is
    ``[0.41, -0.12]``, plus ``0.5 * 3 * k_1 = [0.9, 1.2]``: ``S_1 = [1.31, 1.08]``.
    With ``q_t = [1, 1]``: ``o_0 = 1``, ``o_1 = 2.39``.
    """
    def tensor(values: list, *shape: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64).view(*shape)

    q = tensor([[1.0, 1.0], [1.0, 1.0]], 1, 2, 1, 2)
    k = tensor([[1.0, 0.0], [0.6, 0.8]], 1, 2, 1, 2)
    v = tensor([2.0, 3.0], 1, 2, 1, 1)
    g = tensor([math.log(0.9), math.log(0.5)], 1, 2, 1)  # a_0 acts on the zero state only
    beta = tensor([0.5, 0.5], 1, 2, 1)
    routes = tensor([0.0, 1.0], 1, 1, 1, 2)

    out, final = ref.hybrid_gated_delta_rule(q, k, v, g, beta, routes, 16, scale=1.0,
                                             output_final_state=True)

    torch.testing.assert_close(out.flatten(), tensor([1.0, 1.31 + 1.08], 2), **F64)
    torch.testing.assert_close(final.flatten(), tensor([1.31, 1.08], 2), **F64)


@pytest.mark.parametrize("chunk0", [SOFTMAX, LINEAR])
def test_hand_computed_route(chunk0: int) -> None:
    """T = 17, chunk 16, Dk = Dv = 1, q = k = v = 1, b = 1/2, a = 1/2, S_init = 1, scale 1.

    Each step is ``S <- a (1 - b) S + b = S / 4 + 1 / 2``, so ``S_t - 2/3`` shrinks by 4:
    ``o_t = S_t = 2/3 + (1/3) 4^-(t+1)`` in chunk 0. Token 16 starts from ``S_15`` if
    chunk 0 went to linear, from ``S_init * a^16 = 2^-16`` if it went to softmax.
    Chunk 1 is linear, so the final state is ``S_16``.
    """
    ones = torch.ones(1, 17, 1, 1, dtype=torch.float64)
    g = torch.full((1, 17, 1), math.log(0.5), dtype=torch.float64)
    beta = torch.full((1, 17, 1), 0.5, dtype=torch.float64)
    routes = torch.zeros(1, 2, 1, 2, dtype=torch.float64)
    routes[0, 0, 0, chunk0] = 1
    routes[0, 1, 0, LINEAR] = 1
    initial_state = torch.ones(1, 1, 1, 1, dtype=torch.float64)

    out, final = ref.hybrid_gated_delta_rule(ones, ones, ones, g, beta, routes, 16, scale=1.0,
                                             initial_state=initial_state,
                                             output_final_state=True)

    chunk0_outputs = [2 / 3 + 4 ** -(t + 1) / 3 for t in range(16)]
    chunk1_start = chunk0_outputs[-1] if chunk0 == LINEAR else 2.0**-16
    s16 = chunk1_start / 4 + 1 / 2
    torch.testing.assert_close(out.flatten(),
                               torch.tensor([*chunk0_outputs, s16], dtype=torch.float64), **F64)
    torch.testing.assert_close(final.flatten(), torch.tensor([s16], dtype=torch.float64), **F64)


# --- causality ---------------------------------------------------------------------------

CAUSAL_T, CAUSAL_CHUNK = 40, 16


def _perturb(name: str, x: torch.Tensor, j: int) -> torch.Tensor:
    """``x`` with token ``j`` changed, staying valid (g <= 0, beta in (0, 1))."""
    x = x.clone()
    noise = torch.rand(x[:, j].shape, dtype=x.dtype, generator=torch.Generator().manual_seed(j))
    if name == "g":
        x[:, j] -= noise + 0.5
    elif name == "beta":
        x[:, j] = 0.05 + 0.9 * noise
    else:
        x[:, j] += 2 * noise - 1
    return x


@pytest.mark.parametrize("j", [5, 20, 39], ids=lambda j: f"token{j}")
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_later_token_leaves_earlier_outputs(name: str, j: int) -> None:
    """Perturbing token ``j`` (also inside the chunk of earlier tokens) changes no output < j."""
    inputs = gdr_inputs(BATCH, CAUSAL_T, HEADS, D_K, D_V)
    routes = make_routes(BATCH, CAUSAL_T, CAUSAL_CHUNK, HEADS, "random")
    out, _ = ref.hybrid_gated_delta_rule(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK)

    inputs[name] = _perturb(name, inputs[name], j)
    perturbed, _ = ref.hybrid_gated_delta_rule(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK)

    torch.testing.assert_close(perturbed[:, :j], out[:, :j], rtol=0, atol=1e-13)
    assert not torch.allclose(perturbed[:, j], out[:, j])


@pytest.mark.parametrize("chunk", range(num_chunks(CAUSAL_T, CAUSAL_CHUNK)))
def test_route_changes_only_later_chunks(chunk: int) -> None:
    """Flipping the route of chunk ``c`` changes outputs after chunk ``c`` and no other.

    The route of the last chunk changes only the final state.
    """
    inputs = gdr_inputs(BATCH, CAUSAL_T, HEADS, D_K, D_V)
    routes = make_routes(BATCH, CAUSAL_T, CAUSAL_CHUNK, HEADS, "random")
    flipped = routes.clone()
    flipped[:, chunk] = routes[:, chunk].flip(-1)

    out, final = ref.hybrid_gated_delta_rule(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK,
                                             output_final_state=True)
    out_flipped, final_flipped = ref.hybrid_gated_delta_rule(
        **inputs, routes=flipped, chunk_size=CAUSAL_CHUNK, output_final_state=True)

    end = min((chunk + 1) * CAUSAL_CHUNK, CAUSAL_T)
    torch.testing.assert_close(out_flipped[:, :end], out[:, :end], rtol=0, atol=0)
    if end < CAUSAL_T:
        assert not torch.allclose(out_flipped[:, end:], out[:, end:])
    assert not torch.allclose(final_flipped, final)


# --- input checks and the public dispatch ------------------------------------------------

_B, _T, _H, _C = 1, 20, 2, 16


def _valid_args() -> dict[str, object]:
    return {**gdr_inputs(_B, _T, _H, 4, 3), "routes": make_routes(_B, _T, _C, _H, "random"),
            "chunk_size": _C}


@pytest.mark.parametrize(("changes", "match"), [
    ({"q": torch.zeros(_B, _T, _H * 4)}, r"q and k must both be \[B, T, H, Dk\]"),
    ({"k": torch.zeros(_B, _T, _H, 5)}, r"q and k must both be"),
    ({"v": torch.zeros(_B, _T, _H + 1, 3)}, r"v must be \[B, T, H, Dv\]"),
    ({"g": torch.zeros(_B, _T, _H, 1)},
     r"g must be \[B, T, H\] = \[1, 20, 2\], got \[1, 20, 2, 1\]"),
    ({"beta": torch.zeros(_B, _T - 1, _H)}, r"beta must be \[B, T, H\]"),
    ({"initial_state": torch.zeros(_B, _H, 3, 4)},
     r"initial_state must be \[B, H, Dk, Dv\] = \[1, 2, 4, 3\], got \[1, 2, 3, 4\]"),
    ({"routes": torch.zeros(_B, 1, _H, 2)}, r"routes must have shape \[B=1, N=2, H, 2\]"),
    ({"routes": torch.zeros(_B, 2, _H, 1)}, r"routes must have shape"),
    ({"routes": torch.zeros(_B, 2, 1, 2)}, r"routes has 1 routing heads, expected 2"),
    ({"chunk_size": 8}, r"chunk_size must be one of \(16, 32, 64, 128, 256\), got 8"),
    ({"chunk_size": 100}, r"chunk_size must be one of .*, got 100"),
    ({"route_grad": "none"}, r"route_grad must be one of \('selected', 'both'\), got 'none'"),
], ids=["q-rank", "k-shape", "v-shape", "g-shape", "beta-shape", "state-shape",
        "routes-chunks", "routes-options", "routes-heads", "chunk-8", "chunk-100", "route-grad"])
def test_bad_input_names_the_problem(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ref.hybrid_gated_delta_rule(**{**_valid_args(), **changes})


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_public_op_on_cpu_is_the_reference(backend: str) -> None:
    args = _valid_args()
    torch.testing.assert_close(
        nk.hybrid_gated_delta_rule(**args, output_final_state=True, backend=backend),
        ref.hybrid_gated_delta_rule(**args, output_final_state=True), rtol=0, atol=0)


def test_public_op_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"backend must be one of .*, got 'bogus'"):
        nk.hybrid_gated_delta_rule(**_valid_args(), backend="bogus")
