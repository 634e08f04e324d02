"""save_pretrained / from_pretrained: config.json + model.safetensors, restored exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from nats import NatsConfig, NatsForCausalLM

from .models import tiny_model


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_round_trip_restores_config_weights_and_outputs(tmp_path, tie_embeddings):
    model = tiny_model(("nats", "linear", "softmax"), tie_embeddings=tie_embeddings, rope=True)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text()) == \
        {**model.config.to_dict(), "model_type": "nats", "architectures": ["NatsHFForCausalLM"]}
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in stored) == (not tie_embeddings)

    loaded = NatsForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.embed.weight.dtype == torch.float64
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert (loaded.lm_head.weight is loaded.embed.weight) == tie_embeddings
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_loading_a_folder_that_is_not_a_model_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        NatsForCausalLM.from_pretrained(tmp_path)
    tiny_model().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        NatsForCausalLM.from_pretrained(tmp_path)


def test_weights_of_a_softmax_layer_without_short_convolution_are_refused_in_one_line(
        tmp_path):
    """Plain softmax layers gained QKVProjection's conv: their old single ``qkv.weight``
    must not load (strictly or not) into the new layout."""
    from safetensors.torch import save_file

    model = tiny_model(("linear", "softmax"))
    model.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["blocks.1.mixer.qkv.weight"] = state.pop("blocks.1.mixer.qkv.proj.weight")
    del state["blocks.1.mixer.qkv.conv.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    message = (r"^weights from before plain softmax layers had short convolutions: "
               r"unexpected key blocks\.1\.mixer\.qkv\.weight, missing "
               r"blocks\.1\.mixer\.qkv\.proj\.weight and blocks\.1\.mixer\.qkv\.conv\.weight")
    with pytest.raises(ValueError, match=message) as error:
        NatsForCausalLM.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message):
        tiny_model(("linear", "softmax")).load_state_dict(state, strict=False)


def test_damaged_model_folders_are_one_line_errors(tmp_path) -> None:
    """What `nats info`, `generate`, `analyze` and `--init-from` meet in a folder someone
    sent or a copy cut short: a ValueError naming the file, never a library traceback."""
    good = tmp_path / "good"
    NatsForCausalLM(NatsConfig()).save_pretrained(good)
    cases = {}
    for name, change in {
        "list": lambda d: (d / "config.json").write_text("[1, 2]"),
        "null-layers": lambda d: (d / "config.json").write_text(json.dumps(
            {**json.loads((good / "config.json").read_text()), "layer_types": None})),
        "truncated": lambda d: (d / "model.safetensors").write_bytes(
            (good / "model.safetensors").read_bytes()[:1000]),
        "other-shape": lambda d: (d / "config.json").write_text(json.dumps(
            {**json.loads((good / "config.json").read_text()), "d_model": 64})),
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        for f in ("config.json", "model.safetensors"):
            (folder / f).write_bytes((good / f).read_bytes())
        change(folder)
        with pytest.raises(ValueError) as caught:
            NatsForCausalLM.from_pretrained(folder)
        cases[name] = str(caught.value)
    assert "config.json must hold a JSON object, not list" in cases["list"]
    assert "layer_types = None" in cases["null-layers"]
    assert "model.safetensors cannot be read" in cases["truncated"]
    assert "model.safetensors does not match config.json" in cases["other-shape"]
    assert all("\n" not in message for message in cases.values())


def test_built_on_the_meta_device_then_loaded_equals_the_original() -> None:
    """Large models are built without memory (``torch.device("meta")``) and then given
    their weights; nothing in construction may need real values."""
    model = tiny_model(("nats", "linear", "softmax"), rope=True).eval()
    with torch.device("meta"):
        empty = NatsForCausalLM(model.config)
    assert all(p.is_meta for p in empty.parameters())
    empty = empty.to_empty(device="cpu").to(torch.float64)
    empty.load_state_dict(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    assert torch.equal(empty.eval()(ids).logits, model(ids).logits)
