"""The NAtS-L layer: routes, samplers, forced routes, cost term, causality, merge."""

import pytest
import torch
import torch.nn.functional as F

from nats.kernels import hybrid_gated_delta_rule, hybrid_softmax_attention
from nats.kernels.reference.norms import l2_norm, rms_norm
from nats.layers.routing import (
    check_override_covers,
    chunk_max_pool,
    chunk_mean_pool,
    chunk_pool,
    forced_routes,
)

from ..routes import sample_routes
from .models import rel_err, tiny_model


def nats_layer(**overrides):
    return tiny_model(("nats",), **overrides).nats_layers[0]


@pytest.mark.parametrize("softmax_qkv", ["shared", "own"])
def test_layer_matches_its_definition_written_out(softmax_qkv):
    """Recompute one layer from NATSL.md's formulas with the reference operators (with
    ``softmax_qkv="own"``, the softmax heads read the projection's second q, k, v)."""
    layer = nats_layer(softmax_qkv=softmax_qkv)
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    y, routing = layer(x)
    cfg = layer.cfg
    h, r, dk = cfg.n_heads, cfg.softmax_heads_per_head, cfg.head_dim_k
    proj = layer.qkv.proj(x)
    conv = F.conv1d(F.pad(proj.transpose(1, 2), (3, 0)), layer.qkv.conv.weight,
                    groups=proj.shape[-1])
    sizes = [h * dk, h * dk, h * cfg.head_dim_v] * (2 if softmax_qkv == "own" else 1)
    parts = F.silu(conv.transpose(1, 2)).split(sizes, -1)
    q, k, v = parts[:3]
    q_sm, k_sm, v_sm = parts[-3:]
    logits = layer.scorer.proj(torch.stack([x[:, i:i + 16].mean(1) for i in range(0, 45, 16)], 1))
    routes = F.one_hot(logits.view(2, 3, h, 2).argmax(-1), 2).double()
    assert torch.equal(routing.routes, routes)
    sm = lambda t: t.reshape(2, 45, h * r, -1)  # noqa: E731
    o_sm = hybrid_softmax_attention(layer.q_norm(sm(q_sm)), layer.k_norm(sm(k_sm)), sm(v_sm),
                                    routes, 16)
    lin = lambda t: t.reshape(2, 45, h, -1)  # noqa: E731
    a = -layer.gates.A_log.exp() * F.softplus(layer.gates.a_proj(x) + layer.gates.dt_bias)
    b = torch.sigmoid(layer.gates.b_proj(x))
    o_la, _ = hybrid_gated_delta_rule(l2_norm(lin(q)), l2_norm(lin(k)), lin(v), a, b, routes, 16)
    w = torch.softmax(layer.mix(q).view(2, 45, h * r, 2), -1)
    merged = (w[..., :1] * rms_norm(sm(o_la), eps=cfg.norm_eps)
              + w[..., 1:] * rms_norm(o_sm, eps=cfg.norm_eps))
    gate = F.silu(layer.out.gate(x)).view(2, 45, h * r, -1)
    expected = layer.out.out((merged * layer.out.gamma * gate).flatten(-2))
    assert rel_err(y, expected) < 1e-12


@pytest.mark.parametrize("pool", ["mean", "max", "mean_max"])
def test_routes_read_the_chunk_pool_written_out(pool):
    """``scorer_pool``: the scorer reads each chunk's mean or maximum per feature (both side
    by side under ``mean_max``), over the partial last chunk's own tokens."""
    layer = nats_layer(scorer_pool=pool)
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    chunks = [x[:, i:i + 16] for i in range(0, 45, 16)]
    pools = {"mean": lambda c: c.mean(1), "max": lambda c: c.amax(1),
             "mean_max": lambda c: torch.cat([c.mean(1), c.amax(1)], -1)}
    pooled = torch.stack([pools[pool](c) for c in chunks], 1)
    logits = layer.scorer.proj(pooled).view(2, 3, layer.cfg.n_heads, 2)
    routes = layer(x)[1].routes
    assert torch.equal(routes, F.one_hot(logits.argmax(-1), 2).double())
    assert 0 < routes.mean() < 1


