"""The softmax branch of NAtS-L (plain PyTorch reference) held to NATSL.md.

A query in chunk ``c`` attends to the keys of every earlier chunk routed to softmax and
to the keys ``j <= i`` of its own chunk; softmax heads ``h*r .. h*r+r-1`` share the
route of routing head ``h``. Each test compares against a computation that does not go
through the chunked reference: the token-by-token oracle, PyTorch's
``scaled_dot_product_attention``, or numbers worked out by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import nats.kernels as nk
from nats.kernels import LINEAR, SOFTMAX, num_chunks
from nats.kernels import reference as ref

from .inputs import (
    F64,
    ORACLE_CASES,
    ROUTE_KINDS,
    grads,
    make_routes,
    rel_rms_error,
    softmax_inputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, HEADS, PER_HEAD, DIM = 2, 2, 2, 8
"""Batch, routing heads, softmax heads per routing head, head width."""
GRAD_NAMES = ("q", "k", "v", "routes")


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
    """Causal attention by PyTorch's own kernel, in the ``[B, T, H, D]`` layout."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


def requires_grad(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.detach().clone().requires_grad_() for x in xs)


# --- against the token-by-token oracle ----------------------------------------------------


@pytest.mark.parametrize("kind", ROUTE_KINDS)
@pytest.mark.parametrize(("seq_len", "chunk_size"), ORACLE_CASES)
def test_matches_oracle_float64(seq_len: int, chunk_size: int, kind: str) -> None:
    q, k, v = softmax_inputs(BATCH, seq_len, HEADS * PER_HEAD, DIM, seed=seq_len)
    routes = make_routes(BATCH, seq_len, chunk_size, HEADS, kind, seed=chunk_size)
    inputs = requires_grad(q, k, v, routes)

    out = ref.hybrid_softmax_attention(*inputs, chunk_size, route_grad="both")
    expected = ref.hybrid_softmax_attention_recurrent(*inputs, chunk_size)

    torch.testing.assert_close(out, expected, **F64)
    for name, got, want in zip(GRAD_NAMES, grads((out,), inputs),
                               grads((expected,), inputs), strict=True):
        torch.testing.assert_close(got, want, **F64, msg=f"gradient of {name}")


@pytest.mark.parametrize(("seq_len", "chunk_size"), [(70, 16), (130, 64), (37, 256)])
def test_matches_oracle_float32(seq_len: int, chunk_size: int) -> None:
    """float32 inputs compute in float32 and stay close to the float64 oracle."""
    q, k, v = softmax_inputs(BATCH, seq_len, HEADS * PER_HEAD, DIM, seed=seq_len)
    routes = make_routes(BATCH, seq_len, chunk_size, HEADS, "random", seed=chunk_size)
    inputs32 = requires_grad(*(x.float() for x in (q, k, v, routes)))
    inputs64 = requires_grad(q, k, v, routes)

    out = ref.hybrid_softmax_attention(*inputs32, chunk_size, route_grad="both")
    expected = ref.hybrid_softmax_attention_recurrent(*inputs64, chunk_size)

    assert out.dtype == torch.float32
    assert rel_rms_error(out, expected) < 1e-6
    for name, got, want in zip(GRAD_NAMES, grads((out,), inputs32),
                               grads((expected,), inputs64), strict=True):
        assert rel_rms_error(got, want) < 1e-5, f"gradient of {name}"


