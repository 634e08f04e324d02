"""How the router is trained: route gradients, the budgeted scores, exploration, the gate.

Each choice is a config field; these tests hold each one to what its docstring says,
against values worked out independently here.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from nats import ConfigError, NatsConfig, NatsForCausalLM
from nats.layers.nats_attention import NatsAttention
from nats.layers.routing import BudgetedScores, RunningMoments

from ..routes import sample_routes
from .models import tiny_model


def nats_layer(**overrides):
    return tiny_model(("nats",), **overrides).nats_layers[0]


@pytest.mark.parametrize(("changes", "message"), [
    ({"route_grad": "all"}, r"NatsConfig\.route_grad = 'all' .*one of \('selected', 'both'\)"),
    ({"scorer_init": "ones"}, r"NatsConfig\.scorer_init .*one of \('normal', 'zero'\)"),
    ({"budget_scope": "head"}, r"NatsConfig\.budget_scope .*one of \('layer', 'model'\)"),
    ({"output_gate": "sigmoid"}, r"NatsConfig\.output_gate .*one of \('silu', 'none'\)"),
    ({"scorer_norm": 1}, r"NatsConfig\.scorer_norm = 1 .*true or false"),
    ({"scorer_detach": "yes"}, r"NatsConfig\.scorer_detach = 'yes' .*true or false"),
    ({"softmax_target": 1.0}, r"NatsConfig\.softmax_target = 1\.0 .*in \(0, 1\)"),
    ({"softmax_target": 0}, r"NatsConfig\.softmax_target = 0 .*in \(0, 1\)"),
    ({"softmax_target": "0.2"}, r"NatsConfig\.softmax_target = '0\.2' .*in \(0, 1\)"),
])
def test_recipe_fields_are_validated(changes, message):
    with pytest.raises(ConfigError, match=message):
        NatsConfig(**changes)


@pytest.mark.parametrize("route_grad", ["selected", "both"])
def test_route_gradient_reaches_the_unselected_option_only_when_asked(route_grad):
    """The override's routes are recomputed as a leaf so that their gradient can be read."""
    layer = nats_layer(route_grad=route_grad).train()
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    given = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]])
    routes = F.one_hot((given[None] <= 0.5).long(), 2).double().expand(2, -1, -1, -1).clone()
    routes.requires_grad_()
    layer.route_override = routes
    y, _ = layer(x)
    y.square().sum().backward()
    chosen = routes.detach() > 0.5
    assert routes.grad[chosen].abs().sum() > 0
    unchosen = routes.grad[~chosen]
    # Chunk 3 is every sequence's last: no query after it sees its route either way.
    if route_grad == "both":
        assert unchosen.view(2, 4, 2)[:, :3].abs().min() > 0
    else:
        assert torch.equal(unchosen, torch.zeros_like(unchosen))


@pytest.mark.parametrize("detach", [True, False])
def test_the_route_gradient_reaches_the_layer_input_only_without_detach(detach):
    """Against the same layer with its own routes forced as constants: no route gradient
    can flow then, so a detached scorer's input gradient must equal it exactly."""
    layer = nats_layer(scorer_detach=detach, scorer_norm=False, softmax_target=None).train()
    x = torch.randn(2, 64, 32, dtype=torch.float64, requires_grad=True)
    y, routing = layer(x)
    y.square().sum().backward()
    through_scorer, scorer_grad = x.grad.clone(), layer.scorer.proj.weight.grad.clone()
    assert scorer_grad.abs().sum() > 0  # the scorer learns either way
    x.grad = None
    layer.route_override = routing.routes.detach()
    y_forced, _ = layer(x)
    assert torch.equal(y_forced, y)
    y_forced.square().sum().backward()
    if detach:
        assert torch.equal(x.grad, through_scorer)
    else:
        assert not torch.allclose(x.grad, through_scorer)


