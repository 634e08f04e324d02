"""The shared tests of every registered ``linear_op`` in the model: decoding equals the
parallel forward, causality, the all-linear NAtS-L branch is the operator's token-by-token
oracle, gradients reach each operator's gates, save and load. They run on the built-in
operators and on a toy one registered here, as a new operator would be."""

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from nats import ConfigError, NatsConfig, NatsForCausalLM
from nats.config import LINEAR_OPS
from nats.kernels import hybrid_softmax_attention
from nats.kernels.linear_ops import LINEAR_OP_SPECS, register_linear_op, registered
from nats.kernels.reference.norms import l2_norm, rms_norm

from .models import rel_err, tiny_config, tiny_model
from .test_decoding import decode_logits

TOY = replace(LINEAR_OP_SPECS["gated_linear_attention"], name="toy_undecayed_linear",
              title="undecayed linear attention (a test's toy)", decays=False,
              flops_per_state_entry=4)
"""A registered operator that no module of the package names: gated linear attention's
kernels with no decay gate (so ``g = 0``: plain linear attention over unit q and k)."""
OPS = (*LINEAR_OPS, TOY.name)


@pytest.fixture(autouse=True, scope="module")
def toy_operator() -> Iterator[None]:
    with registered(TOY):
        yield


def gate_parameters(linear_op: str) -> set[str]:
    spec = LINEAR_OP_SPECS[linear_op]
    return ({"a_proj.weight", "A_log", "dt_bias"} if spec.decays else set()) | (
        {"b_proj.weight"} if spec.delta else set())


@pytest.mark.parametrize("linear_op", OPS)
@pytest.mark.parametrize(("seq_len", "prompt_len"), [(45, 20), (48, 16), (37, 1)])
def test_prefill_then_decode_equals_parallel_forward(linear_op, seq_len, prompt_len):
    model = tiny_model(("nats", "linear"), linear_op=linear_op)
    ids = torch.randint(0, 50, (3, seq_len), generator=torch.Generator().manual_seed(seq_len))
    assert rel_err(decode_logits(model, ids, prompt_len), model(ids).logits) < 1e-12


@pytest.mark.parametrize("linear_op", OPS)
@pytest.mark.parametrize("override", ["softmax", 0.25])
def test_decoding_restores_snapshots_of_softmax_chunks(linear_op, override):
    """Softmax chunks restore the snapshot (decayed by the chunk's gates, or as it is for
    operators without a decay; linear attention's normaliser column with it)."""
    model = tiny_model(("nats",), linear_op=linear_op)
    model.set_route_override(override)
    ids = torch.randint(0, 50, (2, 67), generator=torch.Generator().manual_seed(1))
    assert rel_err(decode_logits(model, ids, 10), model(ids).logits) < 1e-12


@pytest.mark.parametrize("linear_op", OPS)
def test_causal(linear_op):
    model = tiny_model(("nats", "linear"), linear_op=linear_op)
    ids = torch.randint(0, 50, (2, 50), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, 33:] = (changed[:, 33:] + 7) % 50
    a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :33], b[:, :33])
    assert not torch.allclose(a[:, 33:], b[:, 33:])


def _oracle(linear_op: str, q, k, v, g, beta) -> torch.Tensor:
    """The operator token by token (its spec's recurrent oracle), from the layer's raw q,
    k, v (gates: None where the operator has none)."""
    spec = LINEAR_OP_SPECS[linear_op]
    if not spec.normaliser:
        q, k = l2_norm(q), l2_norm(k)
    if g is None:
        g = q.new_zeros(q.shape[:3])
    return spec.recurrent(q, k, v, g, beta, q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("linear_op", OPS)
def test_all_linear_nats_branch_is_the_plain_layers_operator(linear_op):
    """A NAtS-L layer routed all-LA and a plain linear layer with the same projections and
    gates: both linear outputs are the operator's oracle over the same q, k, v and gates."""
    torch.manual_seed(0)
    cfg = tiny_config(("nats", "linear"), linear_op=linear_op)
    model = NatsForCausalLM(cfg).double().eval()
    nats, plain = (block.mixer for block in model.blocks)
    plain.qkv.load_state_dict(nats.qkv.state_dict())
    plain.gates.load_state_dict(nats.gates.state_dict())
    assert {n for n, _ in nats.gates.named_parameters()} == gate_parameters(linear_op)
    nats.route_override = "linear"
    x = torch.randn(2, 40, cfg.d_model, dtype=torch.float64)
    h = cfg.n_heads
    q, k, v = (t.reshape(2, 40, h, -1) for t in nats.qkv(x))
    g = (-nats.gates.A_log.exp() * F.softplus(nats.gates.a_proj(x) + nats.gates.dt_bias)
         if "a_proj.weight" in gate_parameters(linear_op) else None)
    beta = (torch.sigmoid(nats.gates.b_proj(x))
            if "b_proj.weight" in gate_parameters(linear_op) else None)
    o = _oracle(linear_op, q, k, v, g, beta)

    assert rel_err(plain(x)[0], plain.out(rms_norm(o, eps=cfg.norm_eps), x)) < 1e-12
    y, routing = nats(x)
    assert routing.routes[..., 0].sum() == 0
    qs, ks, vs = nats._softmax_heads(nats.qkv(x), 0)
    o_sm = hybrid_softmax_attention(qs, ks, vs, routing.routes, cfg.chunk_size)
    assert rel_err(y, nats._merge(nats.qkv(x)[0], o, o_sm, x)) < 1e-12


@pytest.mark.parametrize("linear_op", OPS)
def test_gradients_reach_every_gate_parameter(linear_op):
    model = tiny_model(("nats", "linear"), linear_op=linear_op).train()
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    for block in model.blocks:
        grads = {n: p.grad for n, p in block.mixer.gates.named_parameters()}
        assert set(grads) == gate_parameters(linear_op)
        for name, grad in grads.items():
            assert grad is not None and grad.abs().sum() > 0, name
        assert block.mixer.qkv.proj.weight.grad.abs().sum() > 0


def test_gated_deltanet_state_dict_keys_are_unchanged():
    """Checkpoints saved before the operator became a choice hold these gate keys."""
    keys = set(tiny_model(("nats", "linear")).state_dict())
    for i in (0, 1):
        assert {f"blocks.{i}.mixer.gates.{n}" for n in gate_parameters("gated_deltanet")} <= keys


@pytest.mark.parametrize("linear_op", OPS)
def test_save_and_load_every_operator(tmp_path, linear_op):
    model = tiny_model(("nats", "linear"), linear_op=linear_op)
    model.save_pretrained(tmp_path)
    loaded = NatsForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.linear_op == linear_op
    ids = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_registry_names_each_operator_once_and_config_reads_it() -> None:
    assert TOY.name in LINEAR_OP_SPECS and TOY.name not in LINEAR_OPS  # built-ins only
    assert NatsConfig(linear_op=TOY.name).linear_op_name == TOY.title
    with pytest.raises(ValueError, match="already registered"):
        register_linear_op(TOY)
    with pytest.raises(ConfigError, match=TOY.name):  # the message lists the registry
        NatsConfig(linear_op="mamba")


def test_the_toy_operator_costs_what_its_spec_says() -> None:
    from nats.cost_model import architecture_cost

    toy, gla = (tiny_config(("linear",), linear_op=op)
                for op in (TOY.name, "gated_linear_attention"))
    toy_flops = architecture_cost(toy, [0.0], 4096).flops_per_token
    gla_flops = architecture_cost(gla, [0.0], 4096).flops_per_token
    assert toy_flops / gla_flops == pytest.approx(4 / 5)
