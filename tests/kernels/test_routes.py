"""A layer's routes from its scorer's logits: the reference against the formulas written out
chunk by chunk, the Triton kernels against the float64 reference, forward and the logits'
gradient from every output.

Every sampler (argmax, exploration noise, hard Gumbel, forced routes given as a broadcast
view), with no budget and with one in evaluation and in training (where it adds to the
pending sums and centres the gradient), one chunk or many, a partial last chunk. Under the
interpreter on small shapes (one of more chunks than a program's block); on a GPU at a
model's (a training batch, a 128k prefill, one decoded chunk).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nats.kernels import chunk_routes
from nats.kernels.reference import routes as reference
from nats.kernels.reference.routes import RouteBudget

from .inputs import CUDA, DEVICE, check

pytestmark = pytest.mark.usefixtures("poison_outputs")

SAMPLERS = ("argmax", "noise", "gumbel", "forced")
BUDGETS = (None, "eval", "train")
EPS = 1e-5
TAU = 0.7


def inputs(batch: int, n: int, heads: int, sampler: str, budget: str | None, seed: int):
    """Logits, a budget's state, forced routes (a view broadcast over the batch) and noise,
    on the test device in float32."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, n, heads, 2, generator=gen) * 2
    state = None
    if budget is not None:
        state = RouteBudget(torch.randn(heads, generator=gen) * 0.5,
                            torch.randn(heads, generator=gen) * 0.3,
                            torch.rand(heads, generator=gen) * 2 + 0.5, EPS,
                            torch.zeros(1 + 2 * heads, dtype=torch.float64)
                            if budget == "train" else None)
    forced = noise = tau = None
    if sampler == "forced":
        choice = torch.randint(0, 2, (1, n, heads), generator=gen)
        forced = F.one_hot(choice, 2).float().to(DEVICE).expand(batch, -1, -1, -1)
    elif sampler in ("noise", "gumbel"):
        u = torch.rand(logits.shape, generator=gen).clamp(1e-10, 1 - 1e-7)
        noise = (-torch.log(-torch.log(u))).to(DEVICE)
        tau = TAU if sampler == "gumbel" else None
    if state is not None:
        state = RouteBudget(*(t.to(DEVICE) if t is not None else None for t in state[:3]),
                            EPS, None if state.pending is None else state.pending.to(DEVICE))
    return logits.to(DEVICE), state, forced, noise, tau


def as_double(budget: RouteBudget | None) -> RouteBudget | None:
    if budget is None:
        return None
    pending = None if budget.pending is None else budget.pending.clone()
    return RouteBudget(budget.bias.double(), budget.running_mean.double(),
                       budget.running_var.double(), budget.eps, pending)


def margin(decided: reference.ChunkRoutes, noise: torch.Tensor | None,
           tau: float | None) -> float:
    """How far the reference's closest decision is from a tie (the two sides round
    differently, so a test needs every decision clear of one)."""
    p = decided.probs
    if noise is None:
        return (p[..., 0] - p[..., 1]).abs().min().item()
    scores = torch.log(p) + noise.double()  # the scores up to a constant per chunk
    if tau is not None:
        return (F.softmax(scores / tau, -1).diff(dim=-1)).abs().min().item()
    return (scores[..., 0] - scores[..., 1]).abs().min().item()