@pytest.mark.parametrize("softmax_qkv", ["shared", "own"])
def test_own_softmax_qkv_gets_no_gradient_from_the_linear_branch(softmax_qkv, monkeypatch):
    """Backpropagated through the linear branch alone (the softmax output detached in the
    merge), the softmax branch's own projection rows stay at zero; shared, they do not."""
    layer = nats_layer(softmax_qkv=softmax_qkv)
    merge = type(layer)._merge
    monkeypatch.setattr(type(layer), "_merge",
                        lambda self, q, o_la, o_sm, x: merge(self, q, o_la, o_sm.detach(), x))
    layer(torch.randn(2, 45, 32, dtype=torch.float64))[0].square().sum().backward()
    grad = layer.qkv.proj.weight.grad
    rows = sum(layer.qkv.dims[:3])  # the linear branch's q, k, v (and the shared ones)
    assert grad[:rows].abs().max() > 0
    if softmax_qkv == "own":
        assert grad.shape[0] == 2 * rows and not grad[rows:].any()
        assert not layer.qkv.conv.weight.grad[rows:].any()
    else:
        assert grad.shape[0] == rows


def test_routes_are_one_hot_with_straight_through_gradient():
    layer = nats_layer().train()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    y, routing = layer(x)
    assert torch.equal(routing.routes.detach(), F.one_hot(routing.probs.argmax(-1), 2).double())
    assert routing.routes.requires_grad
    y.square().sum().backward()
    assert layer.scorer.proj.weight.grad.abs().sum() > 0  # the search learns through the route


def test_attn_frac_and_cost_regulariser():
    layer = nats_layer(reg_lambda=0.3)
    _, routing = layer(torch.randn(2, 64, 32, dtype=torch.float64))
    expected_frac = routing.routes[..., 0].mean((0, 1))
    assert torch.equal(routing.attn_frac, expected_frac)
    # The cost leaves out the last chunk, whose route no query sees.
    assert routing.reg.item() == pytest.approx(0.3 * routing.probs[:, :-1, :, 0].mean().item())


def test_gumbel_sampler_is_hard_random_in_training_and_argmax_in_eval():
    logits = torch.randn(4, 50, 3, 2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    sampled = sample_routes(logits, "gumbel", 1.0, training=True, generator=gen)
    assert torch.equal(sampled.detach().sum(-1), torch.ones(4, 50, 3, dtype=torch.float64))
    argmax = F.one_hot(logits.argmax(-1), 2).double()
    assert not torch.equal(sampled.detach(), argmax)  # 600 draws: some disagree with argmax
    assert torch.equal(sample_routes(logits, "gumbel", 1.0, training=False), argmax)


def test_gumbel_frequencies_follow_the_probabilities():
    logits = torch.tensor([[[[0.0, 1.0]]]], dtype=torch.float64).expand(20000, 1, 1, 2)
    gen = torch.Generator().manual_seed(0)
    frac_sm = sample_routes(logits, "gumbel", 1.0, True, gen)[..., 0].mean().item()
    assert frac_sm == pytest.approx(1 / (1 + torch.e), abs=0.01)


def test_forced_routes():
    routes = forced_routes(0.25, batch=2, first_chunk=0, n=8, heads=3, device="cpu")
    assert routes[0, :, 0, 0].tolist() == [0, 0, 0, 1, 0, 0, 0, 1]
    later = forced_routes(0.25, batch=2, first_chunk=5, n=3, heads=3, device="cpu")
    assert torch.equal(later, routes[:, 5:])  # depends on the chunk index only
    # A device scalar start (a captured decode step's) gives the same routes.
    assert torch.equal(forced_routes(0.25, 2, torch.tensor(5), 3, 3, "cpu"), later)
    assert forced_routes("softmax", 1, 0, 2, 1, "cpu")[..., 0].tolist() == [[[1.0], [1.0]]]
    assert forced_routes("linear", 1, 0, 2, 1, "cpu")[..., 1].tolist() == [[[1.0], [1.0]]]
    given = torch.tensor([[1, 0], [0, 1], [1, 1]])
    assert forced_routes(given, 2, 1, 2, 2, "cpu")[1, :, :, 0].tolist() == [[0, 1], [1, 1]]
    assert torch.equal(forced_routes(given, 2, torch.tensor(1), 2, 2, "cpu"),
                       forced_routes(given, 2, 1, 2, 2, "cpu"))
    for bad, msg in [("half", "one of"), (1.5, r"\[0, 1\]"), (torch.ones(2, 5), "H=2"),
                     (given, "covers 3 chunks")]:
        with pytest.raises(ValueError, match=msg):
            forced_routes(bad, 2, 0, 4, 2, "cpu")
    # What decoding checks on the host before a step a replayed graph cannot check.
    check_override_covers(given, 3)
    for bad, chunks, msg in [(given, 4, "covers 3 chunks"), (torch.ones(3), 1, r"\[N, H\]")]:
        with pytest.raises(ValueError, match=msg):
            check_override_covers(bad, chunks)


def test_forced_routes_reach_the_layer():
    layer = nats_layer()
    x = torch.randn(1, 64, 32, dtype=torch.float64)
    for override, frac in (("softmax", 1.0), ("linear", 0.0), (0.5, 0.5)):
        layer.route_override = override
        assert layer(x)[1].attn_frac.tolist() == [frac, frac]


@pytest.mark.parametrize("position", [3, 17, 20, 31])
def test_model_is_causal_also_within_a_chunk(position):
    model = tiny_model(("nats", "linear", "softmax"))
    ids = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(position))
    changed = ids.clone()
    changed[0, position] = (ids[0, position] + 1) % 50
    a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :position], b[:, :position])
    assert not torch.equal(a[:, position], b[:, position])


