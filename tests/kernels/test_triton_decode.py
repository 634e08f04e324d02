"""One-token decode: the reference against a direct computation, the Triton kernels
against the reference (the state update, attention over the cache, the convolution's
step, the open chunk's bookkeeping and the gates from the layer's input).

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on tiny shapes in float32
and float16; with one, in bfloat16 at the shapes of ``nats bench decode``. Kernel
outputs start as NaN, so an element a kernel fails to write shows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nats.kernels import decode, linear_gates, merge_branches, short_conv
from nats.kernels.reference import decode as ref

from .inputs import CUDA, DEVICE, check, gdr_inputs

pytestmark = pytest.mark.usefixtures("poison_outputs")

LOW = torch.bfloat16 if CUDA else torch.float16
OUTPUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
"""Both sides compute in float32; the tolerance is the rounding of the output's dtype."""


def _cache(batch: int, heads: int, r: int, capacity: int, chunk: int, d_k: int, d_v: int,
           dtype: torch.dtype, seed: int):
    """Random query, store (stale rows past each head's length filled with 1e4, which a
    read past the length would show) and open chunk."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    store_len = torch.randint(0, capacity + 1, (batch, heads), generator=gen)
    store_len[0, 0], store_len[-1, -1] = 0, capacity  # an empty head and a full one
    stale = torch.arange(capacity)[None, None, None, :, None] >= store_len[:, :, None, None, None]
    store_k = randn(batch, heads, r, capacity, d_k).masked_fill(stale, 1e4)
    store_v = randn(batch, heads, r, capacity, d_v).masked_fill(stale, 1e4)
    chunk_k, chunk_v = randn(batch, heads * r, chunk, d_k), randn(batch, heads * r, chunk, d_v)
    q = randn(batch, heads * r, d_k)
    return ([t.to(dtype) for t in (q, store_k, store_v)], store_len,
            [t.to(dtype) for t in (chunk_k, chunk_v)])


@pytest.mark.parametrize("chunk_len", [1, 5, 16])
def test_reference_attention_equals_attention_over_the_real_keys(chunk_len: int) -> None:
    """The masked reference against softmax over the concatenated real keys, head by head."""
    (q, store_k, store_v), store_len, (chunk_k, chunk_v) = _cache(2, 2, 2, 20, 16, 8, 4,
                                                                 torch.float64, chunk_len)
    got = ref.hybrid_attention_decode(q, store_k, store_v, store_len, chunk_k, chunk_v,
                                      torch.tensor([chunk_len]), 0.3)
    for b in range(2):
        for hq in range(4):
            n = int(store_len[b, hq // 2])
            keys = torch.cat([store_k[b, hq // 2, hq % 2, :n], chunk_k[b, hq, :chunk_len]])
            values = torch.cat([store_v[b, hq // 2, hq % 2, :n], chunk_v[b, hq, :chunk_len]])
            want = torch.softmax(keys @ q[b, hq] * 0.3, 0) @ values
            torch.testing.assert_close(got[b, hq], want, rtol=1e-12, atol=1e-12)


def test_reference_splits_combine_to_the_attention() -> None:
    """Splits made by hand from three groups of one head's keys, and the reference's own
    one split, combine to its attention."""
    (q, store_k, store_v), store_len, (chunk_k, chunk_v) = _cache(1, 1, 1, 30, 8, 8, 4,
                                                                 torch.float64, 3)
    store_len[:] = 30
    chunk_len = torch.tensor([6])
    want = ref.hybrid_attention_decode(q, store_k, store_v, store_len, chunk_k, chunk_v,
                                       chunk_len, 0.3)
    keys = torch.cat([store_k[0, 0, 0], chunk_k[0, 0, :6]])
    values = torch.cat([store_v[0, 0, 0], chunk_v[0, 0, :6]])
    logits = keys @ q[0, 0] * 0.3 / torch.log(torch.tensor(2.0, dtype=torch.float64))
    groups = [slice(0, 11), slice(11, 11), slice(11, 36)]  # the middle one without keys
    top = torch.stack([logits[g].max() if g.stop > g.start else torch.tensor(-torch.inf)
                       for g in groups])
    p = [torch.exp2(logits[g] - t) for g, t in zip(groups, top, strict=True)]
    splits = ref.AttentionSplits(
        top.view(1, 1, 3), torch.stack([pi.sum() for pi in p]).view(1, 1, 3),
        torch.stack([pi @ values[g] for pi, g in zip(p, groups, strict=True)]).view(1, 1, 3, 4))
    torch.testing.assert_close(ref.combine_splits(splits), want, rtol=1e-12, atol=1e-12)
    own = ref.hybrid_attention_splits(q, store_k, store_v, store_len, chunk_k, chunk_v,
                                      chunk_len, 0.3)
    torch.testing.assert_close(ref.combine_splits(own), want, rtol=1e-12, atol=1e-12)


def on_gpu(cases: list[tuple]) -> list:
    """GPU-shape cases, marked so that the GPU gate (``-m gpu``) runs them."""
    return [pytest.param(*case, marks=pytest.mark.gpu) for case in cases]


ATTENTION_CASES = [
    # batch, heads, r, capacity, chunk, Dk, Dv, chunk_len (None: no open chunk), dtype
    (2, 2, 2, 20, 16, 16, 8, 1, torch.float32),
    (1, 3, 1, 300, 32, 32, 32, 32, torch.float16),  # three store splits of 128 keys
    (1, 2, 1, 5000, 16, 16, 16, 5, torch.float32),   # splits of 256 keys
    (2, 2, 2, 64, 16, 24, 16, 9, torch.float32),     # a head width that is no power of two
    (2, 4, 1, 70, 0, 16, 16, None, torch.float16),   # a plain softmax layer's cache
    (1, 2, 1, 300, 8, 128, 128, 7, torch.float32),   # wide heads
    (1, 1, 2, 200, 8, 256, 160, 3, torch.float32),   # 64 keys per loop step
] if not CUDA else on_gpu([
    (1, 16, 2, 8192, 64, 64, 64, 37, torch.bfloat16),
    (1, 8, 1, 8192, 64, 128, 128, 50, torch.bfloat16),
    (1, 16, 1, 40_000, 0, 128, 128, None, torch.bfloat16),
    (4, 16, 2, 2048, 64, 64, 64, 64, torch.bfloat16),
    (1, 32, 1, 100_000, 0, 64, 64, None, torch.bfloat16),
])


@pytest.mark.parametrize(("batch", "heads", "r", "capacity", "chunk", "d_k", "d_v", "chunk_len",
                          "dtype"), ATTENTION_CASES)
def test_triton_attention_matches_reference(batch: int, heads: int, r: int, capacity: int,
                                            chunk: int, d_k: int, d_v: int,
                                            chunk_len: int | None, dtype: torch.dtype) -> None:
    (q, store_k, store_v), store_len, (chunk_k, chunk_v) = _cache(
        batch, heads, r, capacity, max(chunk, 1), d_k, d_v, dtype, capacity)
    if chunk_len is None:
        store_len.clamp_(min=1)  # the plain layer's own token is in its store
        chunk_k = chunk_v = None
        length = None
    else:
        length = torch.tensor([chunk_len], device=DEVICE)
    args = [t.to(DEVICE) for t in (q, store_k, store_v, store_len)]
    args += [None if t is None else t.to(DEVICE) for t in (chunk_k, chunk_v)] + [length]
    got = decode.hybrid_attention_decode(*args, 0.2, backend="triton")
    want = ref.hybrid_attention_decode(*args, 0.2)
    assert got.dtype == dtype
    check(got, want, OUTPUT_TOL[dtype], "attention")
    splits = decode.hybrid_attention_splits(*args, 0.2, backend="triton")
    assert splits.acc.shape[:2] == got.shape[:2] and splits.acc.shape[-1] == d_v
    # The splits, combined by the reference, before the output's rounding.
    check(ref.combine_splits(splits), ref.hybrid_attention_splits(*args, 0.2).acc[:, :, 0],
          1e-5, "splits")


LINEAR_CASES = [(2, 3, 16, 16, torch.float32), (1, 2, 32, 24, LOW)] if not CUDA else on_gpu([
    (1, 16, 128, 128, torch.bfloat16), (8, 16, 128, 128, torch.float32)])


@pytest.mark.parametrize("op", ["gated_deltanet", "gated_linear_attention", "linear_attention"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize(("batch", "heads", "d_k", "d_v", "dtype"), LINEAR_CASES)
def test_triton_linear_step_matches_reference(op: str, in_place: bool, batch: int, heads: int,
                                              d_k: int, d_v: int, dtype: torch.dtype) -> None:
    x = gdr_inputs(batch, 1, heads, d_k, d_v + (op == "linear_attention"),
                   dtype=torch.float32, seed=d_v)
    q, k, v = (x[n][:, 0].to(DEVICE, dtype) for n in ("q", "k", "v"))
    g, beta = (x[n][:, 0].to(DEVICE) for n in ("g", "beta"))
    # A small state, so that the token's write is a large part of the new one.
    state = 0.1 * x["initial_state"][:, :, :, : v.shape[-1] + (op == "linear_attention")]
    state = state.contiguous().to(DEVICE)
    if op == "linear_attention":
        v = v[..., :d_v]

    def run(backend: str, s: torch.Tensor):
        out = s if in_place else None
        if op == "gated_deltanet":
            return decode.gated_delta_rule_step(s, q, k, v, g, beta, 0.25, out=out,
                                                backend=backend)
        if op == "gated_linear_attention":
            return decode.gated_linear_attention_step(s, q, k, v, g, 0.25, out=out,
                                                      backend=backend)
        return decode.linear_attention_step(s, F.elu(q.float()).to(dtype), k, v, out=out,
                                            backend=backend)

    state_tri = state.clone()
    o, new = run("triton", state_tri)
    o_ref, new_ref = run("reference", state.clone())
    assert (new is state_tri) == in_place
    check(o, o_ref, 1e-5 if op != "linear_attention" else OUTPUT_TOL[dtype], "o")
    check(new, new_ref, 1e-5, "state")


def test_reference_conv_steps_reproduce_the_parallel_form() -> None:
    """Token by token, the step's outputs and window are the parallel convolution's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    window = torch.zeros(3, 3, 5, dtype=torch.float64)
    steps = [ref.short_conv_step(x[:, t], window, weight) for t in range(9)]
    torch.testing.assert_close(torch.stack(steps, 1), short_conv(x, weight))
    torch.testing.assert_close(window, x[:, -3:])


