"""Search spaces: loading and validation (one-line errors), define-by-run sampling."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import FixedTrial

from nats.config import LINEAR_OPS
from nats.search_spaces import BUILTIN_SPACES, DefineByRun, SpaceError, load_space, search_base
from nats.search_spaces.spaces import check_space_fits, space_from_dict

BASE = search_base("mqar-search")


def test_builtin_spaces_load_and_fit_the_default_base() -> None:
    assert {"chunk-and-mix", "layer-mix", "full"} <= set(BUILTIN_SPACES)
    for name in BUILTIN_SPACES:
        space = load_space(name)
        assert space.name == name and space.describe()
        check_space_fits(space, BASE)


def test_fixed_trial_gives_the_expected_config() -> None:
    space = load_space("chunk-and-mix")
    params = {"chunk_size": 32, "layer0": "linear", "layer1": "nats", "softmax_target": 0.125}
    got = space.sample(FixedTrial(params), BASE)
    model = BASE.model.replace(chunk_size=32, layer_types=("linear", "nats"), softmax_target=0.125)
    assert got == BASE.replace(model=model)


def test_the_budget_is_checked_as_a_share() -> None:
    with pytest.raises(SpaceError, match=r"params.softmax_target = 1.5 .*numbers in \(0, 1\)"):
        space_from_dict({"params": {"softmax_target": [0.25, 1.5]}})


def test_per_layer_choices_follow_the_depth() -> None:
    space = load_space("full")
    params = {"n_layers": 3, "d_model": 128, "chunk_size": 64, "softmax_heads_per_head": 4,
              "linear_op": "deltanet", "branch_norm": "linear", "softmax_gain_init": 0.05,
              "softmax_qkv": "own", "scorer_pool": "max", "budget_anneal": 0.3,
              "reg_lambda": 0.01, "lr": 0.002, "layer0": "softmax", "layer1": "nats",
              "layer2": "linear"}
    got = space.sample(FixedTrial(params), BASE)
    assert got.model.layer_types == ("softmax", "nats", "linear")
    assert got.model.linear_op == "deltanet" and got.model.branch_norm == "linear"
    assert got.model.softmax_qkv == "own" and got.model.scorer_pool == "max"
    assert (got.model.n_layers, got.model.d_model, got.model.chunk_size) == (3, 128, 64)
    assert got.model.softmax_heads_per_head == 4 and got.lr == 0.002
    assert got.budget_anneal == 0.3
    two = space.sample(FixedTrial({**params, "n_layers": 2}), BASE)  # layer2 is not asked
    assert two.model.layer_types == ("softmax", "nats")
    with pytest.raises(ValueError, match="layer2"):
        space.sample(FixedTrial({k: v for k, v in params.items() if k != "layer2"}), BASE)


def test_every_k_pattern() -> None:
    space = space_from_dict({"params": {"n_layers": [4, 6], "layers": {
        "every": [2, 3], "kind": "nats", "other": ["softmax", "linear"]}}})
    got = space.sample(FixedTrial({"n_layers": 6, "every": 3, "other_layers": "softmax"}), BASE)
    assert got.model.layer_types == ("softmax", "softmax", "nats") * 2


def test_linear_op_dimension_validates_and_samples_every_operator() -> None:
    space = space_from_dict({"params": {"linear_op": list(LINEAR_OPS),
                                        "layers": {"choices": ["nats", "linear"]}}})
    assert space.dim("linear_op").choices == LINEAR_OPS
    check_space_fits(space, BASE)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        config = space.sample(trial, BASE)
        assert config.model.linear_op == trial.params["linear_op"]
        seen.add(config.model.linear_op)
        study.tell(trial, 0.0)
    assert seen == set(LINEAR_OPS)
    assert "linear_op" in {d.name for d in load_space("full").dims}


@pytest.mark.parametrize(("key", "values", "bad", "allowed"), [
    ("branch_norm", ["both", "linear"], "rms", "'both'"),
    ("softmax_qkv", ["shared", "own"], "separate", "'shared', 'own'"),
    ("scorer_pool", ["max", "mean"], "sum", "'mean', 'max', 'mean_max'"),
])
def test_a_merge_setting_is_a_routing_choice(key: str, values: list[str], bad: str,
                                             allowed: str) -> None:
    """Asked, and applied, only of a model with a NAtS-L layer; checked against its set."""
    space = space_from_dict({"params": {key: values,
                                        "layers": {"choices": ["nats", "linear"]}, "n_layers": 2}})
    got = space.sample(FixedTrial({"layer0": "nats", "layer1": "linear", key: values[1]}), BASE)
    assert getattr(got.model, key) == values[1] != getattr(BASE.model, key)
    plain = space.sample(FixedTrial({"layer0": "linear", "layer1": "linear"}), BASE)  # not asked
    assert getattr(plain.model, key) == getattr(BASE.model, key)
    with pytest.raises(SpaceError, match=rf"{key}.*{allowed}"):
        space_from_dict({"params": {key: [bad]}})


def test_softmax_gain_is_a_routing_choice_that_may_be_none() -> None:
    """``softmax_gain_init: [null, 0.05]``: both choices reach the model, a model without
    NAtS-L layers is not asked, and the all-NAtS-L baseline keeps the base's ``None``."""
    space = space_from_dict({"params": {"softmax_gain_init": [None, 0.05],
                                        "layers": {"choices": ["nats", "linear"]}}})
    for gain in (None, 0.05):
        got = space.sample(FixedTrial({"layer0": "nats", "layer1": "nats",
                                       "softmax_gain_init": gain}), BASE)
        assert got.model.softmax_gain_init == gain
    assert BASE.model.softmax_gain_init is None
    points = space.baseline_points(BASE)
    assert {"layer0": "nats", "layer1": "nats", "softmax_gain_init": None} in points
    gained = BASE.replace(model=BASE.model.replace(softmax_gain_init=1.0))
    assert all("softmax_gain_init" not in p for p in space.baseline_points(gained))
    assert space_from_dict({"params": {"softmax_gain_init": {"low": 0.01, "high": 1.0,
                                                             "log": True}}}).dim(
        "softmax_gain_init").low == 0.01
    for bad, allowed in (([0.0], "finite numbers > 0 or null"),
                         ([None, -1.0], "finite numbers > 0 or null"),
                         ({"low": None, "high": 1.0}, "finite numbers > 0$")):
        with pytest.raises(SpaceError, match=rf"params\.softmax_gain_init = .* {allowed}"):
            space_from_dict({"params": {"softmax_gain_init": bad}})
    assert space.dim("softmax_gain_init").describe() == "null | 0.05"


