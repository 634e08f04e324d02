"""The official-checkpoint converter (src/nats/official.py) against the official layout.

The official key names and shapes below are written out from the official code
(automl/NeuralAttentionSearchLinear at 90b4315: its NAtS-L layer, its model, and fla
0.4.0's GatedDeltaNet and GatedMLP), not taken from the converter. That the converted
model computes what the official one does is a GPU check (experiments/official_parity.py,
docs/NATSL.md); here: shapes, the round trip, the per-branch merge weights, refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nats import NatsConfig, NatsForCausalLM
from nats.cli import main
from nats.config import ConfigError
from nats.kernels.reference.norms import rms_norm
from nats.official import (
    UNSUPPORTED,
    config_from_official,
    config_to_official,
    load_official,
    model_from_official,
    save_official,
    state_from_official,
    state_to_official,
)

from .test_decoding import decode_logits

# The released configs (experiments/configs/natsl_340M.json and natsl_760M.json).
CONFIG_340M = {
    "name": "Neural Attention Search 340M", "attn_mode": "chunk", "bos_token_id": 1,
    "conv_size": 4, "eos_token_id": 2, "expand_v": 2, "fuse_cross_entropy": False,
    "head_dim": 128, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": None,
    "model_type": "neural_attention_search_linear_attn_gdn", "norm_eps": 1e-06,
    "num_heads": 6, "num_attn_heads": 12, "num_hidden_layers": 21, "n_ops": 2,
    "nats_block_size": 64, "compute_dnats_for_invalid_blocks_linear_att": False,
    "compute_dnats_for_invalid_blocks_att": False, "ops_for_incomplete_chunks": "all",
    "tie_word_embeddings": False, "attn_qk_norm": True, "attn_with_short_conv": True,
    "use_cache": True, "use_gate": True, "use_short_conv": True,
    "gdn_layers": [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 18],
    "attn_apply_pos_encoding": False, "decay_for_non_gdn_blocks": True}
CONFIG_760M = {**CONFIG_340M, "hidden_size": 1536, "head_dim": 192, "num_attn_heads": 18}

TINY = {**CONFIG_340M, "hidden_size": 48, "head_dim": 16, "num_heads": 2,
        "num_attn_heads": 4, "num_hidden_layers": 3, "gdn_layers": [1],
        "nats_block_size": 16, "vocab_size": 40, "intermediate_size": 64}


def official_shapes(c: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the official model and its shape, from the official code."""
    d, h, dk = c["hidden_size"], c["num_heads"], c["head_dim"]
    dv = int(dk * c["expand_v"])
    na = c["num_attn_heads"]
    inter = c["intermediate_size"] or 256 * ((int(d * c["hidden_ratio"] * 2 / 3) + 255) // 256)
    shapes = {"model.embeddings.weight": (vocab, d), "model.norm.weight": (d,),
              "lm_head.weight": (vocab, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "attn.q_proj.weight": (h * dk, d), p + "attn.k_proj.weight": (h * dk, d),
            p + "attn.v_proj.weight": (h * dv, d), p + "attn.a_proj.weight": (h, d),
            p + "attn.b_proj.weight": (h, d), p + "attn.A_log": (h,), p + "attn.dt_bias": (h,),
            p + "attn.q_conv1d.weight": (h * dk, 1, 4), p + "attn.k_conv1d.weight": (h * dk, 1, 4),
            p + "attn.v_conv1d.weight": (h * dv, 1, 4), p + "attn.g_proj.weight": (h * dv, d),
            p + "attn.o_proj.weight": (d, h * dv)})
        if i in c["gdn_layers"]:
            shapes[p + "attn.o_norm.weight"] = (dv,)
        else:
            shapes.update({
                p + "attn.q_norm.weight": (h * dk // na,),
                p + "attn.k_norm.weight": (h * dk // na,),
                p + "attn.nats_layer.weight": (2 * h, d),
                p + "attn.nats_out_weights_layer.weight": (2 * na, h * dk),
                p + "attn.o_norm.weight1": (h * dv // na,),
                p + "attn.o_norm.weight2": (h * dv // na,)})
    return shapes


def random_official_state(c: dict, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 0.3 for k, s in official_shapes(c, vocab).items()}


@pytest.mark.parametrize("config, expected", [
    (CONFIG_340M, dict(d_model=1024, n_heads=6, softmax_heads_per_head=2, head_dim_k=128,
                       head_dim_v=256, mlp_hidden=2816)),
    (CONFIG_760M, dict(d_model=1536, n_heads=6, softmax_heads_per_head=3, head_dim_k=192,
                       head_dim_v=384, mlp_hidden=4096)),
])
def test_released_configs_convert_to_the_official_shapes(config, expected):
    cfg = config_from_official(config, vocab_size=32000)
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name
    assert cfg.layers_of("nats") == (3, 7, 11, 15, 19, 20)
    assert (cfg.chunk_size, cfg.rope, cfg.tie_embeddings) == (64, False, False)
    assert cfg.output_gate == "silu"
    assert (cfg.branch_gamma, cfg.scorer_norm, cfg.softmax_target) == (True, False, None)
    # Every official tensor has a place of the right size (counted on the meta device).
    with torch.device("meta"):
        ours = NatsForCausalLM(cfg)
    theirs = official_shapes(config, 32000)
    assert sum(p.numel() for p in ours.parameters()) == sum(
        torch.Size(s).numel() for s in theirs.values())


def test_state_round_trip_is_exact_and_uses_every_tensor():
    state = random_official_state(TINY, 40)
    cfg = config_from_official(TINY, vocab_size=40)
    model = NatsForCausalLM(cfg)
    model.load_state_dict(state_from_official(state, cfg))  # strict: every key, every shape
    back = state_to_official(model.state_dict(), cfg)
    assert back.keys() == state.keys()
    for k in state:
        assert torch.equal(back[k], state[k]), k
    # The base model's keys without their "model." prefix are read too.
    bare = {k.removeprefix("model."): v for k, v in state.items()}
    assert torch.equal(state_from_official(bare, cfg)["embed.weight"],
                       state["model.embeddings.weight"])


def test_concatenations_put_each_official_tensor_where_ours_reads_it():
    state = random_official_state(TINY, 40, seed=1)
    ours = state_from_official(state, config_from_official(TINY, vocab_size=40))
    h, dk = TINY["num_heads"], TINY["head_dim"]
    qkv = ours["blocks.0.mixer.qkv.proj.weight"]
    assert torch.equal(qkv[h * dk:2 * h * dk], state["model.layers.0.attn.k_proj.weight"])
    conv = ours["blocks.0.mixer.qkv.conv.weight"]
    assert torch.equal(conv[2 * h * dk:], state["model.layers.0.attn.v_conv1d.weight"])
    gate_up = ours["blocks.2.mlp.gate_up.weight"]
    assert torch.equal(gate_up[:64], state["model.layers.2.mlp.gate_proj.weight"])
    assert torch.equal(ours["blocks.0.mixer.softmax_gamma"],
                       state["model.layers.0.attn.o_norm.weight2"])
    assert torch.equal(ours["blocks.1.mixer.out.gamma"], state["model.layers.1.attn.o_norm.weight"])


def test_branch_weights_weigh_each_branch_before_the_sum():
    """The official gated norm: ``w_LA N(o_LA) weight1 + w_SM N(o_SM) weight2``."""
    torch.manual_seed(0)
    cfg = NatsConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, head_dim_k=16,
                     head_dim_v=16, chunk_size=16, layer_types=("nats",), softmax_target=None,
                     branch_gamma=True)
    layer = NatsForCausalLM(cfg).blocks[0].mixer
    with torch.no_grad():
        layer.out.gamma.normal_()
        layer.softmax_gamma.normal_()
    q, x = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    o_la, o_sm = torch.randn(2, 5, 2, 16), torch.randn(2, 5, 4, 8)
    w = torch.softmax(layer.mix(q).view(2, 5, 4, 2), -1)
    expected = (w[..., :1] * rms_norm(o_la.reshape(2, 5, 4, 8)) * layer.out.gamma
                + w[..., 1:] * rms_norm(o_sm) * layer.softmax_gamma)
    torch.testing.assert_close(layer._merge(q, o_la, o_sm, x), layer.out.project(expected, x))


def test_equal_branch_weights_compute_what_one_shared_weight_does():
    torch.manual_seed(1)
    shared = NatsForCausalLM(NatsConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2,
                                        head_dim_k=16, head_dim_v=16, chunk_size=16,
                                        softmax_target=None, scorer_norm=False))
    with torch.no_grad():
        for block in shared.blocks:
            block.mixer.out.gamma.normal_()
    split = NatsForCausalLM(shared.config.replace(branch_gamma=True))
    state = dict(shared.state_dict())
    for i in range(2):
        state[f"blocks.{i}.mixer.softmax_gamma"] = state[f"blocks.{i}.mixer.out.gamma"]
    split.load_state_dict(state)
    ids = torch.randint(0, 40, (2, 70))
    torch.testing.assert_close(split(ids).logits, shared(ids).logits)
    # and a gradient reaches each branch's weight
    split(ids).logits.square().mean().backward()
    assert all(b.mixer.softmax_gamma.grad.abs().sum() > 0 for b in split.blocks)


def test_saved_official_folder_loads_back_to_the_same_logits(tmp_path):
    cfg = config_from_official(TINY, vocab_size=40)
    torch.manual_seed(2)
    model = NatsForCausalLM(cfg)
    save_official(model, tmp_path / "official")
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    assert config["gdn_layers"] == [1] and config["model_type"] == TINY["model_type"]
    again = model_from_official(tmp_path / "official").eval()
    ids = torch.randint(0, 40, (2, 50))
    full = again(ids).logits
    torch.testing.assert_close(full, model.eval()(ids).logits, rtol=0, atol=0)
    # the per-branch weights hold in decoding too
    torch.testing.assert_close(decode_logits(again, ids, 20), full)


def test_a_shared_merge_weight_exports_as_both_branch_weights(tmp_path):
    cfg = NatsConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, head_dim_k=16,
                     head_dim_v=32, chunk_size=16, layer_types=("linear", "nats"),
                     tie_embeddings=True).official_recipe()
    model = NatsForCausalLM(cfg)
    state = state_to_official(model.state_dict(), cfg)
    assert torch.equal(state["model.layers.1.attn.o_norm.weight1"],
                       state["model.layers.1.attn.o_norm.weight2"])
    save_official(model, tmp_path)
    ids = torch.randint(0, 40, (1, 40))
    torch.testing.assert_close(model_from_official(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("key", sorted(UNSUPPORTED))
def test_each_unsupported_official_setting_is_refused_by_name(key):
    wanted = UNSUPPORTED[key][0]
    other = {True: False, False: True, None: 4096}.get(wanted, "other")
    with pytest.raises(ConfigError, match=key):
        config_from_official({**TINY, key: other})


def test_an_mlp_width_this_model_cannot_hold_is_refused():
    with pytest.raises(ConfigError, match="intermediate_size"):
        config_from_official({**TINY, "intermediate_size": 67})
    for width in (64, 2816, 4096, 8 * 1237):  # the ratio lands on the width exactly
        assert config_from_official({**TINY, "intermediate_size": width}).mlp_hidden == width


def test_routing_blocks_longer_than_the_official_kernels_compute_are_refused():
    with pytest.raises(ConfigError, match="nats_block_size = 128 cannot be converted: at most 64"):
        config_from_official({**TINY, "nats_block_size": 128})
    assert config_from_official({**TINY, "nats_block_size": 64}).chunk_size == 64
    cfg = config_from_official(TINY)
    with pytest.raises(ConfigError, match="chunk_size = 128 cannot be converted"):
        config_to_official(cfg.replace(chunk_size=128))
    assert config_to_official(cfg.replace(chunk_size=64))["nats_block_size"] == 64


def test_official_defaults_are_refused_where_this_layer_differs():
    """The config class's own defaults (softmax q/k/v before the convolution, no q/k norm,
    no decay over softmax chunks) are not what the released configs use."""
    with pytest.raises(ConfigError, match="attn_with_short_conv"):
        config_from_official({"model_type": TINY["model_type"]})


@pytest.mark.parametrize("change, field", [
    ({}, "scorer_norm"), ({"scorer_norm": False}, "softmax_target"),
    ({"scorer_norm": False, "softmax_target": None}, "output_gate"),
    ({"scorer_norm": False, "softmax_target": None, "output_gate": "silu",
      "branch_norm": "scaled"}, "branch_norm"),
    ({"scorer_norm": False, "softmax_target": None, "output_gate": "silu",
      "softmax_qkv": "own"}, "softmax_qkv"),
    ({"scorer_norm": False, "softmax_target": None, "output_gate": "silu"}, "scorer_pool"),
])
def test_a_forward_the_official_layer_cannot_compute_is_refused(change, field):
    with pytest.raises(ConfigError, match=field):
        config_to_official(NatsConfig().replace(**change))


def test_pickled_weights_are_refused_and_sharded_safetensors_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle"):
        load_official(tmp_path)
    state = random_official_state(TINY, 40)
    keys = sorted(state)
    halves = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in halves.items() for k in part}}))
    cfg, ours = load_official(tmp_path)
    assert cfg.vocab_size == 40 and torch.equal(ours["lm_head.weight"], state["lm_head.weight"])
    for broken, message in (("{", "is not valid JSON"), ("[]", "must hold a JSON object"),
                            ("{}", "has no weight_map")):
        (tmp_path / "model.safetensors.index.json").write_text(broken)
        with pytest.raises(ValueError, match=message):
            load_official(tmp_path)


def test_a_missing_or_extra_tensor_is_named():
    state = random_official_state(TINY, 40)
    cfg = config_from_official(TINY, vocab_size=40)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn\.o_norm\.weight2"):
        state_from_official({k: v for k, v in state.items() if not k.endswith("weight2")}, cfg)
    with pytest.raises(ValueError, match="no place"):
        state_from_official({**state, "model.layers.0.attn.extra": torch.zeros(1)}, cfg)


def test_cli_converts_both_ways_with_one_line_errors(tmp_path, capsys):
    official = tmp_path / "official"
    official.mkdir()
    (official / "config.json").write_text(json.dumps(TINY))
    save_file(random_official_state(TINY, 40), str(official / "model.safetensors"))
    assert main(["convert", "from-official", str(official), "--out", str(tmp_path / "ours")]) == 0
    ours = NatsForCausalLM.from_pretrained(tmp_path / "ours")
    assert ours.config.branch_gamma and ours.config.layer_types == ("nats", "linear", "nats")
    assert main(["convert", "to-official", str(tmp_path / "ours"), "--out",
                 str(tmp_path / "back")]) == 0
    ids = torch.randint(0, 40, (1, 40))
    torch.testing.assert_close(model_from_official(tmp_path / "back")(ids).logits, ours(ids).logits)
    capsys.readouterr()
    default = NatsForCausalLM(NatsConfig(vocab_size=40, d_model=32, n_heads=2, head_dim_k=16,
                                         head_dim_v=16, chunk_size=16))
    default.save_pretrained(tmp_path / "default")
    assert main(["convert", "to-official", str(tmp_path / "default"), "--out",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scorer_norm" in err
    assert main(["convert", "from-official", str(official), "--out", str(tmp_path / "ours")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_parity_script_compares_a_converted_folder_with_the_official_outputs(
        tmp_path, monkeypatch):
    """experiments/official_parity.py's comparison side, fed official outputs made from this
    model itself (on the GPU they come from the official code): no error, no route flip."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "experiments"))
    import official_parity

    monkeypatch.setattr(official_parity, "LENGTHS", (50, 37))
    torch.manual_seed(3)
    model = NatsForCausalLM(config_from_official(TINY, vocab_size=40)).eval()
    save_official(model, tmp_path / "tiny" / "model")
    for dtype in ("float32", "bfloat16"):
        for t in official_parity.LENGTHS:
            ids = torch.randint(0, 40, (2, t))
            with torch.no_grad():
                out = model(ids)
            records = {"ids": ids, "logits": out.logits.float()}
            for i, routes in enumerate(out.routes):
                if routes is not None:  # routing logits two apart: no decision is a tie
                    records[f"routes{i}"] = routes.float().contiguous()
                    records[f"logits{i}"] = 2 * records[f"routes{i}"] - 1
            save_file(records, str(tmp_path / "tiny" / f"{dtype}-{t}.safetensors"))
    report = official_parity.ours_side(tmp_path, 0.05, ["tiny"])
    assert [(r["official_dtype"], r["T"]) for r in report] == [
        ("float32", 50), ("float32", 37), ("bfloat16", 50), ("bfloat16", 37)]
    for row in report:
        assert row["backend"] == "reference" and row["route_decisions"] > 0
        if row["official_dtype"] == "float32":
            assert row["max_abs_error"] == 0 and row["route_flips"] == 0
        else:  # autocast on the CPU: rounding, the scale the report sets beside it
            assert 0 < row["mean_abs_error"] < 10 * row["own_bf16_mean_abs_error"] + 1e-3


def test_value_widths_the_official_layer_reads_otherwise_are_refused():
    """The official layer's value width is int(head_dim * expand_v): 120 / 88 written as a
    float gives 119 there, so that model is refused; a ratio within rounding of a whole
    width reads back as that width here."""
    cfg = config_from_official(TINY, vocab_size=40)
    with pytest.raises(ConfigError, match=r"head_dim_v = 120 .* gives 119"):
        config_to_official(cfg.replace(head_dim_k=88, head_dim_v=120))
    assert config_from_official({**TINY, "head_dim": 88, "expand_v": 120 / 88},
                                vocab_size=40).head_dim_v == 120


@pytest.mark.parametrize("change, message", [
    ({"num_heads": "two"}, "num_heads = 'two' cannot be converted: an integer >= 1"),
    ({"num_heads": 0}, "num_heads = 0 cannot be converted: an integer >= 1"),
    ({"hidden_size": 0}, "hidden_size = 0 cannot be converted"),
    ({"head_dim": 16.5}, "head_dim = 16.5 cannot be converted: an integer"),
    ({"gdn_layers": 5}, "gdn_layers = 5 cannot be converted: a list of layer indices"),
    ({"hidden_ratio": "4", "intermediate_size": None}, "hidden_ratio = '4'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false' .* true or false"),
    ({"outputs_are_wighted": False}, "outputs_are_wighted = False"),
])
def test_official_config_fields_of_the_wrong_type_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_official({**TINY, **change}, vocab_size=40)


def test_null_official_fields_take_the_config_class_defaults():
    for key, ours, default in (("conv_size", "conv_size", 4), ("norm_eps", "norm_eps", 1e-6),
                               ("nats_block_size", "chunk_size", 64)):
        assert getattr(config_from_official({**TINY, key: None}, vocab_size=40), ours) \
            == default


def test_damaged_official_weights_and_a_stale_index_under_force(tmp_path, capsys):
    """A truncated file is a one-line error; converting over a folder that held a sharded
    save (with --force) removes its index and shards, which would win over the new file."""
    official = tmp_path / "official"
    official.mkdir()
    (official / "config.json").write_text(json.dumps(TINY))
    state = random_official_state(TINY, 40)
    save_file(state, str(official / "model.safetensors"))
    data = (official / "model.safetensors").read_bytes()
    (official / "model.safetensors").write_bytes(data[:200])
    assert main(["convert", "from-official", str(official), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors cannot be read" in err and err.count("\n") == 1
    (official / "model.safetensors").write_bytes(data)
    save_file(state, str(official / "shard-1.safetensors"))
    (official / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "shard-1.safetensors" for k in state}}))
    torch.manual_seed(3)
    model = NatsForCausalLM(config_from_official(TINY, vocab_size=40))
    model.save_pretrained(tmp_path / "ours")
    assert main(["convert", "to-official", str(tmp_path / "ours"), "--out", str(official),
                 "--force"]) == 0
    assert sorted(p.name for p in official.iterdir()) == ["config.json", "model.safetensors"]
    ids = torch.randint(0, 40, (1, 40))
    torch.testing.assert_close(model_from_official(official)(ids).logits,
                               model.eval()(ids).logits)
    assert "chunk_size 16: the official kernels assert" in capsys.readouterr().err