def test_zero_scorer_init_starts_every_chunk_undecided():
    model = NatsForCausalLM(NatsConfig(scorer_init="zero"))
    for layer in model.nats_layers:
        assert torch.equal(layer.scorer.proj.weight, torch.zeros_like(layer.scorer.proj.weight))
    other = NatsForCausalLM(NatsConfig(scorer_init="normal"))
    assert other.nats_layers[0].scorer.proj.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_scorer_norm_standardises_pooled_inputs_with_statistics_committed_per_step():
    layer = nats_layer(scorer_norm=True).train()
    moments = layer.scorer.moments
    pooled = 7.0 + 3.0 * torch.randn(4, 5, 32, dtype=torch.float64)
    before = layer.scorer(pooled)  # running (0, 1): the raw input, and only counted
    assert torch.allclose(before, layer.scorer.proj(pooled).view(4, 5, 2, 2))
    layer.scorer(pooled[:2])  # a second micro-batch of the same step
    moments.commit()
    routable = pooled[:, :-1].reshape(-1, 32)  # the first call's rows, then the second's
    rows = torch.cat([routable, pooled[:2, :-1].reshape(-1, 32)])
    assert torch.allclose(moments.running_mean, 0.1 * rows.mean(0))
    assert torch.allclose(moments.running_var, 0.9 + 0.1 * rows.var(0, unbiased=False))
    for _ in range(200):  # the running values converge: a shared offset and scale vanish
        layer.scorer(pooled)
        moments.commit()
    layer.eval()
    x = (pooled - routable.mean(0)) / torch.sqrt(routable.var(0, unbiased=False) + 1e-5)
    assert torch.allclose(layer.scorer(pooled), layer.scorer.proj(x).view(4, 5, 2, 2),
                          atol=1e-6)


def test_commit_sums_micro_batches_and_processes_like_one_batch():
    whole, parts = RunningMoments(3).double(), RunningMoments(3).double()
    x = torch.randn(10, 3, dtype=torch.float64)
    whole.accumulate(x)
    whole.commit()
    parts.accumulate(x[:4])
    parts.accumulate(x[4:])
    parts.commit(reduce=lambda sums: sums)  # one process: the sum over processes is itself
    assert torch.allclose(whole.running_mean, parts.running_mean)
    assert torch.allclose(whole.running_var, parts.running_var)
    parts.commit()  # nothing pending: unchanged
    assert torch.allclose(whole.running_var, parts.running_var)


def test_warm_started_moments_average_the_first_commits_then_move_by_momentum():
    warm, cold = RunningMoments(2, warm_start=True).double(), RunningMoments(2).double()
    batches = [torch.randn(6, 2, dtype=torch.float64) + i for i in range(12)]
    for moments in (warm, cold):
        moments.accumulate(batches[0])
        moments.commit()
    assert torch.allclose(warm.running_mean, batches[0].mean(0))  # the data's, from step 1
    assert torch.allclose(cold.running_mean, 0.1 * batches[0].mean(0))  # 0.9 of the zeros
    for batch in batches[1:10]:
        warm.accumulate(batch)
        warm.commit()
    means = torch.stack([b.mean(0) for b in batches[:10]])
    assert torch.allclose(warm.running_mean, means.mean(0))  # equal weights up to 1/momentum
    warm.accumulate(batches[10])
    warm.commit()
    assert torch.allclose(warm.running_mean, 0.9 * means.mean(0) + 0.1 * batches[10].mean(0))