def test_a_space_may_search_no_budget_against_budgets() -> None:
    """``softmax_target: [null, 0.25]``: ``null`` reaches the model as no budget (the
    cost term alone prices softmax)."""
    space = space_from_dict({"params": {"softmax_target": [None, 0.25],
                                        "layers": {"choices": ["nats", "linear"]}}})
    got = space.sample(FixedTrial({"layer0": "nats", "layer1": "nats",
                                   "softmax_target": None}), BASE)
    assert got.model.softmax_target is None
    with pytest.raises(SpaceError, match=r"softmax_target = 1\.5 .* numbers in \(0, 1\) or null"):
        space_from_dict({"params": {"softmax_target": [None, 1.5]}})


def test_budget_annealing_is_asked_only_under_a_budget() -> None:
    """``budget_anneal`` sets the trainer's field for a model with a budget; without a
    NAtS-L layer or with ``softmax_target: null`` it is not asked and the base's stays."""
    space = space_from_dict({"params": {"budget_anneal": [0.0, 0.3],
                                        "softmax_target": [None, 0.5],
                                        "layers": {"choices": ["nats", "linear"]}}})
    nats = {"layer0": "nats", "layer1": "nats"}
    got = space.sample(FixedTrial({**nats, "softmax_target": 0.5, "budget_anneal": 0.3}), BASE)
    assert (got.budget_anneal, got.model.softmax_target) == (0.3, 0.5) == (
        0.3, BASE.model.softmax_target)
    free = space.sample(FixedTrial({**nats, "softmax_target": None}), BASE)
    assert free.budget_anneal == BASE.budget_anneal == 0.0 and free.model.softmax_target is None
    plain = space.sample(FixedTrial({"layer0": "linear", "layer1": "linear"}), BASE)
    assert plain.budget_anneal == BASE.budget_anneal
    # The all-NAtS-L baseline keeps the base's budget and annealing.
    assert {**nats, "softmax_target": BASE.model.softmax_target,
            "budget_anneal": 0.0} in space.baseline_points(BASE)
    annealed = BASE.replace(budget_anneal=0.5)
    assert all("budget_anneal" not in p for p in space.baseline_points(annealed))
    # Without a budget the annealing is not asked, so the baseline neither names it nor
    # needs the base's value among the choices.
    free_base = annealed.replace(model=BASE.model.replace(softmax_target=None))
    assert {**nats, "softmax_target": None} in space.baseline_points(free_base)
    for bad in ([0.0, 1.5], [-0.1], {"low": 0.0, "high": 2.0}):
        with pytest.raises(SpaceError, match=r"params\.budget_anneal = .* numbers in \[0, 1\]"):
            space_from_dict({"params": {"budget_anneal": bad}})
    assert "budget_anneal" in {d.name for d in load_space("full").dims}