def test_selected_route_grad_is_both_times_one_hot() -> None:
    """Default ``route_grad="selected"``: the "both" gradient at the chosen option only.

    The softmax operator never gives a gradient to the linear option's column.
    """
    seq_len, chunk_size = 70, 16
    q, k, v = softmax_inputs(BATCH, seq_len, HEADS * PER_HEAD, DIM)
    routes = make_routes(BATCH, seq_len, chunk_size, HEADS, "random")
    inputs = requires_grad(q, k, v, routes)

    out_both = ref.hybrid_softmax_attention(*inputs, chunk_size, route_grad="both")
    out_selected = ref.hybrid_softmax_attention(*inputs, chunk_size)
    *qkv_both, routes_both = grads((out_both,), inputs)
    *qkv_selected, routes_selected = grads((out_selected,), inputs)

    torch.testing.assert_close(out_selected, out_both, rtol=0, atol=0)
    for got, want in zip(qkv_selected, qkv_both, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(routes_selected, routes_both * routes, rtol=0, atol=0)
    assert not routes_both[..., LINEAR].any()
    # Not vacuous: "both" does give the unselected softmax option (earlier chunks) a gradient.
    unselected = routes[:, :-1, :, SOFTMAX] == 0
    assert unselected.any() and routes_both[:, :-1, :, SOFTMAX][unselected].abs().min() > 0


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_gradcheck(kind: str) -> None:
    """Finite differences in float64, routes included (the function is smooth in them).

    Routing chunk 0 to softmax, then to linear, checks the route derivative at 1 and 0.
    """
    seq_len, chunk_size = 17, 16
    q, k, v = softmax_inputs(1, seq_len, PER_HEAD, 2)
    routes = make_routes(1, seq_len, chunk_size, 1, kind)

    def fn(*args: torch.Tensor) -> torch.Tensor:
        return ref.hybrid_softmax_attention(*args, chunk_size, route_grad="both")

    assert torch.autograd.gradcheck(fn, requires_grad(q, k, v, routes))


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("impl", [ref.causal_softmax_attention,
                                  ref.causal_softmax_attention_recurrent])
def test_causal_baselines_match_sdpa(impl: Callable[..., torch.Tensor],
                                     scale: float | None) -> None:
    q, k, v = softmax_inputs(BATCH, 37, HEADS, DIM)
    inputs = requires_grad(q, k, v)
    out, expected = impl(*inputs, scale), sdpa_causal(*inputs, scale)

    torch.testing.assert_close(out, expected, **F64)
    for got, want in zip(grads((out,), inputs), grads((expected,), inputs), strict=True):
        torch.testing.assert_close(got, want, **F64)


# --- degenerate cases and hand-computed values -------------------------------------------


@pytest.mark.parametrize(("chunk_size", "scale"), [(16, None), (32, 0.3)])
@pytest.mark.parametrize("impl", [ref.hybrid_softmax_attention,
                                  ref.hybrid_softmax_attention_recurrent])
def test_all_softmax_is_causal_and_all_linear_is_block_diagonal(
        impl: Callable[..., torch.Tensor], chunk_size: int, scale: float | None) -> None:
    """Routing head 0 sends every chunk to softmax, routing head 1 every chunk to linear.

    Softmax heads of head 0 (``0 .. r-1``) then see full causal attention, those of head
    1 (``r .. 2r-1``) causal attention within each chunk only.
    """
    seq_len = 70
    q, k, v = softmax_inputs(BATCH, seq_len, HEADS * PER_HEAD, DIM)
    routes = torch.cat([make_routes(BATCH, seq_len, chunk_size, 1, "softmax"),
                        make_routes(BATCH, seq_len, chunk_size, 1, "linear")], dim=2)

    out = impl(q, k, v, routes, chunk_size, scale)

    sm, la = slice(0, PER_HEAD), slice(PER_HEAD, 2 * PER_HEAD)
    torch.testing.assert_close(
        out[:, :, sm], sdpa_causal(q[:, :, sm], k[:, :, sm], v[:, :, sm], scale), **F64)
    for start in range(0, seq_len, chunk_size):
        t = slice(start, start + chunk_size)
        torch.testing.assert_close(
            out[:, t, la], sdpa_causal(q[:, t, la], k[:, t, la], v[:, t, la], scale), **F64)


def test_hand_computed_single_chunk() -> None:
    """T = 3, one head of width 1 (default scale 1): softmax weights written out."""
    q = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).view(1, 3, 1, 1)
    k = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64).view(1, 3, 1, 1)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).view(1, 3, 1, 1)
    routes = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    e = math.exp
    expected = [
        1.0,  # the first query sees only itself
        (e(1) * 1 + e(-1) * 2) / (e(1) + e(-1)),  # scores 1*1, 1*(-1)
        (e(2) * 1 + e(-2) * 2 + e(1) * 3) / (e(2) + e(-2) + e(1)),  # scores 2*1, 2*(-1), 2*0.5
    ]

    out = ref.hybrid_softmax_attention(q, k, v, routes, 16)

    torch.testing.assert_close(out.flatten(), torch.tensor(expected, dtype=torch.float64), **F64)