def test_moments_keep_one_pending_tensor_and_an_empty_commit_changes_nothing():
    # A CUDA-graphed step replays into the memory it captured: accumulate and commit must
    # update the pending sums in place, and decide "nothing seen" without the host.
    for warm_start in (False, True):
        moments = RunningMoments(2, warm_start=warm_start).double()
        moments.accumulate(torch.zeros(0, 2, dtype=torch.float64))  # no routable rows
        pending = moments.pending
        before = [b.clone() for b in moments.buffers()]
        moments.commit()
        assert all(torch.equal(a, b) for a, b in zip(before, moments.buffers(), strict=True))
        x = torch.randn(7, 2, dtype=torch.float64)
        moments.accumulate(x[:3])
        moments.accumulate(x[3:])
        assert moments.pending is pending
        assert torch.allclose(moments.pending, torch.cat([torch.tensor([7.0], dtype=x.dtype),
                                                          x.sum(0), x.square().sum(0)]))
        moments.commit()
        assert moments.pending is pending and not pending.any()
        expected = x.mean(0) if warm_start else 0.1 * x.mean(0)
        assert torch.allclose(moments.running_mean, expected)
    # Sums not yet committed follow the statistic to another device.
    moments.accumulate(x)
    moments.to("meta").commit()
    assert moments.pending.device.type == "meta"


def test_budgeted_scores_standardise_with_running_statistics_per_head():
    scores = BudgetedScores(n_heads=3, target=0.25).double().train()
    spread = torch.tensor([1.0, 5.0, 0.1], dtype=torch.float64)[:, None]  # per head
    logits = torch.randn(8, 6, 3, 2, dtype=torch.float64) * spread
    exact = math.sqrt(2) * torch.erfinv(torch.tensor(-0.5, dtype=torch.float64))  # Phi^-1(.25)
    assert float(scores.route_bias.unique()) == pytest.approx(float(exact), abs=1e-7)
    bias = scores.route_bias  # a float32 buffer, then cast with the module
    d = logits[..., 0] - logits[..., 1]
    assert torch.allclose(scores(logits)[..., 0], d / math.sqrt(1 + 1e-5) + bias)
    scores.moments.commit()
    routable = d[:, :-1].flatten(0, 1)  # the last chunk has no route that matters
    mean, var = 0.1 * routable.mean(0), 0.9 + 0.1 * routable.var(0, unbiased=False)
    out = scores(logits)
    z = (d - mean) / torch.sqrt(var + 1e-5)
    assert torch.allclose(out[..., 0], z + bias) and torch.equal(out[..., 1], torch.zeros_like(z))
    scores.eval()  # evaluation and decoding: the same statistics, any number of chunks
    assert torch.allclose(scores(logits[:, :1])[..., 0], z[:, :1] + bias)


def test_budgeted_scores_centre_the_gradient_of_a_training_batch():
    """A push that every routable chunk of a head shares cancels in the scorer's gradient."""
    scores = BudgetedScores(n_heads=2, target=0.25).double().train()
    logits = torch.randn(4, 5, 2, 2, dtype=torch.float64, requires_grad=True)
    scores(logits)[:, :-1, :, 0].sum().backward()
    assert torch.allclose(logits.grad[:, :-1].sum((0, 1)), torch.zeros(2, 2, dtype=torch.float64),
                          atol=1e-12)
    logits.grad = None
    scores.eval()
    scores(logits)[:, :-1, :, 0].sum().backward()  # outside training: the plain gradient
    assert torch.allclose(logits.grad[:, :-1, :, 0], torch.full((4, 4, 2), (1 + 1e-5) ** -0.5,
                                                                 dtype=torch.float64))


def test_budgeted_layer_saves_and_restores_its_budget_state(tmp_path):
    model = NatsForCausalLM(NatsConfig(softmax_target=0.3))
    with torch.no_grad():
        model.nats_layers[1].budget.route_bias.fill_(0.7)
        model.nats_layers[0].budget.moments.running_var.fill_(2.0)
        model.nats_layers[0].scorer.moments.running_mean.fill_(0.5)
    model.save_pretrained(tmp_path)
    loaded = NatsForCausalLM.from_pretrained(tmp_path)
    assert float(loaded.nats_layers[1].budget.route_bias.unique()) == pytest.approx(0.7)
    assert torch.equal(loaded.nats_layers[0].budget.moments.running_var, torch.full((2,), 2.0))
    assert torch.equal(loaded.nats_layers[0].scorer.moments.running_mean,
                       torch.full((128,), 0.5))


