"""Measured softmax fraction: token-weighted counts, exact all-softmax / all-linear."""

from __future__ import annotations

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.softmax_fraction import (
    LayerFraction,
    chunk_token_counts,
    measure_softmax_fraction,
    softmax_token_counts,
)

from ..routes import routes_from_choices


def _model(layer_types=("nats", "linear", "nats")) -> NatsForCausalLM:
    torch.manual_seed(0)
    return NatsForCausalLM(NatsConfig(vocab_size=40, d_model=32, n_layers=len(layer_types),
                                      n_heads=2, softmax_heads_per_head=2, head_dim_k=16,
                                      head_dim_v=16, chunk_size=16, layer_types=layer_types))


def test_chunks_count_their_tokens_and_the_last_may_be_partial() -> None:
    assert chunk_token_counts(40, 16).tolist() == [16, 16, 8]
    assert chunk_token_counts(32, 16).tolist() == [16, 16]
    routes = routes_from_choices([[[1, 0], [0, 0], [1, 1]],      # sequence 0: chunks x heads
                      [[0, 0], [1, 0], [0, 1]]])     # sequence 1
    assert softmax_token_counts(routes, 40, 16).tolist() == [16 + 8 + 16, 8 + 8]
    with pytest.raises(ValueError, match="routes cover 3 chunks"):
        softmax_token_counts(routes, 64, 16)


def test_fraction_kind_is_exact() -> None:
    f = LayerFraction(layer=2, softmax_tokens=(40, 20), tokens=40)
    assert f.per_head == (1.0, 0.5) and f.overall == 0.75 and f.kind == "mixed"
    assert LayerFraction(0, (40, 40), 40).kind == "all-softmax"
    assert LayerFraction(0, (0, 0), 40).kind == "all-linear"
    assert LayerFraction(0, (0, 1), 40).kind == "mixed"


@pytest.mark.parametrize(("override", "per_head", "kind"), [
    ("softmax", (1.0, 1.0), "all-softmax"),
    ("linear", (0.0, 0.0), "all-linear"),
    (0.5, (0.4, 0.4), "mixed"),  # chunk 1 of 16, 16, 8 tokens: 16 / 40
    # Only the partial last chunk of head 0: 8 of 40 tokens, though 1 of 3 chunks.
    (torch.tensor([[0, 0], [0, 0], [1, 0]]), (0.2, 0.0), "mixed"),
])
def test_measured_on_forced_routes(override, per_head, kind) -> None:
    model = _model().train()
    model.set_route_override(override)
    batches = [torch.randint(0, 40, (2, 40)), (torch.randint(0, 40, (3, 40)), None)]
    got = measure_softmax_fraction(model, batches)
    assert sorted(got) == [0, 2]  # the Gated DeltaNet layer has no routes
    for i, f in got.items():
        assert f.layer == i and f.tokens == 5 * 40
        assert f.per_head == pytest.approx(per_head) and f.kind == kind
    assert model.training  # the mode is restored


def test_free_routes_match_the_forward_and_no_batches_is_an_error() -> None:
    model = _model(("nats",))
    with torch.no_grad():
        model.nats_layers[0].scorer.proj.weight.normal_(0, 1.0)  # both routes occur
    for length in (64, 41):  # whole chunks, and a last chunk of 9 tokens
        ids = torch.randint(0, 40, (4, length))
        got = measure_softmax_fraction(model, [ids])[0]
        out = model.eval()(ids)
        frac = out.attn_frac[0]
        assert list(got.per_head) == pytest.approx(frac.tolist())
        # Independently: spread each chunk's route over its tokens, cut at the length.
        c = model.config.chunk_size
        per_token = out.routes[0][..., 0].double().repeat_interleave(c, 1)[:, :length]
        assert frac.tolist() == pytest.approx(per_token.mean((0, 1)).tolist())
    with pytest.raises(ValueError, match="at least one batch"):
        measure_softmax_fraction(model, [])