CONV_CASES = [(2, 24, 4, torch.float32), (1, 200, 4, LOW), (3, 7, 2, torch.float32),
              (2, 5, 1, LOW)] if not CUDA else on_gpu([
    (1, 2304, 4, torch.bfloat16), (4, 3072, 4, torch.bfloat16), (2, 1000, 2, torch.bfloat16),
    (1, 384, 1, torch.bfloat16)])


@pytest.mark.parametrize(("batch", "channels", "kernel_size", "dtype"), CONV_CASES)
def test_triton_conv_step_matches_reference(batch: int, channels: int, kernel_size: int,
                                            dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(channels)
    # x as one slice of a wider projection row, as a layer's step passes it.
    wide = (torch.randn(batch, 2 * channels, generator=gen) * 2).to(dtype).to(DEVICE)
    x = wide[:, channels:]
    window = torch.randn(batch, kernel_size - 1, channels, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, kernel_size, generator=gen).to(DEVICE)
    window_ref = window.clone()
    y = decode.short_conv_step(x, window, weight, backend="triton")
    y_ref = ref.short_conv_step(x, window_ref, weight)
    assert y.dtype == dtype and y.shape == x.shape
    check(y, y_ref, OUTPUT_TOL[dtype], "y")
    assert torch.equal(window, window_ref)


def _open_chunk(batch: int, hq: int, heads: int, chunk: int, d_k: int, d_v: int,
                d_model: int, dtype: torch.dtype, seed: int):
    """A token's keys and values as strided slices of a projection row, its layer input and
    log decays, and a cache's open-chunk buffers with random contents."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, to: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(to).to(DEVICE)

    row = randn(batch, hq * (2 * d_k + d_v))
    keys = row[:, hq * d_k: 2 * hq * d_k].view(batch, hq, d_k)
    values = row[:, 2 * hq * d_k:].view(batch, hq, d_v)
    token = dict(keys=keys, values=values, x=randn(batch, d_model),
                 g=randn(batch, heads, to=torch.float32))
    f32 = torch.float32
    buffers = dict(chunk_k=randn(batch, hq, chunk, d_k), chunk_v=randn(batch, hq, chunk, d_v),
                   pool_sum=randn(batch, d_model, to=f32), pool_max=randn(batch, d_model, to=f32),
                   chunk_log_decay=randn(batch, heads, to=f32),
                   open_len=torch.zeros(1, dtype=torch.long, device=DEVICE))
    return token, buffers


def test_reference_append_writes_one_slot() -> None:
    token, buffers = _open_chunk(2, 4, 2, 16, 8, 6, 10, torch.float64, 0)
    before = {k: v.clone() for k, v in buffers.items()}
    ref.append_to_open_chunk(torch.tensor(37, device=DEVICE), **token, **buffers)
    slot = 37 % 16
    for name, new in (("chunk_k", token["keys"]), ("chunk_v", token["values"])):
        want = before[name].clone()
        want[:, :, slot] = new
        assert torch.equal(buffers[name], want), name
    x = token["x"].float()  # the pool is float32
    assert torch.equal(buffers["pool_sum"], before["pool_sum"] + x)
    assert torch.equal(buffers["pool_max"], torch.maximum(before["pool_max"], x))
    assert torch.equal(buffers["chunk_log_decay"], before["chunk_log_decay"] + token["g"])
    assert buffers["open_len"].tolist() == [slot + 1]


APPEND_CASES = [(2, 4, 2, 16, 8, 8, 20, torch.float32), (1, 6, 3, 32, 16, 24, 40, LOW),
                (3, 2, 1, 64, 4, 4, 1500, LOW)] if not CUDA else on_gpu([
    (1, 12, 6, 64, 64, 64, 768, torch.bfloat16), (4, 32, 16, 64, 64, 64, 2048, torch.bfloat16),
    (2, 12, 6, 16, 64, 128, 768, torch.float32)])


@pytest.mark.parametrize("with_max", [True, False])
@pytest.mark.parametrize("position", [0, 15, 100])
@pytest.mark.parametrize(("batch", "hq", "heads", "chunk", "d_k", "d_v", "d_model", "dtype"),
                         APPEND_CASES)
def test_triton_append_matches_reference(with_max: bool, position: int, batch: int, hq: int,
                                         heads: int, chunk: int, d_k: int, d_v: int,
                                         d_model: int, dtype: torch.dtype) -> None:
    token, buffers = _open_chunk(batch, hq, heads, chunk, d_k, d_v, d_model, dtype, position)
    if not with_max:
        buffers["pool_max"] = None
    want = {k: None if v is None else v.clone() for k, v in buffers.items()}
    at = torch.tensor(position, device=DEVICE)
    decode.append_to_open_chunk(at, **token, **buffers, backend="triton")
    ref.append_to_open_chunk(at, **token, **want)
    for name, got in buffers.items():
        if got is not None:
            assert torch.equal(got, want[name]), name


def _gate_inputs(batch: int, heads: int, d_model: int, dtype: torch.dtype, seed: int):
    """A token's layer input and a layer's gate weights, the projections wide enough to
    reach softplus's threshold and its far negative side (``dt_bias`` as a layer starts)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_model, generator=gen).to(dtype).to(DEVICE)
    w_a, w_b = (torch.randn(heads, d_model, generator=gen) * scale / d_model**0.5
                for scale in (8.0, 3.0))
    a_log = torch.log(torch.linspace(1.0, 16.0, heads))
    dt_bias = torch.linspace(-7.0, -2.0, heads)
    return x, *(t.to(dtype).to(DEVICE) for t in (w_a, a_log, dt_bias, w_b))


GATES = [(True, True), (True, False), (False, True)]
"""(decay, write): Gated DeltaNet, gated linear attention, DeltaNet."""


def test_reference_gates_step_gates_the_projections() -> None:
    """The step's gates are those of the parallel form for the token's projections."""
    x, w_a, a_log, dt_bias, w_b = _gate_inputs(3, 5, 40, torch.float64, 0)
    g, beta = ref.linear_gates_step(x, w_a, a_log, dt_bias, w_b)
    g_want, beta_want = linear_gates(F.linear(x, w_a), a_log, dt_bias, F.linear(x, w_b),
                                     backend="reference")
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=0)
    torch.testing.assert_close(beta, beta_want, rtol=1e-12, atol=0)
    assert ref.linear_gates_step(x, None, None, None, w_b)[0] is None
    assert ref.linear_gates_step(x, w_a, a_log, dt_bias, None)[1] is None


