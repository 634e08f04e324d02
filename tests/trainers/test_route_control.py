"""The trainer's side of routing: exploration schedule, budget controller, scorer optimiser
group, and the routing-precision metrics of an evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nats import NatsConfig, NatsForCausalLM
from nats.kernels import SOFTMAX
from nats.model import IGNORE_INDEX, next_token_cross_entropy
from nats.trainers import route_control, train
from nats.trainers.evaluation import RoutingPrecision, informative_chunks, question_positions
from nats.trainers.optim import build_optimizer, set_lr
from nats.trainers.route_control import (
    budget_target,
    calibrate_budget,
    exploration_noise,
    kept_on_path,
    split_budget,
    swaps_end,
    update_budget,
)

from .conftest import MicroConfig


def test_exploration_anneals_from_one_to_zero(micro: MicroConfig) -> None:
    config = micro(steps=100, route_explore=0.4)
    assert [exploration_noise(s, config) for s in (0, 10, 20, 39, 40, 99)] == pytest.approx(
        [1.0, 0.75, 0.5, 0.025, 0.0, 0.0])
    assert exploration_noise(0, micro(route_explore=0.0)) == 0.0


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_budget_controller_moves_each_bias_against_its_error(micro: MicroConfig,
                                                             scope: str) -> None:
    config = micro(budget_rate=0.5)
    model = NatsForCausalLM(config.model.replace(softmax_target=0.25, budget_scope=scope))
    start = float(model.nats_layers[0].budget.route_bias.unique())
    update_budget(model, [torch.tensor(0.75), torch.tensor(0.25)], 0.25, config)
    moved = [float(layer.budget.route_bias.unique()) - start for layer in model.nats_layers]
    want = [-0.25, 0.0] if scope == "layer" else [-0.125, -0.125]
    assert moved == pytest.approx(want)
    update_budget(model, [torch.tensor(math.nan), torch.tensor(0.5)], 0.25, config)  # 1 chunk
    assert [float(layer.budget.route_bias.unique()) - start for layer in model.nats_layers] == \
        pytest.approx(want)


def test_budget_target_anneals_from_all_softmax(micro: MicroConfig) -> None:
    config = micro(steps=100, budget_anneal=0.4)
    config = config.replace(model=config.model.replace(softmax_target=0.2))
    assert [budget_target(s, config) for s in (0, 10, 20, 40, 99)] == pytest.approx(
        [1.0, 0.8, 0.6, 0.2, 0.2])
    assert budget_target(0, config.replace(budget_anneal=0.0)) == pytest.approx(0.2)
    unbudgeted = config.replace(model=config.model.replace(softmax_target=None))
    assert budget_target(0, unbudgeted) is None


def test_budget_anneal_trains_all_softmax_then_lands_on_target(micro: MicroConfig) -> None:
    """The controller follows the falling target: early steps route nearly every chunk to
    softmax, the end of the run routes the target's share."""
    config = micro(steps=120, budget_anneal=0.5, budget_rate=0.2, log_interval=1)
    # Mean-pooled: the copy task's chunks hold most of its 8 symbols, so their maxima, and
    # a max-pooled scorer's scores, tie, and the share moves in steps the test does not ask.
    config = config.replace(model=config.model.replace(softmax_target=0.25, scorer_pool="mean"))
    train(config)
    events = EventAccumulator(config.out_dir, size_guidance={"scalars": 0})
    events.Reload()
    fracs = {e.step: e.value for e in events.Scalars("train/route_frac")}
    assert sum(fracs[s] for s in range(6, 21)) / 15 > 0.8  # target 0.94 .. 0.76
    assert abs(sum(fracs[s] for s in range(91, 121)) / 30 - 0.25) < 0.08