def test_define_by_run_asks_exactly_the_conditional_dimensions() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_space("full")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(10):
        trial = study.ask()
        DefineByRun(space, BASE)(trial)
        n = trial.params["n_layers"]
        assert {k for k in trial.params if k.startswith("layer")} == {
            f"layer{i}" for i in range(n)}
        # Replaying the parameters gives the config the searcher's trial stood for.
        config = space.sample(FixedTrial(trial.params), BASE)
        assert config.model.n_layers == n
        study.tell(trial, 0.0)


def test_routing_parameters_are_asked_only_of_models_that_route() -> None:
    space = load_space("full")
    params = {"n_layers": 2, "d_model": 128, "softmax_heads_per_head": 4, "linear_op": "deltanet",
              "lr": 0.002, "layer0": "softmax", "layer1": "linear"}
    # No NAtS-L layer: chunk size and the routing cost are not asked for, the base's stay.
    got = space.sample(FixedTrial(params), BASE)
    assert (got.model.chunk_size, got.model.reg_lambda) == (BASE.model.chunk_size,
                                                            BASE.model.reg_lambda)
    routed = space.sample(FixedTrial({**params, "layer1": "nats", "chunk_size": 32,
                                      "branch_norm": "linear", "softmax_gain_init": None,
                                      "softmax_qkv": "own", "scorer_pool": "max",
                                      "budget_anneal": 0.0, "reg_lambda": 0.05}), BASE)
    assert (routed.model.chunk_size, routed.model.reg_lambda) == (32, 0.05)
    assert routed.model.branch_norm == "linear" and routed.model.softmax_qkv == "own"
    assert got.model.branch_norm == BASE.model.branch_norm == "scaled"
    assert got.model.softmax_qkv == BASE.model.softmax_qkv == "shared"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        DefineByRun(space, BASE)(trial)
        types = {trial.params[f"layer{i}"] for i in range(trial.params["n_layers"])}
        assert ("reg_lambda" in trial.params) == ("nats" in types)
        study.tell(trial, 0.0)