@pytest.mark.parametrize(("chunk0", "last_output"), [(SOFTMAX, sum(range(17)) / 17),
                                                     (LINEAR, 16.0)])
def test_hand_computed_route(chunk0: int, last_output: float) -> None:
    """T = 17, chunk 16, all keys zero: every visible key weighs the same.

    With ``v_j = j``, token ``i < 16`` averages ``0 .. i``, i.e. ``i / 2``. Token 16 averages
    ``0 .. 16`` (= 8) if chunk 0 went to softmax, and sees only itself (16) if not.
    """
    q = torch.ones(1, 17, 1, 1, dtype=torch.float64)
    k = torch.zeros_like(q)
    v = torch.arange(17, dtype=torch.float64).view(1, 17, 1, 1)
    routes = torch.zeros(1, 2, 1, 2, dtype=torch.float64)
    routes[0, 0, 0, chunk0] = 1
    routes[0, 1, 0, SOFTMAX] = 1

    out = ref.hybrid_softmax_attention(q, k, v, routes, 16).flatten()

    expected = torch.tensor([i / 2 for i in range(16)] + [last_output], dtype=torch.float64)
    torch.testing.assert_close(out, expected, **F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("impl", [ref.hybrid_softmax_attention,
                                  ref.hybrid_softmax_attention_recurrent])
def test_linear_chunk_stays_invisible_however_large_its_scores(
        impl: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
    """A chunk routed to linear adds nothing to later queries, even where ``exp(score)``
    would overflow: decoding never holds its keys, so ``0 * exp(huge)`` must not turn
    into NaN. Chunk 0 (linear) has keys that score 2000 against the queries of chunk 1.
    """
    seq_len, chunk_size = 20, 16
    q, k, v = softmax_inputs(1, seq_len, 1, 4, dtype=dtype)
    q[:, :chunk_size], q[:, chunk_size:] = 0.0, 1.0
    k[:, :chunk_size] = 1000.0
    routes = make_routes(1, seq_len, chunk_size, 1, "linear", dtype=dtype)
    q, k, v = requires_grad(q, k, v)

    out = impl(q, k, v, routes, chunk_size)

    own_chunk = [sdpa_causal(q[:, t], k[:, t], v[:, t])
                 for t in (slice(0, chunk_size), slice(chunk_size, seq_len))]
    expected = torch.cat(own_chunk, 1)
    # float32 gradients carry rounding of the size-1000 keys: absolute 1e-3 is 1e-6 of them.
    tol = F64 if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-3}
    torch.testing.assert_close(out, expected, **tol)
    for got, want in zip(grads((out,), (q, k, v)), grads((expected,), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, **tol)


# --- causality ---------------------------------------------------------------------------

CAUSAL_T, CAUSAL_CHUNK = 40, 16


@pytest.mark.parametrize("j", [5, 20, 39], ids=lambda j: f"token{j}")
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_later_token_leaves_earlier_outputs(name: str, j: int) -> None:
    """Perturbing token ``j`` (also inside the chunk of earlier tokens) changes no output < j."""
    inputs = dict(zip("qkv", softmax_inputs(BATCH, CAUSAL_T, HEADS * PER_HEAD, DIM), strict=True))
    routes = make_routes(BATCH, CAUSAL_T, CAUSAL_CHUNK, HEADS, "random")
    out = ref.hybrid_softmax_attention(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK)

    inputs[name] = inputs[name].clone()
    inputs[name][:, j] += torch.randn(inputs[name][:, j].shape, dtype=torch.float64,
                                      generator=torch.Generator().manual_seed(j))
    perturbed = ref.hybrid_softmax_attention(**inputs, routes=routes, chunk_size=CAUSAL_CHUNK)

    torch.testing.assert_close(perturbed[:, :j], out[:, :j], rtol=0, atol=1e-13)
    assert not torch.allclose(perturbed[:, j], out[:, j])


@pytest.mark.parametrize("chunk", range(num_chunks(CAUSAL_T, CAUSAL_CHUNK)))
def test_route_changes_only_later_chunks(chunk: int) -> None:
    """Flipping the route of chunk ``c`` changes outputs in chunks after ``c`` and no other."""
    q, k, v = softmax_inputs(BATCH, CAUSAL_T, HEADS * PER_HEAD, DIM)
    routes = make_routes(BATCH, CAUSAL_T, CAUSAL_CHUNK, HEADS, "random")
    flipped = routes.clone()
    flipped[:, chunk] = routes[:, chunk].flip(-1)

    out = ref.hybrid_softmax_attention(q, k, v, routes, CAUSAL_CHUNK)
    out_flipped = ref.hybrid_softmax_attention(q, k, v, flipped, CAUSAL_CHUNK)

    end = min((chunk + 1) * CAUSAL_CHUNK, CAUSAL_T)
    torch.testing.assert_close(out_flipped[:, :end], out[:, :end], rtol=0, atol=0)
    if end < CAUSAL_T:
        assert not torch.allclose(out_flipped[:, end:], out[:, end:])


# --- input checks and the public dispatch ------------------------------------------------

_T, _C = 20, 16


def _valid_args() -> dict[str, object]:
    q, k, v = softmax_inputs(1, _T, PER_HEAD * 2, 4)
    return {"q": q, "k": k, "v": v, "routes": make_routes(1, _T, _C, 2, "random"),
            "chunk_size": _C}


@pytest.mark.parametrize(("changes", "match"), [
    ({"q": torch.zeros(1, _T, 4)}, r"q and k must both be \[B, T, heads, Dk\]"),
    ({"k": torch.zeros(1, _T, 4, 5)}, r"q and k must both be"),
    ({"v": torch.zeros(1, _T + 1, 4, 4)}, r"v must be \[B, T, heads, Dv\]"),
    ({"routes": torch.zeros(1, 3, 2, 2)}, r"routes must have shape \[B=1, N=2, H, 2\]"),
    ({"routes": torch.zeros(1, 2, 2, 3)}, r"routes must have shape"),
    ({"routes": torch.zeros(1, 2, 3, 2)}, r"4 heads, not a multiple of the 3 routing heads"),
    ({"chunk_size": 48}, r"chunk_size must be one of \(16, 32, 64, 128, 256\), got 48"),
    ({"chunk_size": 512}, r"chunk_size must be one of .*, got 512"),
    ({"route_grad": "all"}, r"route_grad must be one of \('selected', 'both'\), got 'all'"),
], ids=["q-rank", "k-shape", "v-shape", "routes-chunks", "routes-options", "heads",
        "chunk-48", "chunk-512", "route-grad"])
def test_bad_input_names_the_problem(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ref.hybrid_softmax_attention(**{**_valid_args(), **changes})


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_public_op_on_cpu_is_the_reference(backend: str) -> None:
    args = _valid_args()
    torch.testing.assert_close(nk.hybrid_softmax_attention(**args, backend=backend),
                               ref.hybrid_softmax_attention(**args), rtol=0, atol=0)


def test_public_op_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"backend must be one of .*, got 'bogus'"):
        nk.hybrid_softmax_attention(**_valid_args(), backend="bogus")
