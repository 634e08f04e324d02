"""On a CUDA GPU: prefill and decoding on the Triton kernels equal the parallel forward,
graphed decoding and prefill equal eager ones, and prefill never waits on the GPU."""

import pytest
import torch

from nats import NatsConfig
from nats.config import LINEAR_OPS

from .models import rel_err
from .test_decoding import decode_logits
from .test_gpu_model import spread_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
def test_triton_prefill_then_decode_equals_parallel_forward(linear_op):
    """Prefill on the Triton kernels (finished chunks with routes, then the open tail from
    the snapshot) and the decode steps agree with the parallel forward, in float32."""
    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=64, layer_types=("nats", "linear"),
                     backend="triton", linear_op=linear_op)
    model = spread_model(cfg)
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        assert rel_err(decode_logits(model, ids, 200), full) < 5e-3


@pytest.mark.parametrize(("dtype", "pool"), [(torch.float32, "mean"), (torch.bfloat16, "mean"),
                                           (torch.bfloat16, "max")])
def test_graphed_decode_equals_eager_decode(dtype, pool):
    """CUDA-graph replays of the decode step give the eager steps' logits, across chunk
    ends (the closes replayed too), a growing softmax store (recaptures) and a growing
    plain KV cache; under ``scorer_pool="max"`` the replayed step keeps the running maximum
    chunks are scored by."""
    from nats.cuda_graph import GraphedDecoder

    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=3, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=16,
                     layer_types=("nats", "linear", "softmax"), backend="triton", rope=True,
                     scorer_pool=pool)
    model = spread_model(cfg, dtype)
    ids = torch.randint(0, 512, (2, 400), device="cuda")
    prompt = 37
    _, eager_cache = model.prefill(ids[:, :prompt])
    _, graph_cache = model.prefill(ids[:, :prompt])
    decoder = GraphedDecoder(model, graph_cache)
    buffers, moves = graph_cache.buffers(), 0
    for t in range(prompt, ids.shape[1]):
        want = model.decode_step(ids[:, t], eager_cache)
        got = decoder(ids[:, t])
        assert rel_err(got.float(), want.float()) < 1e-5, t
        moves += [b.data_ptr() for b in buffers] != [b.data_ptr() for b in graph_cache.buffers()]
        buffers = graph_cache.buffers()
    assert graph_cache.position == eager_cache.position == ids.shape[1]
    # One capture per plan (inside a chunk, ending one) and set of buffers, not per close.
    assert moves > 1 and decoder.captures <= 2 * (moves + 1) < (ids.shape[1] - prompt) // 16
    assert torch.equal(graph_cache.layers[0].store_chunks, eager_cache.layers[0].store_chunks)
    assert model.generate(ids[:, :prompt], 40).equal(
        model.generate(ids[:, :prompt], 40, cuda_graph=False))


def test_graphed_chunk_closes_replay_without_reading_back():
    """Once both plans are captured, steps replay, those that end a chunk included: over
    chunks the store has room for, no capture and no synchronising call (the host bounds
    how full the store is). The closes take effect: every head files each chunk."""
    from nats.cuda_graph import GraphedDecoder

    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=16, layer_types=("nats", "nats"),
                     backend="triton")
    model = spread_model(cfg, torch.bfloat16)
    model.set_route_override("softmax")
    ids = torch.randint(0, 512, (1, 16 * 32 + 16 * 5), device="cuda")
    prompt = 16 * 32  # 32 chunks filed: the store keeps room for 8 more
    with torch.no_grad():
        _, cache = model.prefill(ids[:, :prompt])
        decoder = GraphedDecoder(model, cache)
        for t in range(prompt, prompt + 32):  # captures both plans
            decoder(ids[:, t])
        assert decoder.captures == 2
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(prompt + 32, ids.shape[1]):
                decoder(ids[:, t])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert decoder.captures == 2
    assert all(layer.store_chunks.eq(32 + 5).all() for layer in cache.layers)


