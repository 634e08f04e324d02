"""Baseline architectures: the right mixer in every layer, everything else unchanged."""

from __future__ import annotations

import pytest

from nats import NatsForCausalLM
from nats.config import ConfigError
from nats.layers.short_conv import ShortConvolution
from nats.model import MIXERS
from nats.trainers import preset
from nats.trainers.config import ARCHITECTURES, architecture_layers, with_architecture

EXPECTED = {  # 4 layers, softmax every 2nd layer
    "transformer": ("softmax",) * 4,
    "gdn": ("linear",) * 4,
    "layer-hybrid": ("linear", "softmax", "linear", "softmax"),
    "natsl": ("linear", "nats", "linear", "nats"),
    "natsl-all": ("nats",) * 4,
}


def test_every_architecture_is_listed_and_has_its_layers() -> None:
    assert set(ARCHITECTURES) == set(EXPECTED)
    for arch, layers in EXPECTED.items():
        assert architecture_layers(arch, 4) == layers
    assert architecture_layers("layer-hybrid", 6, softmax_every=3) == (
        "linear", "linear", "softmax", "linear", "linear", "softmax")
    assert architecture_layers("natsl", 2) == ("linear", "nats")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_preset_with_an_architecture_builds_those_mixers(arch: str) -> None:
    base = preset("mqar-small")
    config = with_architecture(base, arch)
    assert config.model.replace(layer_types=base.model.layer_types) == base.model
    assert config.replace(model=base.model) == base  # only the mixers change
    model = NatsForCausalLM(config.model.replace(d_model=32, head_dim_k=16, head_dim_v=16))
    for block, kind in zip(model.blocks, EXPECTED[arch], strict=True):
        assert type(block.mixer) is MIXERS[kind]
        has_conv = any(isinstance(m, ShortConvolution) for m in block.mixer.modules())
        assert has_conv  # every mixer, the plain softmax layer included


def test_bad_architectures_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"unknown architecture 'mamba'.*transformer"):
        architecture_layers("mamba", 2)
    with pytest.raises(ConfigError, match=r"softmax_every = 3.*1 \.\. n_layers = 2"):
        architecture_layers("layer-hybrid", 2, softmax_every=3)
    with pytest.raises(ConfigError, match=r"n_layers = 0 is invalid: must be an integer >= 1"):
        architecture_layers("natsl", 0)


def test_nats_train_arch_flag_trains_the_baseline(tmp_path) -> None:
    import json

    from nats.cli import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "mqar-tiny", "--arch", "layer-hybrid", "--steps", "2",
                 "--mqar-filler", "noise", "--device", "cpu", "--out", str(out)]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["model"]["layer_types"] == ["linear", "softmax"]
    assert saved["mqar_filler"] == "noise"
    assert json.loads((out / "model" / "config.json").read_text())["softmax_layers"] == [1]


@pytest.mark.parametrize(("arch", "n_layers", "given", "expected"), [
    ("natsl-all", 1, None, ("nats",)),
    ("transformer", 3, None, ("softmax",) * 3),
    ("layer-hybrid", 3, None, ("linear", "softmax", "linear")),
    ("natsl", 4, None, ("linear", "nats", "linear", "nats")),
    ("gdn", 2, ("nats", "softmax"), ("nats", "softmax")),  # --layer-types wins
])
def test_the_architecture_takes_the_depth_given_beside_it(arch, n_layers, given, expected):
    """``--arch`` with ``--n-layers``: the mixers of the run's depth, not the preset's (a
    one-layer natsl-all run was refused as two layers, and a uniform architecture's
    softmax_every was checked against the depth)."""
    from nats.trainers import run_config

    overrides = {"n_layers": n_layers, **({"layer_types": given} if given else {})}
    config = run_config("mqar-tiny", {}, resume=False, model_overrides=overrides,
                        arch=(arch, 2))
    assert config.model.n_layers == n_layers and config.model.layer_types == expected