def test_exploration_noise_draws_routes_with_the_scorer_probabilities():
    logits = torch.tensor([[[[0.0, 1.0]]]], dtype=torch.float64).expand(20000, 1, 1, 2)
    gen = torch.Generator().manual_seed(0)
    explored = sample_routes(logits, "argmax", 1.0, True, gen, noise=1.0)
    assert explored[..., 0].mean().item() == pytest.approx(1 / (1 + math.e), abs=0.01)
    # The value is one-hot, the gradient that of the noiseless probabilities.
    logits = logits.clone().requires_grad_()
    sample_routes(logits, "argmax", 1.0, True, gen, noise=1.0)[..., 0].sum().backward()
    p = 1 / (1 + math.e)
    assert logits.grad[0, 0, 0].tolist() == pytest.approx([p * (1 - p), -p * (1 - p)])
    quiet = sample_routes(logits.detach(), "argmax", 1.0, True, gen, noise=0.0)
    assert torch.equal(quiet[..., 1], torch.ones(20000, 1, 1, dtype=torch.float64))
    noisy_eval = sample_routes(logits.detach(), "argmax", 1.0, False, gen, noise=1.0)
    assert torch.equal(noisy_eval, quiet)  # no exploration outside training


def test_no_output_gate_is_the_normalised_merge_times_gamma():
    layer = nats_layer(output_gate="none")
    assert not hasattr(layer.out, "gate")
    y = torch.randn(2, 9, layer.out.heads, layer.out.head_dim, dtype=torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        layer.out.gamma.uniform_(0.5, 2)
    expected = layer.out.out((y * layer.out.gamma).flatten(-2))
    assert torch.equal(layer.out(y, x), expected)


def test_cost_term_and_routable_share_leave_out_the_last_chunk():
    layer = nats_layer(reg_lambda=0.3).train()
    _, routing = layer(torch.randn(2, 70, 32, dtype=torch.float64))  # 5 chunks, the last partial
    assert routing.reg.item() == pytest.approx(0.3 * routing.probs[:, :4, :, 0].mean().item())
    assert routing.routable_frac.item() == pytest.approx(
        routing.routes[:, :4, :, 0].mean().item())
    _, single = layer(torch.randn(2, 10, 32, dtype=torch.float64))
    assert single.reg.item() == 0 and math.isnan(single.routable_frac.item())


def test_old_dumps_load_with_the_official_recipe_and_partial_files_with_the_defaults():
    from nats.config import OFFICIAL_RECIPE

    old = {k: v for k, v in NatsConfig().to_dict().items() if k not in OFFICIAL_RECIPE}
    assert NatsConfig.from_dict(old) == NatsConfig().official_recipe()
    partial = {"d_model": 64, "head_dim_k": 32, "head_dim_v": 32, "chunk_size": 16}
    assert NatsConfig.from_dict(partial) == NatsConfig(**partial)
    mixed = {**old, "softmax_target": 0.5}  # any recipe key: the recipe's version
    # ... but without scorer_pool, from before the field, when every model pooled the mean
    assert NatsConfig.from_dict(mixed) == NatsConfig(softmax_target=0.5, scorer_pool="mean")
    for saved in (NatsConfig(branch_norm="linear"), NatsConfig(), NatsConfig(scorer_pool="mean")):
        assert NatsConfig.from_dict(saved.to_dict()) == saved  # a field written is kept


@pytest.mark.parametrize("branch_norm", ["both", "linear", "scaled", "none"])
def test_merge_normalises_the_branches_branch_norm_names(branch_norm: str) -> None:
    """``_merge`` against the formula written out: RMS-normalise the named branches, weight
    them by ``softmax(W_w q)``, then the output projection."""
    torch.manual_seed(0)
    cfg = NatsConfig(vocab_size=16, d_model=32, n_heads=2, softmax_heads_per_head=2,
                     head_dim_k=16, head_dim_v=16, chunk_size=16, layer_types=("nats",),
                     n_layers=1, branch_norm=branch_norm)
    layer = NatsAttention(cfg).double()
    x, q = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    o_la = 3 * torch.randn(2, 5, 2, 16, dtype=torch.float64)
    o_sm = 0.1 * torch.randn(2, 5, 4, 8, dtype=torch.float64)

    def rms(t: torch.Tensor) -> torch.Tensor:
        return t / (t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt()

    la = o_la.reshape(2, 5, 4, 8)
    la = la if branch_norm == "none" else rms(la)
    sm = rms(o_sm) if branch_norm == "both" else o_sm
    if branch_norm == "scaled":  # untrained: the running mean square starts at 1
        sm = o_sm / math.sqrt(1 + cfg.norm_eps)
    w = torch.softmax(layer.mix(q).view(2, 5, 4, 2), -1)

    def merged(sm: torch.Tensor) -> torch.Tensor:
        return layer.out.out(((w[..., :1] * la + w[..., 1:] * sm) * layer.out.gamma).flatten(-2))

    torch.testing.assert_close(layer._merge(q, o_la, o_sm, x), merged(sm))
    if branch_norm == "scaled":  # one training step: the heads' mean squares, not blended
        layer.softmax_scale.commit()
        mean_square = o_sm.pow(2).mean((0, 1, 3))
        torch.testing.assert_close(layer.softmax_scale.running_mean, mean_square)
        layer.eval()
        sm = o_sm / (mean_square[:, None] + cfg.norm_eps).sqrt()
        torch.testing.assert_close(layer._merge(q, o_la, o_sm, x), merged(sm))
        layer._merge(q, o_la, 2 * o_sm, x)  # evaluation leaves the statistics alone
        layer.softmax_scale.commit()
        torch.testing.assert_close(layer.softmax_scale.running_mean, mean_square)


@pytest.mark.parametrize("branch_norm", ["both", "linear", "scaled"])
def test_softmax_gain_weights_each_softmax_head_and_learns(branch_norm: str) -> None:
    """``softmax_gain_init``: the merge equals the ungained layer's with each softmax head's
    output times its gain, and the gain gets a gradient."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=16, d_model=32, n_heads=2, softmax_heads_per_head=2,
                  head_dim_k=16, head_dim_v=16, chunk_size=16, layer_types=("nats",),
                  n_layers=1, branch_norm=branch_norm)
    plain = NatsAttention(NatsConfig(**kwargs)).double()
    gained = NatsAttention(NatsConfig(**kwargs, softmax_gain_init=0.05)).double()
    missing = gained.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing == ["softmax_gain"]
    torch.testing.assert_close(gained.softmax_gain.detach(),
                               torch.full((4,), 0.05, dtype=torch.float64))
    with torch.no_grad():
        gained.softmax_gain.copy_(torch.tensor([0.05, 0.5, 1.0, 2.0]))
    x, q = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    o_la = torch.randn(2, 5, 2, 16, dtype=torch.float64)
    o_sm = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    if branch_norm == "both":  # the gain scales the normalised output, not the raw one
        plain_gain = gained.softmax_gain.detach()
        sm = o_sm / (o_sm.pow(2).mean(-1, keepdim=True) + plain.cfg.norm_eps).sqrt()
        w = torch.softmax(plain.mix(q).view(2, 5, 4, 2), -1)
        la = o_la.reshape(2, 5, 4, 8)
        la = la / (la.pow(2).mean(-1, keepdim=True) + plain.cfg.norm_eps).sqrt()
        y_ref = (w[..., :1] * la + w[..., 1:] * plain_gain[:, None] * sm) * plain.out.gamma
        expected = plain.out.out(y_ref.flatten(-2))
    else:
        expected = plain._merge(q, o_la, o_sm * gained.softmax_gain.detach()[:, None], x)
    y = gained._merge(q, o_la, o_sm, x)
    torch.testing.assert_close(y, expected)
    y.square().sum().backward()
    assert gained.softmax_gain.grad is not None and gained.softmax_gain.grad.abs().min() > 0
