"""NatsConfig: validation names the field and the allowed values; dict round trip."""

import pytest

from nats import ConfigError, NatsConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"chunk_size": 48}, r"NatsConfig\.chunk_size = 48 .*one of \(16, 32, 64, 128, 256\)"),
        ({"sampler": "topk"}, r"NatsConfig\.sampler = 'topk' .*one of \('argmax', 'gumbel'\)"),
        ({"d_model": 0}, r"NatsConfig\.d_model = 0 .*positive integer"),
        ({"n_heads": 2.5}, r"NatsConfig\.n_heads = 2\.5 .*positive integer"),
        ({"reg_lambda": -1.0}, r"NatsConfig\.reg_lambda = -1\.0 .*>= 0"),
        # JSON true is a bool, which Python counts as the number 1.
        ({"reg_lambda": True}, r"NatsConfig\.reg_lambda = True .*>= 0"),
        ({"reg_lambda": float("inf")}, r"NatsConfig\.reg_lambda = inf .*>= 0"),
        ({"norm_eps": float("nan")}, r"NatsConfig\.norm_eps = nan .*positive finite"),
        ({"layer_types": ("nats", "mamba")},
         r"NatsConfig\.layer_types .*'nats', 'linear', 'softmax'"),
        ({"layer_types": ("nats",)}, r"NatsConfig\.layer_types .*n_layers=2 entries"),
        ({"head_dim_k": 30, "softmax_heads_per_head": 4},
         r"NatsConfig\.head_dim_k = 30 .*multiple of softmax_heads_per_head=4"),
        ({"backend": "cuda"}, r"NatsConfig\.backend = 'cuda' .*'auto', 'reference', 'triton'"),
        ({"linear_op": "mamba"}, r"NatsConfig\.linear_op = 'mamba' .*one of \('gated_deltanet', "
                                 r"'deltanet', 'gated_linear_attention', 'linear_attention'\)"),
        ({"linear_op": ["deltanet"]}, r"NatsConfig\.linear_op = \['deltanet'\] .*one of"),
        ({"rope": True, "head_dim_k": 6, "head_dim_v": 6, "softmax_heads_per_head": 2},
         r"NatsConfig\.rope = True .*odd"),
        # Strings that read as false in JSON would switch the feature on.
        ({"rope": "false"}, r"NatsConfig\.rope = 'false' .*true or false"),
        ({"tie_embeddings": "false"}, r"NatsConfig\.tie_embeddings = 'false' .*true or false"),
        ({"chunk_size": 16.0}, r"NatsConfig\.chunk_size = 16\.0 .*one of"),
        ({"layer_types": None}, r"NatsConfig\.layer_types = None .*a list"),
        ({"softmax_gain_init": 0.0}, r"NatsConfig\.softmax_gain_init = 0\.0 .*positive finite"),
        ({"softmax_gain_init": True}, r"NatsConfig\.softmax_gain_init = True .*positive finite"),
        ({"softmax_gain_init": float("inf")}, r"softmax_gain_init = inf .*positive finite"),
        ({"softmax_gain_init": "0.05"}, r"softmax_gain_init = '0\.05' .*positive finite"),
        ({"softmax_qkv": "separate"}, r"NatsConfig\.softmax_qkv = 'separate' .*one of "
                                      r"\('shared', 'own'\)"),
        ({"scorer_pool": "sum"}, r"NatsConfig\.scorer_pool = 'sum' .*one of "
                                 r"\('mean', 'max', 'mean_max'\)"),
    ],
)
def test_bad_values_name_the_field_and_allowed_values(changes, message):
    with pytest.raises(ConfigError, match=message):
        NatsConfig(**changes)


def test_dict_round_trip_and_unknown_keys():
    cfg = NatsConfig(layer_types=["linear", "nats"], chunk_size=64, reg_lambda=0.1)
    assert cfg.layer_types == ("linear", "nats")
    assert NatsConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown NatsConfig field\(s\) \['n_layer'\]"):
        NatsConfig.from_dict({**cfg.to_dict(), "n_layer": 3})


def test_the_old_name_of_the_linear_layer_type_loads_with_a_warning():
    """Configs saved when the plain linear layer was called "gdn" load as "linear"."""
    saved = {**NatsConfig(layer_types=["linear", "nats"]).to_dict(),
             "layer_types": ["gdn", "nats"]}
    with pytest.warns(DeprecationWarning, match="'gdn' is deprecated: use 'linear'"):
        cfg = NatsConfig.from_dict(saved)
    assert cfg.layer_types == ("linear", "nats") and cfg.layers_of("linear") == (0,)
    assert cfg.to_dict()["layer_types"] == ["linear", "nats"]
    assert cfg.to_dict()["linear_layers"] == [0]


def test_the_keys_transformers_reads_are_checked_and_dropped():
    """``save_pretrained`` writes ``model_type`` and ``architectures`` for transformers'
    Auto classes; files without them (older ones) load too."""
    cfg = NatsConfig(layer_types=["linear", "nats"])
    saved = {**cfg.to_dict(), "model_type": "nats", "architectures": ["NatsHFForCausalLM"]}
    assert NatsConfig.from_dict(saved) == NatsConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"NatsConfig\.model_type = 'llama' .*'nats'"):
        NatsConfig.from_dict({**saved, "model_type": "llama"})


def test_linear_op_round_trips_and_old_configs_load_as_gated_deltanet():
    for op in ("deltanet", "gated_linear_attention", "linear_attention"):
        cfg = NatsConfig(linear_op=op)
        assert cfg.to_dict()["linear_op"] == op
        assert NatsConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in NatsConfig().to_dict().items() if k != "linear_op"}
    assert NatsConfig.from_dict(old).linear_op == "gated_deltanet"


def test_derived_sizes():
    cfg = NatsConfig(d_model=100, mlp_ratio=2.5, head_dim_k=64, head_dim_v=32,
                     softmax_heads_per_head=4)
    assert (cfg.softmax_head_dim_k, cfg.softmax_head_dim_v) == (16, 8)
    assert cfg.mlp_hidden == 256  # 250 rounded up to a multiple of 8
