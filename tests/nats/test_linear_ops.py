"""Every ``linear_op`` in the model: decoding equals the parallel forward, causality, the
all-linear NAtS-L branch is the plain operator, gradients reach each operator's gates."""

import pytest
import torch
import torch.nn.functional as F

from nats import NatsForCausalLM
from nats.config import LINEAR_OPS
from nats.kernels import (
    gated_delta_rule_recurrent,
    gated_linear_attention_recurrent,
    hybrid_softmax_attention,
    linear_attention_recurrent,
)
from nats.layers.norms import l2_norm, rms_norm

from .models import rel_err, tiny_config, tiny_model
from .test_decoding import decode_logits

GATE_PARAMETERS = {
    "gated_deltanet": {"a_proj.weight", "b_proj.weight", "A_log", "dt_bias"},
    "deltanet": {"b_proj.weight"},
    "gated_linear_attention": {"a_proj.weight", "A_log", "dt_bias"},
    "linear_attention": set(),
}


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
@pytest.mark.parametrize(("seq_len", "prompt_len"), [(45, 20), (48, 16), (37, 1)])
def test_prefill_then_decode_equals_parallel_forward(linear_op, seq_len, prompt_len):
    model = tiny_model(("nats", "gdn"), linear_op=linear_op)
    ids = torch.randint(0, 50, (3, seq_len), generator=torch.Generator().manual_seed(seq_len))
    assert rel_err(decode_logits(model, ids, prompt_len), model(ids).logits) < 1e-12


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
@pytest.mark.parametrize("override", ["softmax", 0.25])
def test_decoding_restores_snapshots_of_softmax_chunks(linear_op, override):
    """Softmax chunks restore the snapshot (decayed by the chunk's gates, or as it is for
    operators without a decay; linear attention's normaliser column with it)."""
    model = tiny_model(("nats",), linear_op=linear_op)
    model.set_route_override(override)
    ids = torch.randint(0, 50, (2, 67), generator=torch.Generator().manual_seed(1))
    assert rel_err(decode_logits(model, ids, 10), model(ids).logits) < 1e-12


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
def test_causal(linear_op):
    model = tiny_model(("nats", "gdn"), linear_op=linear_op)
    ids = torch.randint(0, 50, (2, 50), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, 33:] = (changed[:, 33:] + 7) % 50
    a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :33], b[:, :33])
    assert not torch.allclose(a[:, 33:], b[:, 33:])


def _oracle(linear_op: str, q, k, v, g, beta) -> torch.Tensor:
    """The operator token by token (the recurrent oracles), from the layer's raw q, k, v."""
    if linear_op == "linear_attention":
        return linear_attention_recurrent(q, k, v)[0]
    q, k = l2_norm(q), l2_norm(k)
    if linear_op == "gated_linear_attention":
        return gated_linear_attention_recurrent(q, k, v, g)[0]
    if linear_op == "deltanet":
        g = torch.zeros_like(beta)
    return gated_delta_rule_recurrent(q, k, v, g, beta)[0]


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
def test_all_linear_nats_branch_is_the_plain_layers_operator(linear_op):
    """A NAtS-L layer routed all-LA and a plain linear layer with the same projections and
    gates: both linear outputs are the operator's oracle over the same q, k, v and gates."""
    torch.manual_seed(0)
    cfg = tiny_config(("nats", "gdn"), linear_op=linear_op)
    model = NatsForCausalLM(cfg).double().eval()
    nats, plain = (block.mixer for block in model.blocks)
    plain.qkv.load_state_dict(nats.qkv.state_dict())
    plain.gates.load_state_dict(nats.gates.state_dict())
    assert {n for n, _ in nats.gates.named_parameters()} == GATE_PARAMETERS[linear_op]
    nats.route_override = "linear"
    x = torch.randn(2, 40, cfg.d_model, dtype=torch.float64)
    h = cfg.n_heads
    q, k, v = (t.reshape(2, 40, h, -1) for t in nats.qkv(x))
    g = (-nats.gates.A_log.exp() * F.softplus(nats.gates.a_proj(x) + nats.gates.dt_bias)
         if "a_proj.weight" in GATE_PARAMETERS[linear_op] else None)
    beta = torch.sigmoid(nats.gates.b_proj(x)) if "b_proj.weight" in GATE_PARAMETERS[
        linear_op] else None
    o = _oracle(linear_op, q, k, v, g, beta)

    assert rel_err(plain(x)[0], plain.out(rms_norm(o, cfg.norm_eps), x)) < 1e-12
    y, routing = nats(x)
    assert routing.routes[..., 0].sum() == 0
    qs, ks, vs = nats._softmax_heads(*nats.qkv(x), 0)
    o_sm = hybrid_softmax_attention(qs, ks, vs, routing.routes, cfg.chunk_size)
    assert rel_err(y, nats._merge(nats.qkv(x)[0], o, o_sm, x)) < 1e-12


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
def test_gradients_reach_every_gate_parameter(linear_op):
    model = tiny_model(("nats", "gdn"), linear_op=linear_op).train()
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    for block in model.blocks:
        grads = {n: p.grad for n, p in block.mixer.gates.named_parameters()}
        assert set(grads) == GATE_PARAMETERS[linear_op]
        for name, grad in grads.items():
            assert grad is not None and grad.abs().sum() > 0, name
        assert block.mixer.qkv.proj.weight.grad.abs().sum() > 0


def test_gated_deltanet_state_dict_keys_are_unchanged():
    """Checkpoints saved before the operator became a choice hold these gate keys."""
    keys = set(tiny_model(("nats", "gdn")).state_dict())
    for i in (0, 1):
        assert {f"blocks.{i}.mixer.gates.{n}" for n in GATE_PARAMETERS["gated_deltanet"]} <= keys


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
def test_save_and_load_every_operator(tmp_path, linear_op):
    model = tiny_model(("nats", "gdn"), linear_op=linear_op)
    model.save_pretrained(tmp_path)
    loaded = NatsForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.linear_op == linear_op
    ids = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