def compare(batch: int, n: int, heads: int, seq_len: int, chunk: int, sampler: str,
            budget_kind: str | None, grad_from: str, tol: float, seed: int = 0) -> None:
    logits, budget, forced, noise, tau = inputs(batch, n, heads, sampler, budget_kind, seed)
    tri = logits.clone().requires_grad_()
    ref = logits.double().requires_grad_()
    budget_ref = as_double(budget)
    got = chunk_routes(tri, seq_len, chunk, budget=budget, forced=forced, noise=noise, tau=tau,
                       backend="triton")
    want = reference.chunk_routes(ref, seq_len, chunk, budget_ref, forced,
                                  None if noise is None else noise.double(), tau)
    if forced is None:
        assert margin(want, noise, tau) > 1e-6, "the inputs hold a near-tie"
        assert got.routes.dtype == torch.float32 and got.routes.requires_grad
        assert torch.equal(got.routes.detach(), want.routes.detach().float())
    else:
        assert got.routes is forced
    check(got.probs, want.probs, tol, "probs")
    check(got.reg, want.reg, tol, "reg")
    check(got.attn_frac, want.attn_frac.float(), tol, "attn_frac")
    if n == 1:
        assert math.isnan(got.routable_frac.item()) and got.reg.item() == 0
    else:
        check(got.routable_frac, want.routable_frac, tol, "routable_frac")
    if budget is not None and budget.pending is not None:
        check(budget.pending, budget_ref.pending, tol, "pending sums")
        assert budget.pending[0].item() == budget_ref.pending[0].item()
    gen = torch.Generator().manual_seed(seed + 1)
    outputs = {"routes": (got.routes, want.routes), "probs": (got.probs, want.probs),
               "reg": (got.reg, want.reg)}
    chosen = list(outputs) if grad_from == "all" else [grad_from]
    # Forced routes have no gradient, nor has the cost term of one chunk (no routable one).
    chosen = [name for name in chosen if not (name == "routes" and forced is not None)
              and not (name == "reg" and n == 1)]
    if not chosen:
        return
    cotangents = [torch.randn(outputs[name][1].shape, generator=gen, dtype=torch.float64)
                  .to(DEVICE) for name in chosen]
    d_tri, = torch.autograd.grad([outputs[name][0] for name in chosen], tri,
                                 [c.float() for c in cotangents])
    d_ref, = torch.autograd.grad([outputs[name][1] for name in chosen], ref, cotangents)
    assert d_tri.dtype == torch.float32
    check(d_tri, d_ref, tol, f"dlogits from {chosen}")


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs its own")
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize(("batch", "n", "heads", "seq_len", "chunk"),
                         [(2, 5, 3, 73, 16), (1, 1, 4, 10, 16), (3, 700, 2, 700 * 16, 16)])
def test_matches_reference_interpreted(batch: int, n: int, heads: int, seq_len: int,
                                       chunk: int, sampler: str, budget: str | None) -> None:
    compare(batch, n, heads, seq_len, chunk, sampler, budget, "all", 1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs its own")
@pytest.mark.parametrize("grad_from", ["routes", "probs", "reg"])
@pytest.mark.parametrize("sampler", ["argmax", "gumbel", "forced"])
def test_each_output_alone_sends_its_gradient(sampler: str, grad_from: str) -> None:
    compare(2, 6, 3, 96, 16, sampler, "train", grad_from, 1e-5, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize(("batch", "n", "heads", "seq_len", "chunk"),
                         [(4, 64, 6, 4096, 64), (1, 2048, 6, 131072, 64),
                          (16, 32, 8, 2000, 64), (1, 1, 6, 64, 64)])
def test_matches_reference_on_gpu(batch: int, n: int, heads: int, seq_len: int, chunk: int,
                                  sampler: str, budget: str | None) -> None:
    compare(batch, n, heads, seq_len, chunk, sampler, budget, "all", 1e-5, seed=n)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_from", ["routes", "probs", "reg"])
def test_each_output_alone_sends_its_gradient_on_gpu(grad_from: str) -> None:
    compare(4, 64, 6, 4096, 64, "argmax", "train", grad_from, 1e-5, seed=5)


def test_reference_statistics_written_out() -> None:
    """The token-weighted fraction (a partial last chunk by its tokens), the routable share
    and the cost term, chunk by chunk, from routes forced to known choices."""
    choice = torch.tensor([[[1, 0], [0, 0], [1, 1]], [[0, 1], [1, 1], [0, 0]]])  # [B, N, H]
    forced = torch.stack([choice, 1 - choice], -1).double()
    logits = torch.randn(2, 3, 2, 2, dtype=torch.float64)
    seq_len, chunk = 2 * 16 + 5, 16  # the last chunk holds 5 tokens
    out = reference.chunk_routes(logits, seq_len, chunk, forced=forced)
    tokens = [16, 16, 5]
    for h in range(2):
        sm = sum(tokens[n] * choice[b, n, h].item() for b in range(2) for n in range(3))
        assert out.attn_frac[h].item() == pytest.approx(sm / (2 * seq_len))
    assert out.routable_frac.item() == pytest.approx(choice[:, :2].float().mean().item())
    probs = F.softmax(logits, -1)
    assert out.reg.item() == pytest.approx(probs[:, :2, :, 0].mean().item())
    assert torch.equal(out.probs, probs) and out.routes is forced


@pytest.mark.parametrize(("call", "message"), [
    (lambda x: chunk_routes(x[..., :1], 48, 16), r"logits \[B, N, H, 2\]"),
    (lambda x: chunk_routes(x, 80, 16), "routes cover 3 chunks; 80 tokens"),
    (lambda x: chunk_routes(x, 48, 16, noise=x[:1]), "noise of the logits' shape"),
    (lambda x: chunk_routes(x, 48, 16, budget=RouteBudget(*(torch.zeros(3),) * 3, EPS, None)),
     r"a budget of \[2\]"),
])
def test_one_line_errors_for_mismatched_inputs(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(2, 3, 2, 2))