def test_chunk_mean_pool_partial_last_chunk():
    x = torch.arange(20, dtype=torch.float64).view(1, 20, 1)
    assert chunk_mean_pool(x, 16).flatten().tolist() == [7.5, 17.5]


def test_chunk_pools_by_hand():
    """Max per feature over each chunk, the partial last one over its tokens; ``mean_max``
    puts the mean first."""
    x = torch.tensor([[[1.0, -4.0], [3.0, -2.0], [-5.0, 7.0]]])  # [1, 3, 2], chunks of 2
    assert chunk_max_pool(x, 2).tolist() == [[[3.0, -2.0], [-5.0, 7.0]]]
    assert chunk_pool(x, 2, "mean_max").tolist() == [[[2.0, -3.0, 3.0, -2.0],
                                                      [-5.0, 7.0, -5.0, 7.0]]]
    assert torch.equal(chunk_pool(x, 2, "mean"), chunk_mean_pool(x, 2))


@pytest.mark.parametrize(("softmax_qkv", "linear_op", "fused"), [
    ("shared", "gated_deltanet", True), ("own", "gated_deltanet", False),
    ("shared", "linear_attention", False),  # raw q and k: nothing to share
])
def test_both_branches_norms_of_q_and_k_come_from_one_kernel(monkeypatch, softmax_qkv,
                                                              linear_op, fused):
    """Where both branches read the shared q and k, one ``qk_norms`` call makes
    the softmax heads' RMS norms and the linear heads' L2 norms, on the Triton kernels
    (interpreted without a GPU); output and every gradient equal the layer's two separate
    norms of each (``_shares_qk_norms`` off)."""
    from nats.layers import nats_attention

    calls = []
    real = nats_attention.qk_norms
    monkeypatch.setattr(nats_attention, "qk_norms",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer = tiny_model(("nats",), dtype=torch.float32, head_dim_k=32, head_dim_v=32,
                       backend="triton", softmax_qkv=softmax_qkv, linear_op=linear_op,
                       rope=True).nats_layers[0]
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(0))
    results = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(type(layer), "_shares_qk_norms", lambda self: False)
        layer.zero_grad()
        y = layer(x)[0]
        y.square().sum().backward()
        results.append((y, *(p.grad.clone() for p in layer.parameters() if p.grad is not None)))
    assert len(calls) == (1 if fused else 0)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