def test_graphed_decoding_follows_a_routes_tensor_and_a_changed_override():
    """Closes replayed from a graph follow a given routes tensor (on the GPU, where the
    graph reads it; on the CPU it is refused in one line), and a route override changed
    between steps is captured anew, not replayed stale."""
    from nats.cuda_graph import GraphedDecoder

    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=16, layer_types=("nats", "nats"),
                     backend="triton")
    model = spread_model(cfg)
    ids = torch.randint(0, 512, (2, 16 * 12), device="cuda")
    given = torch.rand(12, 4, generator=torch.Generator().manual_seed(0)) > 0.5
    prompt = 16 * 2 + 5
    model.set_route_override(given)
    _, cache = model.prefill(ids[:, :prompt])
    with pytest.raises(ValueError, match="must be on cuda"):
        GraphedDecoder(model, cache)(ids[:, prompt])
    model.set_route_override(given.cuda())
    _, eager_cache = model.prefill(ids[:, :prompt])
    _, graph_cache = model.prefill(ids[:, :prompt])
    decoder = GraphedDecoder(model, graph_cache)
    for t in range(prompt, ids.shape[1]):
        if t == 16 * 7 + 3:
            model.set_route_override(0.25)
            captures = decoder.captures
        want = model.decode_step(ids[:, t], eager_cache)
        assert rel_err(decoder(ids[:, t]).float(), want.float()) < 1e-5, t
    assert decoder.captures >= captures + 2  # both plans again, under the new override
    assert torch.equal(graph_cache.layers[0].store_chunks, eager_cache.layers[0].store_chunks)
    # The given tensor's chunks, then evenly a quarter: what both decoders filed.
    filed = given[:7].sum(0) + sum(int(c % 4 == 3) for c in range(7, 12))
    assert graph_cache.layers[0].store_chunks.tolist() == [filed.tolist()] * 2


def test_a_failed_capture_leaves_the_cache_in_step(monkeypatch):
    """The warm-up of a capture is the token's real step: when the capture after it fails,
    the host's bookkeeping still follows, so later steps are the eager ones."""
    import nats.cuda_graph
    from nats.cuda_graph import GraphedDecoder

    def failing(warm_up, record, device):
        warm_up()
        raise RuntimeError("capture failed")

    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=16, layer_types=("nats", "softmax"),
                     backend="triton")
    model = spread_model(cfg)
    ids = torch.randint(0, 512, (1, 64), device="cuda")
    _, want_cache = model.prefill(ids[:, :20])
    _, cache = model.prefill(ids[:, :20])
    decoder = GraphedDecoder(model, cache)
    for t in range(20, 31):  # inside the chunk that token 31 ends
        decoder(ids[:, t])
        model.decode_step(ids[:, t], want_cache)
    with monkeypatch.context() as m:
        m.setattr(nats.cuda_graph, "warm_then_capture", failing)
        with pytest.raises(RuntimeError, match="capture failed"):
            decoder(ids[:, 31])
    model.decode_step(ids[:, 31], want_cache)
    assert cache.position == want_cache.position == 32
    for t in range(32, 64):
        assert rel_err(decoder(ids[:, t]).float(),
                       model.decode_step(ids[:, t], want_cache).float()) < 1e-5, t


def test_prefill_makes_no_blocking_read_back():
    """A NAtS-L layer's store is sized by a count that reaches the host through a
    non-blocking copy, read once the next layer's work is queued: with torch's sync debug
    mode set to fail on a synchronising call, a whole prefill still runs, and its cache
    decodes as the parallel forward says (``test_triton_prefill_then_decode_...``)."""
    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=64,
                     layer_types=("nats", "nats", "linear", "softmax"), backend="triton")
    model = spread_model(cfg)
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    with torch.no_grad():
        want, _ = model.prefill(ids)  # compiles and tunes the kernels, which synchronises
        torch.cuda.set_sync_debug_mode("error")
        try:
            got, cache = model.prefill(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)
    assert all(int(layer.store_chunks.max()) > 0 for layer in cache.layers[:2])


def _assert_same_cache(got, want) -> None:
    """Two prompt caches hold the same state: host fields equal, tensors equal up to
    float32 rounding."""
    assert got.position == want.position and int(got.position_t) == want.position
    for a, b in zip(got.layers, want.layers, strict=True):
        assert type(a) is type(b)
        for name, x in vars(a).items():
            y = getattr(b, name)
            if not isinstance(x, torch.Tensor):
                assert x == y, name
                continue
            assert x.shape == y.shape and x.dtype == y.dtype, name
            if name.startswith("store_") and name != "store_len":  # real slots only
                real = a.store_chunks.max()
                x, y = x[:, :, :, :real], y[:, :, :, :real]
            if x.is_floating_point():
                finite = torch.isfinite(y)
                assert torch.equal(finite, torch.isfinite(x)), name
                x, y = x[finite].float(), y[finite].float()
                assert torch.equal(x, y) or rel_err(x, y) < 1e-5, name  # zeros, or none
            else:
                assert torch.equal(x, y), name


