"""Cost model: hand counts, brute-force visible pairs, the real cache's bytes."""

from __future__ import annotations

import itertools

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.cost_model import (
    DEFAULT_CONTEXTS,
    all_linear,
    all_softmax,
    architecture_cost,
    compare_costs,
    cost_curve,
    fractions_from_measurement,
)
from nats.kernels.reference.softmax_attention import hybrid_key_weights
from nats.softmax_fraction import LayerFraction


def _cfg(layer_types=("nats",), n_heads=1, r=2, dk=8, dv=8, chunk=16,
         linear_op="gated_deltanet") -> NatsConfig:
    return NatsConfig(vocab_size=32, d_model=32, n_layers=len(layer_types), n_heads=n_heads,
                      softmax_heads_per_head=r, head_dim_k=dk, head_dim_v=dv,
                      chunk_size=chunk, layer_types=layer_types, linear_op=linear_op)


def test_nats_layer_hand_count() -> None:
    # L=64, C=16 -> 4 full chunks; H=1, r=2 softmax heads of width 8/2=4 (k) and 4 (v); f=0.5.
    cost = architecture_cost(_cfg(), [0.5], 64)
    layer = cost.layers[0]
    # Own chunk, causal: 4 chunks x (16*17/2 = 136) pairs = 544.
    # Earlier chunks: a query of chunk c sees 16c earlier keys: 16 queries x 16 x (0+1+2+3)
    # = 1536 pairs, of which f=0.5 are softmax: 768. Total 544 + 768 = 1312 pairs.
    # Per pair: 2 heads x (4 q.k + 4 p.v multiply-adds) x 2 FLOPs = 32 FLOPs.
    assert layer.softmax_flops_per_token == 1312 * 32 / 64 == 656
    # Delta rule: 7 FLOPs x 8 x 8 state entries = 448 per token; 4 chunks finish, f*4 = 2 are
    # softmax and restore the decayed snapshot: 2 x 64 multiplies. (64*448 + 128) / 64.
    assert layer.linear_flops_per_token == (64 * 448 + 2 * 64) / 64 == 450
    # KV: f x 64 = 32 tokens x 2 heads x (4 + 4) values x 2 bytes = 1024; open chunk empty.
    assert layer.kv_cache_bytes == 32 * 2 * 8 * 2 == 1024
    # State and snapshot: 2 x 1 head x 8 x 8 x 4 bytes.
    assert layer.state_bytes == 2 * 8 * 8 * 4 == 512
    assert cost.flops_per_token == 656 + 450
    assert cost.cache_bytes == 1024 + 512


def test_partial_chunk_hand_count() -> None:
    # L=40, C=16 -> chunks of 16, 16, 8 starting at 0, 16, 32; H=2, r=1, dk=8, dv=4, f=0.25.
    layer = architecture_cost(_cfg(n_heads=2, r=1, dk=8, dv=4), [0.25], 40).layers[0]
    own = 136 + 136 + 8 * 9 // 2                     # 308
    earlier = 16 * 0 + 16 * 16 + 8 * 32              # 512 (query, earlier key) pairs
    per_pair = 2 * 2 * (8 + 4)                       # H=2 heads of (8 + 4) multiply-adds
    assert layer.softmax_flops_per_token == per_pair * (own + 0.25 * earlier) / 40
    # 2 finished chunks (the third is open): 0.25 x 2 = 0.5 expected restores of 2 x 8 x 4.
    assert layer.linear_flops_per_token == (7 * 64 * 40 + 0.5 * 64) / 40
    # KV: 0.25 x 32 finished tokens + the 8 open ones, 2 x (8 + 4) values of 2 bytes.
    assert layer.kv_cache_bytes == (8 + 8) * 24 * 2
    assert layer.state_bytes == 2 * 64 * 4