GATE_STEP_CASES = [(2, 3, 40, torch.float32), (1, 5, 1500, LOW), (3, 16, 100, torch.float32),
                   ] if not CUDA else on_gpu([
    (1, 6, 768, torch.bfloat16), (4, 16, 2048, torch.bfloat16), (3, 5, 1000, torch.float32),
    (2, 32, 4096, torch.bfloat16)])


@pytest.mark.parametrize(("decay", "write"), GATES)
@pytest.mark.parametrize(("batch", "heads", "d_model", "dtype"), GATE_STEP_CASES)
def test_triton_gates_step_matches_reference(decay: bool, write: bool, batch: int, heads: int,
                                             d_model: int, dtype: torch.dtype) -> None:
    x, w_a, a_log, dt_bias, w_b = _gate_inputs(batch, heads, d_model, dtype, d_model)
    # x as one row of a wider buffer, as a layer passes x[:, 0] of [B, 1, D] or wider.
    x = torch.cat([x, x], -1)[:, d_model:]
    given = (w_a, a_log, dt_bias) if decay else (None, None, None)
    given += (w_b if write else None,)
    got = decode.linear_gates_step(x, *given, backend="triton")
    want = ref.linear_gates_step(x, *given)
    for name, out, out_ref in zip(("g", "beta"), got, want, strict=True):
        assert (out is None) == (out_ref is None), name
        if out is not None:
            assert out.dtype == torch.float32 and out.shape == (batch, heads), name
            # Both sides sum float32 products of the same inputs, in their own orders.
            check(out, out_ref, 1e-5, name)
            worst = ((out - out_ref).abs() / out_ref.abs().clamp_min(1e-30)).max().item()
            assert worst <= 1e-3, f"{name}: worst relative error {worst:.1e}"