def test_graphed_prefill_equals_eager_prefill():
    """A prefill replayed from a CUDA graph gives the eager prefill's logits and cache (a
    prompt that ends inside a chunk, NAtS-L stores sized after the replay): for the prompt
    it captured, for new prompts of that shape (replayed, no capture; each cache its own
    memory, untouched by later replays), for prompts shorter than a chunk, and after a
    shape or route override changed (captured anew). Decoding from a replayed cache
    continues as from the eager one."""
    from nats.cuda_graph import GraphedPrefill

    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=3, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=16,
                     layer_types=("nats", "linear", "softmax"), backend="triton", rope=True)
    model = spread_model(cfg, torch.bfloat16)
    prefill = GraphedPrefill(model)
    ids = torch.randint(0, 512, (4, 2, 16 * 6 + 5), device="cuda")
    kept = []
    for prompt in ids[:3]:
        got_logits, got = prefill(prompt)
        want_logits, want = model.prefill(prompt)
        assert rel_err(got_logits.float(), want_logits.float()) < 1e-5
        _assert_same_cache(got, want)
        kept.append((prompt, got_logits, want_logits, got, want))
    assert prefill.captures == 1
    for prompt, got_logits, want_logits, got, want in kept:  # later replays left them
        assert rel_err(got_logits.float(), want_logits.float()) < 1e-5
        _assert_same_cache(got, want)
        for t in range(8):  # across the open chunk's end
            token = (prompt[:, -1] + t) % 512
            assert rel_err(model.decode_step(token, got).float(),
                           model.decode_step(token, want).float()) < 1e-5
    _, short = prefill(ids[3, :, :40])
    _assert_same_cache(short, model.prefill(ids[3, :, :40])[1])
    tiny = [prefill(prompt[:, :10])[1] for prompt in ids[2:]]  # no finished chunk, replayed
    for prompt, cache in zip(ids[2:], tiny, strict=True):
        _assert_same_cache(cache, model.prefill(prompt[:, :10])[1])
    model.set_route_override(0.5)
    _, half = prefill(ids[3])
    _assert_same_cache(half, model.prefill(ids[3])[1])
    assert prefill.captures == 4
    assert half.layers[0].store_chunks.eq(3).all()  # every other of 6 finished chunks


def test_graphed_prefill_of_float32_weights_under_autocast_follows_the_weights():
    """Float32 weights under bf16 autocast: the graph records the weights' casts (autocast's
    cache of them lasts one autocast block), so a replay in a later block, after the
    weights changed in place, gives the eager prefill's logits, without a new capture."""
    from nats.cuda_graph import GraphedPrefill

    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=16, layer_types=("nats", "softmax"),
                     backend="triton")
    model = spread_model(cfg)
    prefill = GraphedPrefill(model)
    ids = torch.randint(0, 512, (2, 16 * 3 + 5), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        prefill(ids)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with torch.autocast("cuda", torch.bfloat16):
        got, _ = prefill(ids)
        want, _ = model.prefill(ids)
    assert prefill.captures == 1
    assert rel_err(got.float(), want.float()) < 1e-5


def test_the_model_bench_replays_prefills_under_cuda_graph():
    """``nats bench model --cuda-graph`` times replayed prefills (one capture, in the
    warm-up), and says so in the row."""
    from nats.evaluation.model_bench import default_config, prefill_row, variant_model, variants

    config = default_config("cuda", d_model=256, n_layers=2, n_heads=2, head_dim=128,
                            vocab_size=512, fractions=(0.25,), layer_hybrid_shares=(0.5,),
                            train_lens=(), decode_contexts=(), prefill_lens=(1024,),
                            repeats=2, cuda_graph=True)
    nats_form = next(v for v in variants(config) if v.name == "nats@0.25")
    model = variant_model(nats_form, config, torch.device("cuda")).to(torch.bfloat16)
    row = prefill_row(model, config, 1024, torch.device("cuda"))
    assert row["cuda_graph"] is True and row["ms"] > 0
    assert row["softmax_fraction"] == pytest.approx(0.25, abs=0.05)