def test_softmax_and_gdn_layers_hand_count() -> None:
    cost = architecture_cost(_cfg(("softmax", "linear", "nats")), [None, 0.0, 1.0], 64)
    sm, gdn, nats = cost.layers
    # Full causal: 64*65/2 = 2080 pairs x 32 FLOPs; KV of all 64 tokens x 16 values x 2 bytes.
    assert (sm.softmax_flops_per_token, sm.linear_flops_per_token) == (2080 * 32 / 64, 0)
    assert (sm.kv_cache_bytes, sm.state_bytes, sm.softmax_fraction) == (64 * 16 * 2, 0, 1.0)
    assert (gdn.softmax_flops_per_token, gdn.linear_flops_per_token) == (0, 448)
    assert (gdn.kv_cache_bytes, gdn.state_bytes, gdn.softmax_fraction) == (0, 256, 0.0)
    # NAtS-L at f=1: the softmax layer's attention and KV, plus the linear branch.
    assert nats.softmax_flops_per_token == sm.softmax_flops_per_token
    assert nats.kv_cache_bytes == sm.kv_cache_bytes
    assert nats.linear_flops_per_token == gdn.linear_flops_per_token + 4 * 64 / 64
    assert cost.state_bytes == 256 + 512


@pytest.mark.parametrize(("linear_op", "flops_per_entry", "columns", "restores"), [
    ("gated_deltanet", 7, 8, True),          # decay 1 + read 2 + write 2 + output 2
    ("deltanet", 6, 8, False),               # no decay: read, write, output
    ("gated_linear_attention", 5, 8, True),  # no delta read: decay, write k v^T, output
    ("linear_attention", 4, 9, False),       # write and output over [v, z]: dv + 1 columns
])
def test_linear_operator_hand_count(linear_op, flops_per_entry, columns, restores) -> None:
    # L=64, C=16: 4 chunks finish, f=0.5 -> 2 softmax chunks restore the snapshot (decay
    # ops: one multiply per state entry; the others copy it). H=1, dk=8, dv=8.
    cost = architecture_cost(_cfg(("nats", "linear"), linear_op=linear_op), [0.5, None], 64)
    nats, plain = cost.layers
    entries = 8 * columns
    assert plain.linear_flops_per_token == flops_per_entry * entries
    assert nats.linear_flops_per_token == (64 * flops_per_entry * entries
                                           + restores * 2 * entries) / 64
    assert (plain.state_bytes, nats.state_bytes) == (entries * 4, 2 * entries * 4)
    # The softmax side does not depend on the operator.
    reference = architecture_cost(_cfg(("nats", "linear")), [0.5, None], 64).layers[0]
    assert nats.softmax_flops_per_token == reference.softmax_flops_per_token
    assert nats.kv_cache_bytes == reference.kv_cache_bytes


def test_operators_without_delta_rule_are_cheaper_per_token() -> None:
    def plain(op: str) -> float:
        return architecture_cost(_cfg(("linear",), dk=64, dv=64, linear_op=op), [None],
                                 4096).linear_flops_per_token

    assert plain("gated_linear_attention") < plain("deltanet") < plain("gated_deltanet")
    assert plain("linear_attention") < plain("deltanet")