def test_gates_step_one_line_errors() -> None:
    x, w_a, a_log, dt_bias, w_b = _gate_inputs(2, 4, 12, torch.float32, 0)
    with pytest.raises(ValueError, match=r"x \[B, D\]"):
        decode.linear_gates_step(x[:, None], w_a, a_log, dt_bias, w_b)
    with pytest.raises(ValueError, match=r"weights \[H, D\] with D = 12"):
        decode.linear_gates_step(x, w_a, a_log, dt_bias, w_b[:, :5])
    with pytest.raises(ValueError, match=r"a_log and dt_bias of shape \[4\]"):
        decode.linear_gates_step(x, w_a, a_log[:3], dt_bias, w_b)
    assert decode.linear_gates_step(x, None, None, None, None) == (None, None)


def _merge_inputs(batch: int, hq: int, d_q: int, dim: int, dtype: torch.dtype, seed: int,
                  ) -> tuple[torch.Tensor, ...]:
    """q as a strided row view of a wider buffer (a slice of the fused projection), the mix
    weight, both branches (the linear one in float32, as its step returns it) and gamma."""
    gen = torch.Generator().manual_seed(seed)
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)
    q = torch.cat([randn(batch, d_q), randn(batch, d_q)], -1)[:, d_q:].to(DEVICE, dtype)
    mix = (randn(2 * hq, d_q) * d_q**-0.5 * 3).to(DEVICE, dtype)
    a = (randn(batch, hq, dim) * 2).to(DEVICE)
    b = randn(batch, hq, dim).to(DEVICE, dtype)
    gamma = (1 + 0.3 * randn(dim)).to(DEVICE, dtype)
    return q, mix, a, b, gamma