@pytest.mark.parametrize(("text", "needle"), [
    ("params: {chunk_size: [12, 32]}", "params.chunk_size = 12 is invalid: must be chunk "
                                       "sizes from (16, 32, 64, 128, 256)"),
    ("params: {layers: {choices: [nats, mamba]}}", "params.layers.choices"),
    ("params: {layers: {every: [0]}}", "params.layers.every"),
    ("params: {layers: [nats, linear]}", "params.layers"),
    ("params: {reg_lambda: {low: 0, high: 1, log: true}}", "params.reg_lambda.low = 0"),
    ("params: {lr: {low: 0.1, high: 0.01}}", "low < high"),
    ("params: {lr: -1}", "params.lr = -1"),
    ("params: {chunksize: [16]}", "unknown params key(s) ['chunksize']"),
    ("parameters: {chunk_size: [16]}", "unknown key(s) ['parameters']"),
    ("1: a\nfoo: b", "unknown key(s) ['1', 'foo']"),  # keys of two types: no TypeError
    ("params: {}", "params = {} is invalid"),
    ("- a list", "must be a mapping"),
    ("params: {chunk_size: [16, 16]}", "without repeated"),
    ("params: {n_layers: {low: 1, high: 4}, d_model: [0]}", "params.d_model = 0"),
    ("params: [unclosed", "not valid YAML"),
    ("params: {softmax_heads_per_head: [3]}", "does not fit the base config"),
    ("params: {linear_op: [deltanet, mamba]}", "params.linear_op = 'mamba' is invalid: must be "
                                               "operators from ('gated_deltanet'"),
    ("params: {linear_op: {low: 1, high: 2}}", "params.linear_op = {'low': 1, 'high': 2} is "
                                               "invalid: must be a list of operators"),
])
def test_bad_space_files_are_one_line_errors(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(SpaceError) as info:
        check_space_fits(load_space(path), BASE)
    message = str(info.value)
    assert "\n" not in message and needle in message, message
    assert message.startswith(f"space file {path}") or "does not fit" in message


def test_unknown_space_name() -> None:
    with pytest.raises(SpaceError, match="neither a built-in space"):
        load_space("no-such-space")


def test_baselines_are_the_uniform_stacks_of_a_per_layer_mix() -> None:
    base = search_base("mqar-search")  # 2 layers, NAtS-L budget 0.5
    pure = [{"layer0": "softmax", "layer1": "softmax"}, {"layer0": "linear", "layer1": "linear"}]
    nats = {"layer0": "nats", "layer1": "nats", "softmax_target": 0.5}
    space = load_space("hybrid")
    assert space.baseline_points(base) == [*pure, nats]
    # Each becomes a trial's config through the define-by-run function: the unrouted
    # models are asked no routing parameter, the NAtS-L one gets the base's budget.
    for point in pure:
        config = space.sample(FixedTrial(point), base)
        assert config.model.layer_types == (point["layer0"],) * 2
    config = space.sample(FixedTrial(nats), base)
    assert config.model.layer_types == ("nats", "nats") and config.model.softmax_target == 0.5
    # A space that cannot take the base's routing settings queues no NAtS-L stack.
    other = base.replace(model=base.model.replace(softmax_target=0.3))
    assert space.baseline_points(other) == pure
    assert load_space("chunk-and-mix").baseline_points(other) == pure
    no_budget = base.replace(model=base.model.replace(softmax_target=None))
    assert space.baseline_points(no_budget) == pure
    # A space without routing parameters queues it as the base has it.
    assert load_space("layer-mix").baseline_points(other)[-1] == {"layer0": "nats",
                                                                   "layer1": "nats"}
    # A depth or a pattern search has no single uniform stack to queue.
    assert load_space("nats-every-k").baseline_points(base) == []
    assert load_space("full").baseline_points(base) == []


def test_baselines_setting_is_a_bool() -> None:
    from nats.search_spaces.search import make_settings

    with pytest.raises(ValueError, match="baselines 'yes': must be true or false"):
        make_settings(load_space("hybrid"), search_base("mqar-search"), baselines="yes")


def test_a_space_written_with_the_old_linear_layer_name_keeps_it() -> None:
    """``gdn`` (the plain linear layer's old name) is still a layer type of a space: the
    space asks Optuna the choices as written (a resumed search must), the config says
    ``linear``, and the uniform stacks are queued as before."""
    space = space_from_dict({"params": {"layers": {"choices": ["nats", "gdn", "softmax"]},
                                        "lr": [0.003]}})
    base = search_base("mqar-search")
    assert space.layers.choices == ("nats", "gdn", "softmax")
    assert space.baseline_points(base)[:2] == [{"layer0": "softmax", "layer1": "softmax"},
                                               {"layer0": "gdn", "layer1": "gdn"}]
    with pytest.warns(DeprecationWarning, match="'gdn' is deprecated"):
        config = space.sample(FixedTrial({"layer0": "gdn", "layer1": "nats", "lr": 0.003}),
                              base)
    assert config.model.layer_types == ("linear", "nats")
    with pytest.raises(SpaceError, match="repeated layer types"):
        space_from_dict({"params": {"layers": {"choices": ["gdn", "linear"]}}})