def test_scorers_get_their_own_rate_and_no_weight_decay(micro: MicroConfig) -> None:
    config = micro(router_lr_scale=3.0, weight_decay=0.1)
    model = NatsForCausalLM(config.model)
    optimizer = build_optimizer(model, config)
    set_lr(optimizer, 0.01)
    scorer_ids = {id(layer.scorer.proj.weight) for layer in model.nats_layers}
    groups = [g for g in optimizer.param_groups if {id(p) for p in g["params"]} & scorer_ids]
    assert len(groups) == 1 and {id(p) for p in groups[0]["params"]} == scorer_ids
    assert groups[0]["lr"] == pytest.approx(0.03) and groups[0]["weight_decay"] == 0.0
    others = [g for g in optimizer.param_groups if g is not groups[0]]
    assert all(g["lr"] == pytest.approx(0.01) for g in others)
    plain = NatsForCausalLM(config.model.replace(layer_types=("linear", "softmax")))
    assert len(build_optimizer(plain, config).param_groups) == 2


def test_routing_precision_counts_by_hand() -> None:
    relevant = torch.zeros(2, 64, dtype=torch.bool)
    relevant[0, 20] = relevant[1, 40] = relevant[1, 63] = True  # chunks 1; 2 and 3 (last)
    assert informative_chunks(relevant, 16).tolist() == [[False, True, False, False],
                                                         [False, False, True, True]]
    mask = torch.tensor([[0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert informative_chunks(mask, 3).tolist() == [[False, True, False], [True, False, True]]
    labels = torch.full((2, 64), IGNORE_INDEX)
    labels[0, 32] = labels[1, 45] = 7  # asks from 31 (chunk 1, informative) and 32 (chunk 2)
    asked = question_positions(labels)  # row 1: chunk 2 holds a question and a pair
    assert asked.nonzero().tolist() == [[0, 31], [0, 32], [1, 44], [1, 45]]
    sm = torch.tensor([[[1, 0], [1, 1], [0, 1], [1, 1]],   # [B, N, H]: 1 = softmax
                       [[0, 0], [0, 0], [1, 0], [0, 0]]])
    routes = torch.stack([sm, 1 - sm], -1).float()
    precision = RoutingPrecision()
    precision.add([routes, None], relevant, asked, 16)
    m = precision.metrics()
    # Routable: chunks 0-2. Informative: (row 0, chunk 1), (row 1, chunk 2), 2 heads each
    # -> 3 of 4 softmax. Query: (row 0, chunk 2) -> 1 of 2. Filler: row 0 chunk 0 and row 1
    # chunks 0, 1 -> 1 of 6.
    assert m["eval/route_informative"] == pytest.approx(0.75)
    assert m["eval/route_query"] == pytest.approx(0.5)
    assert m["eval/route_filler"] == pytest.approx(1 / 6)
    assert m["eval/route_lift"] == pytest.approx(4.5)
    assert m["eval/route_lift/layer0"] == pytest.approx(4.5)
    # Per head: head 0 sends both informative chunks and 1 of 3 filler chunks to softmax,
    # head 1 one informative chunk, the question and no filler (no lift: nothing to divide).
    assert m["eval/route_informative/layer0/head0"] == pytest.approx(1.0)
    assert m["eval/route_filler/layer0/head0"] == pytest.approx(1 / 3)
    assert m["eval/route_lift/layer0/head0"] == pytest.approx(3.0)
    assert m["eval/route_informative/layer0/head1"] == pytest.approx(0.5)
    assert m["eval/route_query/layer0/head1"] == pytest.approx(1.0)
    assert m["eval/route_filler/layer0/head1"] == 0.0
    assert "eval/route_lift/layer0/head1" not in m
    never = RoutingPrecision()  # only the pairs to softmax: a filler rate of 0, no lift
    pairs = informative_chunks(relevant, 16).long()[..., None].expand(-1, -1, 2)
    never.add([torch.stack([pairs, 1 - pairs], -1).float()], relevant, asked, 16)
    assert never.metrics()["eval/route_informative"] == 1.0
    assert never.metrics()["eval/route_query"] == 0.0
    assert never.metrics()["eval/route_filler"] == 0.0
    assert "eval/route_lift" not in never.metrics()
    assert RoutingPrecision().metrics() == {}


def test_config_records_the_recipe(micro: MicroConfig) -> None:
    config = micro(route_explore=0.25, budget_rate=0.1, router_lr_scale=2.0)
    config = config.replace(model=config.model.replace(softmax_target=0.2, route_grad="both"))
    again = type(config).from_dict(config.to_dict())
    assert again == config and isinstance(again.model, NatsConfig)


def _scored_model(target: float | None = 0.25,
                  layers: tuple[str, ...] = ("nats", "nats")) -> NatsForCausalLM:
    """A budgeted model whose scorers rank chunks (zero-initialised ones tie). Mean-pooled:
    the maximum over a chunk of the 8-token workload below is the same for many chunks, so
    a max-pooled scorer ties them (54 distinct scores of 160) and no bias splits them."""
    torch.manual_seed(0)
    model = NatsForCausalLM(NatsConfig(
        vocab_size=64, d_model=32, n_layers=len(layers), n_heads=2, softmax_heads_per_head=2,
        head_dim_k=16, head_dim_v=16, chunk_size=16, layer_types=layers,
        softmax_target=target, scorer_pool="mean"))
    for layer in model.nats_layers:
        torch.nn.init.normal_(layer.scorer.proj.weight)
    return model.eval()


def _ids(seed: int, batches: int = 4, low: int = 0, high: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (8, 161), generator=g) for _ in range(batches)]


def _routed_share(model: NatsForCausalLM, batches: list[torch.Tensor]) -> list[float]:
    """Per NAtS-L layer, the routable chunks (all but each sequence's last) sent to
    softmax, counted from the routes themselves."""
    with torch.no_grad():
        outs = [model.eval()(ids) for ids in batches]
    return [torch.cat([o.routes[i][:, :-1, :, SOFTMAX].flatten() for o in outs]).mean().item()
            for i, r in enumerate(outs[0].routes) if r is not None]


def test_calibration_routes_the_target_share_of_the_workload() -> None:
    model = _scored_model().train()
    workload = _ids(1, low=0, high=8)  # other content than the uniform tokens below
    before = _routed_share(model, workload)
    model.train()
    layers = calibrate_budget(model, workload, 0.4)
    assert model.training  # as it was
    assert [c.bias for c in layers] == [float(x.budget.route_bias.unique())
                                        for x in model.nats_layers]
    assert [c.layer for c in layers] == [0, 1]
    # On the calibration batches: the target to within one chunk-head of 4 x 8 x 9 x 2.
    assert [c.share for c in layers] == pytest.approx([0.4, 0.4], abs=1 / 576)
    assert _routed_share(model, workload) == pytest.approx([c.share for c in layers])
    assert all(abs(b - 0.4) > 0.02 for b in before)  # it did move them
    # On fresh batches of the same workload: the target, up to sampling.
    assert _routed_share(model, _ids(2, low=0, high=8)) == pytest.approx([0.4, 0.4], abs=0.06)


def test_calibration_skips_unrouted_layers_and_reports_ties_as_routed() -> None:
    model = _scored_model(layers=("linear", "nats", "softmax", "nats"))
    layers = calibrate_budget(model, _ids(3), 0.3)
    assert [c.layer for c in layers] == [1, 3]
    assert _routed_share(model, _ids(3)) == pytest.approx([c.share for c in layers])
    tied = _scored_model()
    for layer in tied.nats_layers:  # every score equal: the target cannot be split
        torch.nn.init.zeros_(layer.scorer.proj.weight)
    shares = [c.share for c in calibrate_budget(tied, _ids(3), 0.3)]
    assert shares == _routed_share(tied, _ids(3)) and set(shares) <= {0.0, 1.0}


def test_calibration_gives_each_layer_its_own_target() -> None:
    model = _scored_model(layers=("nats", "nats", "nats"))
    layers = calibrate_budget(model, _ids(1), [0.1, 0.0, 0.7])
    assert [c.target for c in layers] == [0.1, 0.0, 0.7]
    assert [c.share for c in layers] == pytest.approx([0.1, 0.0, 0.7], abs=1 / 576)
    assert _routed_share(model, _ids(1)) == pytest.approx([c.share for c in layers])
    assert [c.share for c in calibrate_budget(model, _ids(1), [1, 1, 0.5])] == pytest.approx(
        [1.0, 1.0, 0.5], abs=1 / 576)


def _labelled(seed: int, batches: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for ids in _ids(seed, batches):
        labels = torch.randint(0, 64, ids.shape, generator=g)
        labels[torch.rand(ids.shape, generator=g) < 0.5] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _loss_at(model: NatsForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]],
             shares: list[float]) -> float:
    """The reference: per-layer calibration, then the mean loss over labelled tokens."""
    calibrate_budget(model, [x for x, _ in batches], shares)
    with torch.no_grad():
        total = sum(float(next_token_cross_entropy(model(x).logits, y, reduction="sum"))
                    for x, y in batches)
    return total / sum(int((y[:, 1:] != IGNORE_INDEX).sum()) for _, y in batches)


def test_split_budget_finds_a_split_no_move_improves() -> None:
    model, batches = _scored_model(), _labelled(3)
    layers = split_budget(model, batches, 0.25, levels=2)  # steps 0.125, then 0.0625
    shares = [c.target for c in layers]
    assert shares != [0.25, 0.25]  # on these batches the even split is not a local optimum
    assert sum(shares) / 2 == pytest.approx(0.25)
    assert all(round(s / 0.0625, 9).is_integer() for s in shares)  # on the finest grid
    assert [c.share for c in layers] == pytest.approx(shares, abs=1 / 576)
    biases = [c.bias for c in layers]
    assert biases == [float(x.budget.route_bias.unique()) for x in model.nats_layers]
    found = _loss_at(model, batches, shares)
    assert found <= _loss_at(model, batches, [0.25, 0.25])
    for move in (0.0625, -0.0625):  # neither neighbour on the finest step is better
        if 0 <= shares[0] + move <= 0.5:
            assert found <= _loss_at(model, batches, [shares[0] + move, shares[1] - move])
    # The whole grid of splits: what it found is on it, and the losses differ.
    grid = {a: _loss_at(model, batches, [a, 0.5 - a]) for a in (0, 0.0625, 0.125, 0.1875,
                                                                 0.25, 0.3125, 0.375, 0.4375,
                                                                 0.5)}
    assert len(set(grid.values())) > 1 and found == grid[shares[0]]


def _loss_per_head(model: NatsForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   shares: list[list[float]]) -> float:
    """The reference of a split among heads: each head's bias by hand (the midpoint below
    its share of its own routable scores), then the mean loss over labelled tokens."""
    for layer, share in zip(model.nats_layers, shares, strict=True):
        seen: list[torch.Tensor] = []
        layer.budget.route_bias.zero_()
        hook = layer.scorer.register_forward_hook(  # its logits, as the budget scores them
            lambda m, i, out, seen=seen, budget=layer.budget: seen.append(
                budget(out)[:, :-1, :, 0].reshape(-1, out.shape[2])))
        with torch.no_grad():
            for x, _ in batches:
                model(x)
        hook.remove()
        z = torch.cat(seen)
        for h, t in enumerate(share):
            ranked = z[:, h].sort(descending=True).values
            k = round(t * len(ranked))
            margin = 1 + ranked[0] - ranked[-1]
            cut = (ranked[0] + margin if k == 0 else ranked[-1] - margin if k == len(ranked)
                   else (ranked[k - 1] + ranked[k]) / 2)
            layer.budget.route_bias[h] = -cut
    with torch.no_grad():
        total = sum(float(next_token_cross_entropy(model(x).logits, y, reduction="sum"))
                    for x, y in batches)
    return total / sum(int((y[:, 1:] != IGNORE_INDEX).sum()) for _, y in batches)


def test_split_budget_among_heads_finds_a_split_no_move_improves() -> None:
    model, batches = _scored_model(), _labelled(3)
    path: list[list[float]] = []
    found = split_budget(model, batches, 0.25, levels=2, unit="head", price=1e6,
                         on_split=lambda shares, _: path.append(shares))
    assert [(c.layer, c.head) for c in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    shares = [s for s in path if sum(s) == 1.0][-1]  # where the swaps ended
    assert shares != [0.25] * 4
    found = calibrate_budget(model, [x for x, _ in batches], [shares[:2], shares[2:]])
    assert [c.share for c in found] == pytest.approx(shares, abs=1 / 288)
    assert [float(b) for x in model.nats_layers for b in x.budget.route_bias] == \
        pytest.approx([c.bias for c in found])
    rows = [shares[:2], shares[2:]]
    loss = _loss_per_head(model, batches, rows)
    assert loss <= _loss_per_head(model, batches, [[0.25, 0.25], [0.25, 0.25]])
    for i in range(4):  # no move of the finest step between two heads is better
        for j in range(4):
            moved = list(shares)
            moved[i] -= 0.0625
            moved[j] += 0.0625
            if i != j and min(moved) >= 0 and max(moved) <= 1:
                assert loss <= _loss_per_head(model, batches, [moved[:2], moved[2:]])


def test_split_budget_gives_back_the_share_a_route_does_not_pay_for() -> None:
    """After the swaps, share goes back one finest step at a time down to none; a price
    keeps the point of that path with the least ``loss + price * share``."""
    batches = _labelled(3)
    path: list[tuple[list[float], float]] = []
    found = split_budget(_scored_model(), batches, 0.25, levels=2, unit="head", price=1e6,
                         on_split=lambda shares, loss: path.append((shares, loss)))
    assert [c.target for c in found] == [0.0] * 4 and path[-1][0] == [0.0] * 4
    assert path[0][0] == [0.25] * 4
    spent = [sum(shares) / 4 for shares, _ in path]
    back = next(i for i, s in enumerate(spent) if s < 0.25) - 1  # the swaps end here
    assert spent[:back + 1] == pytest.approx([0.25] * (back + 1))
    steps = [b - a for a, b in zip(spent[back:-1], spent[back + 1:], strict=True)]
    assert steps == pytest.approx([-0.0625 / 4] * len(steps))  # the finest step, one head
    model = _scored_model()
    for shares, loss in path[back::4]:  # the losses are the reference's
        assert loss == pytest.approx(_loss_per_head(model, batches, [shares[:2], shares[2:]]))
    start, (_, first) = path[back][0], path[back + 1]  # the first step back costs least
    for i in range(4):
        if start[i] > 0:
            less = [s - 0.0625 * (h == i) for h, s in enumerate(start)]
            assert first <= _loss_per_head(model, batches, [less[:2], less[2:]]) + 1e-6

    def kept(price: float) -> list[float]:
        cost = [loss + price * s for (_, loss), s in zip(path[back:], spent[back:], strict=True)]
        return path[back + max(i for i, c in enumerate(cost) if c == min(cost))][0]

    # Between the price that keeps all and the one that keeps nothing, one that keeps part.
    prices = [0.0, *(0.02 * 2**i for i in range(12))]
    partway = next(p for p in prices if 0 < sum(kept(p)) < sum(path[back][0]))
    for price in (0.0, partway):
        found = split_budget(_scored_model(), batches, 0.25, levels=2, unit="head", price=price)
        assert [c.target for c in found] == kept(price)
        assert path[kept_on_path(path, price)][0] == kept(price)


def test_split_budget_gives_back_every_sliver_of_a_share_that_is_no_power_of_two() -> None:
    path: list[tuple[list[float], float]] = []
    found = split_budget(_scored_model(), _labelled(3), 0.3, levels=3, unit="head", price=1e6,
                         on_split=lambda shares, loss: path.append((shares, loss)))
    assert [c.target for c in found] == [0.0] * 4 == path[-1][0]
    assert all(0 <= s <= 1 for shares, _ in path for s in shares)
    assert sum(path[swaps_end(path)][0]) / 4 == pytest.approx(0.3)
    assert len(path) - 1 - swaps_end(path) == round(4 * 0.3 / (0.3 / 8))  # a step each


def test_calibration_applies_a_share_per_head() -> None:
    model, batches = _scored_model(), _labelled(3)
    shares = [[0.5, 0.0], [0.125, 0.375]]
    found = calibrate_budget(model, [x for x, _ in batches], shares)
    assert [(c.layer, c.head, c.target) for c in found] == [
        (0, 0, 0.5), (0, 1, 0.0), (1, 0, 0.125), (1, 1, 0.375)]
    biases = [float(b) for x in model.nats_layers for b in x.budget.route_bias]
    _loss_per_head(model, batches, shares)  # the reference sets the biases by hand
    assert biases == pytest.approx([float(b) for x in model.nats_layers
                                    for b in x.budget.route_bias])
    with pytest.raises(ValueError, match="layer 0: 3 calibration targets for its 2 heads"):
        calibrate_budget(model, [x for x, _ in batches], [[0.5, 0.0, 0.1], 0.2])
    with pytest.raises(ValueError, match=r"a fraction in \[0, 1\]"):
        calibrate_budget(model, [x for x, _ in batches], [[0.5, 1.5], 0.2])


def test_split_budget_reads_a_layers_scores_once_per_split_of_the_layers_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, batches = _scored_model(), _labelled(3)
    calls = {"first": 0, "second": 0, "logits": 0}
    for name, module in (("first", model.nats_layers[0].scorer),
                         ("second", model.nats_layers[1].scorer), ("logits", model.lm_head)):
        module.register_forward_hook(
            lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    first_layer_splits: set[str] = set()
    calibrate = route_control._calibrate

    def spy(model, scores, targets):
        first_layer_splits.add(repr(targets[0]))
        return calibrate(model, scores, targets)

    monkeypatch.setattr(route_control, "_calibrate", spy)
    split_budget(model, batches, 0.25, levels=2, unit="head")
    passes = calls["logits"]  # a whole pass per batch and loss evaluated
    assert passes > 0 and passes % len(batches) == 0 and len(first_layer_splits) > 1
    # The first layer's scores are read once, the second's once per first-layer split (a
    # pass that reads the second layer's goes through the first and stops after it).
    reads = len(batches) * len(first_layer_splits)
    assert calls["second"] - passes == reads
    assert calls["first"] - passes == len(batches) + reads


def test_a_bias_saved_as_one_number_per_layer_loads_into_every_head() -> None:
    model = _scored_model()
    state = model.state_dict()
    state["blocks.1.mixer.budget.route_bias"] = torch.tensor(0.7)  # an older model's
    model.load_state_dict(state)
    assert model.nats_layers[1].budget.route_bias.tolist() == pytest.approx([0.7, 0.7])


def test_split_budget_refuses_what_it_cannot_do() -> None:
    model = _scored_model()
    with pytest.raises(ValueError, match=r"a fraction in \(0, 1\)"):
        split_budget(model, _labelled(0, 1), 0.0)
    with pytest.raises(ValueError, match="levels must be"):
        split_budget(model, _labelled(0, 1), 0.3, levels=0)
    with pytest.raises(ValueError, match="no calibration batches"):
        split_budget(model, [], 0.3)
    with pytest.raises(ValueError, match="unit"):
        split_budget(model, _labelled(0, 1), 0.3, unit="chunk")
    for price in (-0.1, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="price must be a number >= 0"):
            split_budget(model, _labelled(0, 1), 0.3, price=price)


@pytest.mark.parametrize(("target", "batches", "message"), [
    (0.0, None, r"a fraction in \(0, 1\)"),
    ([0.3], None, "1 calibration targets for 2 budgeted"),
    ([0.3, 1.5], None, r"a fraction in \[0, 1\]"), (1.5, None, "a fraction"),
    (True, None, "a fraction"),
    (0.3, [torch.zeros(2, 16, dtype=torch.long)], "no sequence of more than one chunk"),
    (0.3, [], "no calibration batches"),
])
def test_calibration_refuses_what_it_cannot_do(target, batches, message) -> None:
    model = _scored_model()
    biases = [float(layer.budget.route_bias.unique()) for layer in model.nats_layers]
    with pytest.raises(ValueError, match=message):
        calibrate_budget(model, _ids(0, 1) if batches is None else batches, target)
    assert [float(layer.budget.route_bias.unique()) for layer in model.nats_layers] == biases


def test_calibration_needs_a_budget() -> None:
    with pytest.raises(ValueError, match="no NAtS-L layer under a softmax budget"):
        calibrate_budget(_scored_model(target=None), _ids(0, 1), 0.3)