def _splits(batch: int, hq: int, n_splits: int, dim: int, seed: int) -> ref.AttentionSplits:
    """Random attention splits, the second of each head's without keys."""
    gen = torch.Generator().manual_seed(seed)
    top = 3 * torch.randn(batch, hq, n_splits, generator=gen)
    total = 0.5 + torch.rand(batch, hq, n_splits, generator=gen)
    acc = torch.randn(batch, hq, n_splits, dim, generator=gen) * total[..., None]
    top[:, :, 1], total[:, :, 1], acc[:, :, 1] = -torch.inf, 0, 0
    return ref.AttentionSplits(*(t.to(DEVICE) for t in (top, total, acc)))


def test_reference_merge_step_merges_with_the_mix_logits() -> None:
    """The step's merge is the parallel form's for the token's mix projection."""
    q, mix, a, b, gamma = _merge_inputs(3, 4, 24, 8, torch.float64, 0)
    got = ref.merge_step(q, mix, a.double(), b, gamma, 1e-6, True, False, torch.float64)
    logits = F.linear(q, mix).view(3, 4, 2)
    want = merge_branches(a.double(), b, logits, gamma, 1e-6, True, False, torch.float64,
                          logits=True, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.softmax(logits, -1)  # written out once: the weights are a softmax per head
    torch.testing.assert_close(got[1, 2], (w[1, 2, 0] * F.rms_norm(a[1, 2].double(), (8,), eps=1e-6)
                                           + w[1, 2, 1] * b[1, 2]) * gamma,
                               rtol=1e-12, atol=1e-12)


MERGE_STEP_CASES = [(2, 3, 40, 16, torch.float32), (1, 4, 1500, 24, LOW),
                    ] if not CUDA else on_gpu([
    (1, 12, 768, 64, torch.bfloat16), (4, 24, 768, 64, torch.bfloat16),
    (2, 8, 2048, 128, torch.bfloat16), (3, 5, 1000, 40, torch.float32)])


@pytest.mark.parametrize(("norm_a", "norm_b"), [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize(("batch", "hq", "d_q", "dim", "dtype"), MERGE_STEP_CASES)
def test_triton_merge_step_matches_reference(norm_a: bool, norm_b: bool, batch: int, hq: int,
                                             d_q: int, dim: int, dtype: torch.dtype) -> None:
    q, mix, a, b, gamma = _merge_inputs(batch, hq, d_q, dim, dtype, d_q + dim)
    got = decode.merge_step(q, mix, a, b, gamma, 1e-6, norm_a, norm_b, dtype, backend="triton")
    want = ref.merge_step(q, mix, a, b, gamma, 1e-6, norm_a, norm_b, dtype)
    assert got.dtype == dtype and got.shape == (batch, hq, dim)
    # Both sides compute in float32 from the same inputs, in their own orders of summation;
    # the output is then rounded to its dtype.
    check(got, want, 1e-5 if dtype == torch.float32 else 1e-2, "y")


@pytest.mark.parametrize("norm_b", [True, False])
@pytest.mark.parametrize("n_splits", [2, 70] if not CUDA else [129])
@pytest.mark.parametrize(("batch", "hq", "d_q", "dim", "dtype"), MERGE_STEP_CASES)
def test_triton_merge_step_combines_splits_as_the_reference(
        n_splits: int, norm_b: bool, batch: int, hq: int, d_q: int, dim: int,
        dtype: torch.dtype) -> None:
    """The softmax branch as its attention's splits, more than one step of the combine's
    loop at 70 and 129."""
    q, mix, a, _, gamma = _merge_inputs(batch, hq, d_q, dim, dtype, d_q + dim)
    splits = _splits(batch, hq, n_splits, dim, n_splits)
    got = decode.merge_step(q, mix, a, splits, gamma, 1e-6, True, norm_b, dtype,
                            backend="triton")
    want = ref.merge_step(q, mix, a, splits, gamma, 1e-6, True, norm_b, dtype)
    check(got, want, 1e-5 if dtype == torch.float32 else 1e-2, "y")


SPLIT_MERGE_CASES = [
    # batch, heads, r, capacity, chunk, D, chunk_len, dtype
    (2, 2, 2, 40, 8, 12, 3, torch.float32),      # a head width that is no power of two
    (1, 3, 1, 300, 16, 16, 16, torch.float16),   # three store splits and the open chunk
] if not CUDA else on_gpu([(1, 6, 1, 8192, 64, 128, 37, torch.bfloat16),
                           (2, 8, 2, 2048, 64, 64, 64, torch.bfloat16)])


@pytest.mark.parametrize(("batch", "heads", "r", "capacity", "chunk", "dim", "chunk_len",
                          "dtype"), SPLIT_MERGE_CASES)
def test_triton_merge_step_of_the_attention_splits(batch: int, heads: int, r: int,
                                                   capacity: int, chunk: int, dim: int,
                                                   chunk_len: int, dtype: torch.dtype) -> None:
    """The decode step's chain: the Triton attention's splits (an empty head among them)
    merged by the Triton merge, against the reference's attention and merge."""
    (q, store_k, store_v), store_len, (chunk_k, chunk_v) = _cache(
        batch, heads, r, capacity, chunk, dim, dim, dtype, capacity)
    args = [t.to(DEVICE) for t in (q, store_k, store_v, store_len, chunk_k, chunk_v)]
    args += [torch.tensor([chunk_len], device=DEVICE), 0.2]
    mix_q, mix, a, _, gamma = _merge_inputs(batch, heads * r, 24, dim, dtype, dim)
    got = decode.merge_step(mix_q, mix, a, decode.hybrid_attention_splits(*args,
                                                                         backend="triton"),
                            gamma, 1e-6, True, False, dtype, backend="triton")
    want = ref.merge_step(mix_q, mix, a, ref.hybrid_attention_splits(*args), gamma, 1e-6,
                          True, False, dtype)
    check(got, want, OUTPUT_TOL[dtype], "y")


def test_merge_step_one_line_errors() -> None:
    q, mix, a, b, gamma = _merge_inputs(2, 3, 10, 4, torch.float32, 0)
    with pytest.raises(ValueError, match=r"mix_weight \[2 Hq, Dq\]"):
        decode.merge_step(q, mix[:5], a, b, gamma, 1e-6, True, False, torch.float32)
    with pytest.raises(ValueError, match=r"a and b \[B, Hq, D\]"):
        decode.merge_step(q, mix, a, b[:, :2], gamma, 1e-6, True, False, torch.float32)
    with pytest.raises(ValueError, match=r"a and b \[B, Hq, D\]"):
        decode.merge_step(q, mix, a, _splits(2, 3, 4, 5, 0), gamma, 1e-6, True, False,
                          torch.float32)
    splits = _splits(2, 3, 4, 4, 0)
    with pytest.raises(ValueError, match=r"max and total \[B, Hq, S\] and acc"):
        decode.merge_step(q, mix, a, splits._replace(max=splits.max[..., :3]), gamma, 1e-6,
                          True, False, torch.float32)
    with pytest.raises(ValueError, match="contiguous float32 or float64 splits"):
        decode.merge_step(q, mix, a, splits._replace(acc=splits.acc.transpose(0, 2)
                                                     .contiguous().transpose(0, 2)),
                          gamma, 1e-6, True, False, torch.float32)