def test_f0_is_within_chunk_attention_plus_linear() -> None:
    cost = architecture_cost(_cfg(("nats", "linear")), [0.0, None], 256)
    nats, gdn = cost.layers
    assert nats.softmax_flops_per_token == 32 * (256 // 16) * 136 / 256   # own chunks only
    assert nats.linear_flops_per_token == gdn.linear_flops_per_token
    assert nats.kv_cache_bytes == 0


def _pairs_formula(cfg: NatsConfig, f: float, seq_len: int) -> float:
    """Visible pairs from the model: softmax FLOPs / (2 H (dk + dv)) x L."""
    layer = architecture_cost(cfg, [f], seq_len).layers[0]
    return layer.softmax_flops_per_token * seq_len / (2 * cfg.n_heads
                                                      * (cfg.head_dim_k + cfg.head_dim_v))


def _visible_pairs(sm: list[list[int]], seq_len: int, chunk: int) -> list[int]:
    """Per head, the nonzero entries of the dense NAtS-L key mask for routes ``sm[n][h]``."""
    weights = hybrid_key_weights(torch.tensor([sm], dtype=torch.float32), seq_len, chunk)
    return (weights[0] > 0).sum((1, 2)).tolist()


@pytest.mark.parametrize("seq_len", [64, 70])
def test_brute_force_mean_over_route_patterns(seq_len: int) -> None:
    # Averaged over every pattern with k softmax chunks (of those with later queries), the
    # dense mask's visible pairs are the formula's at f = k / n.
    cfg, chunk = _cfg(), 16
    n_chunks = -(-seq_len // chunk)
    n = seq_len // chunk if seq_len % chunk else n_chunks - 1     # routes that matter
    for k in range(n + 1):
        counts = []
        for chosen in itertools.combinations(range(n), k):
            sm = [[int(c in chosen)] for c in range(n_chunks)]
            counts += _visible_pairs(sm, seq_len, chunk)
        assert sum(counts) / len(counts) == pytest.approx(_pairs_formula(cfg, k / n, seq_len),
                                                          abs=1e-9)


def test_brute_force_symmetric_patterns_per_head_and_softmax_flops() -> None:
    # A pattern symmetric under c -> N-1-c has exactly the formula's pairs; two heads with
    # different fractions cost, together, the formula at their mean fraction.
    cfg = _cfg(n_heads=2, r=2, dk=8, dv=4)
    head0, head1 = {0, 3, 4, 7}, {2, 5}                      # N = 8 chunks, L = 128
    sm = [[int(c in head0), int(c in head1)] for c in range(8)]
    pairs = _visible_pairs(sm, 128, 16)
    # Own chunks: 8 x 136 = 1088 pairs a head. Earlier softmax keys seen by the 16 queries
    # of chunks 0..7: head 0 16 x (0+16+16+16+32+48+48+48) = 3584, head 1
    # 16 x (0+0+0+16+16+16+32+32) = 1792.
    assert pairs == [1088 + 3584, 1088 + 1792]
    per_pair = 2 * 2 * (8 // 2 + 4 // 2)        # r=2 softmax heads of (4 + 2) multiply-adds
    layer = architecture_cost(cfg, [(0.5 + 0.25) / 2], 128).layers[0]
    assert layer.softmax_flops_per_token == sum(pairs) * per_pair / 128
    # All linear: own chunks only; all softmax: the full causal mask.
    assert _visible_pairs([[0, 0]] * 8, 128, 16) == [8 * 136] * 2
    assert _visible_pairs([[1, 1]] * 8, 128, 16) == [128 * 129 // 2] * 2
    for f, n_pairs in ((0.0, 8 * 136), (1.0, 128 * 129 // 2)):
        assert architecture_cost(cfg, [f], 128).layers[0].softmax_flops_per_token \
            == 2 * n_pairs * per_pair / 128


def test_monotone_in_fraction_and_context() -> None:
    cfg = _cfg(chunk=64)
    fs = [i / 8 for i in range(9)]
    for attr in ("softmax_flops_per_token", "linear_flops_per_token", "flops_per_token",
                 "kv_cache_bytes"):
        values = [getattr(architecture_cost(cfg, [f], 4096), attr) for f in fs]
        assert values == sorted(values) and values[0] < values[-1], attr
    for f in (0.0, 0.3, 1.0):
        curve = cost_curve(cfg, [f], contexts=[64 * 2**p for p in range(8)])
        for attr in ("flops_per_token", "kv_cache_bytes"):
            values = [getattr(c, attr) for c in curve]
            assert values == sorted(values), (f, attr)
        assert len({c.state_bytes for c in curve}) == 1


def test_baselines_and_curve() -> None:
    cfg = _cfg(("nats", "linear", "softmax"))
    assert all_softmax(cfg).layer_types == ("softmax",) * 3
    assert all_linear(cfg).layer_types == ("linear",) * 3
    curves = compare_costs(cfg, [0.5, None, None], contexts=(1024, 2048))
    assert set(curves) == {"model", "all-softmax", "all-linear"}
    assert [c.context_len for c in curves["model"]] == [1024, 2048]
    for model, sm, la in zip(curves["model"], curves["all-softmax"], curves["all-linear"],
                             strict=True):
        assert la.kv_cache_bytes == 0 < model.kv_cache_bytes < sm.kv_cache_bytes
        # gdn 8 x 8 x 4 bytes; NAtS-L twice that (state and snapshot); softmax none.
        assert (sm.state_bytes, la.state_bytes, model.state_bytes) == (0, 3 * 256, 512 + 256)
        assert la.flops_per_token < model.flops_per_token
    assert DEFAULT_CONTEXTS[0] == 1024 and DEFAULT_CONTEXTS[-1] == 1_048_576
    assert len(cost_curve(cfg, [0.5, None, None])) == 11
    d = curves["model"][0].to_dict()
    assert d["context_len"] == 1024 and [row["kind"] for row in d["layers"]] \
        == ["nats", "linear", "softmax"]


def test_bad_fractions_are_refused() -> None:
    cfg = _cfg(("nats", "linear"))
    with pytest.raises(ValueError, match="2 layers"):
        architecture_cost(cfg, [0.5], 64)
    with pytest.raises(ValueError, match="needs its measured fraction"):
        architecture_cost(cfg, [None, None], 64)
    with pytest.raises(ValueError, match="needs its measured fraction"):
        architecture_cost(cfg, [1.5, None], 64)
    with pytest.raises(ValueError, match="'linear'"):
        architecture_cost(cfg, [0.5, 0.5], 64)
    with pytest.raises(ValueError, match="context_len"):
        architecture_cost(cfg, [0.5, None], 0)
    assert architecture_cost(cfg, [0.5, 0.0], 64) == architecture_cost(cfg, [0.5, None], 64)


def test_fractions_from_measurement() -> None:
    cfg = _cfg(("nats", "linear", "nats"))
    measured = {0: LayerFraction(0, (40, 20), 40), 2: 0.25}
    assert fractions_from_measurement(cfg, measured) == (0.75, None, 0.25)
    with pytest.raises(ValueError, match="NAtS-L layers"):
        fractions_from_measurement(cfg, {0: 0.5})


@pytest.mark.parametrize(("seq_len", "linear_op"), [
    (64, "gated_deltanet"), (69, "gated_deltanet"), (133, "gated_deltanet"),
    (69, "deltanet"), (69, "gated_linear_attention"), (69, "linear_attention")])
def test_bytes_match_the_real_cache(seq_len: int, linear_op: str) -> None:
    # fraction_is_softmax files exactly floor(n f) of the first n chunks as softmax; with
    # f = 0.5 and an even number of finished chunks that is f n, the model's expectation.
    torch.manual_seed(0)
    cfg = _cfg(("nats", "linear", "softmax"), n_heads=2, r=2, dk=16, dv=8, linear_op=linear_op)
    model = NatsForCausalLM(cfg).eval()
    model.set_route_override(0.5)
    with torch.no_grad():
        _, cache = model.prefill(torch.randint(0, 32, (1, seq_len)))
    cost = architecture_cost(cfg, [0.5, None, None], seq_len, dtype_bytes=4)
    for layer_cache, layer in zip(cache.layers, cost.layers, strict=True):
        assert layer_cache.kv_bytes() == layer.kv_cache_bytes
        held = [getattr(layer_cache, n) for n in ("state", "snapshot") if hasattr(layer_cache, n)]
        assert sum(t.numel() * t.element_size() for t in held) == layer.state_bytes
