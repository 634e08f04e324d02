"""Prefill followed by token-by-token decoding equals the parallel forward (NATSL.md)."""

import pytest
import torch

from .models import rel_err, tiny_model

LAYER_MIXES = [("nats", "nats"), ("linear", "linear"), ("softmax", "softmax"),
               ("nats", "linear", "softmax")]


def decode_logits(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    logits, cache = model.prefill(ids[:, :prompt_len])
    steps = [model.decode_step(ids[:, t], cache)[:, None] for t in range(prompt_len, ids.shape[1])]
    assert cache.position == ids.shape[1]
    return torch.cat([logits, *steps], 1)


@pytest.mark.parametrize("layer_types", LAYER_MIXES, ids="-".join)
@pytest.mark.parametrize(("seq_len", "prompt_len"), [(45, 20), (48, 16), (37, 1), (70, 33)])
def test_prefill_then_decode_equals_parallel_forward(layer_types, seq_len, prompt_len):
    model = tiny_model(layer_types, rope=True)
    ids = torch.randint(0, 50, (3, seq_len), generator=torch.Generator().manual_seed(seq_len))
    full = model(ids).logits
    assert rel_err(decode_logits(model, ids, prompt_len), full) < 1e-12


@pytest.mark.parametrize(("seq_len", "prompt_len"), [(45, 20), (70, 33)])
def test_decoding_with_the_softmax_branchs_own_qkv(seq_len, prompt_len):
    """``softmax_qkv="own"``: the one convolution window carries both branches' q/k/v."""
    model = tiny_model(("nats", "nats"), rope=True, softmax_qkv="own")
    ids = torch.randint(0, 50, (3, seq_len), generator=torch.Generator().manual_seed(seq_len))
    full = model(ids).logits
    assert rel_err(decode_logits(model, ids, prompt_len), full) < 1e-12


@pytest.mark.parametrize("pool", ["mean", "max", "mean_max"])
@pytest.mark.parametrize(("seq_len", "prompt_len"), [(45, 20), (48, 16), (37, 1)])
def test_decoding_scores_chunks_by_their_running_pool(pool, seq_len, prompt_len):
    """``scorer_pool``: the decode cache's running sum (and maximum), started from the
    prompt's open chunk (empty at 48 / 16), routes as the parallel form's pool."""
    model = tiny_model(("nats", "nats"), rope=True, scorer_pool=pool)
    ids = torch.randint(0, 50, (3, seq_len), generator=torch.Generator().manual_seed(seq_len))
    full = model(ids)
    routes = torch.cat([r.flatten() for r in full.routes if r is not None])
    assert 0 < routes.mean() < 1  # both routes occur, so the pool decides something
    assert rel_err(decode_logits(model, ids, prompt_len), full.logits) < 1e-12


@pytest.mark.parametrize(("branch_norm", "r", "output_gate", "branch_gamma"),
                         [("both", 2, "silu", False), ("linear", 1, "none", False),
                          ("none", 4, "silu", False), ("both", 2, "none", True)])
def test_decoding_merges_as_the_parallel_form(branch_norm, r, output_gate, branch_gamma):
    """A step's merge (its mix logits inside the merge's launch, or the parallel form's
    merge where each branch has its own weight) over the merge's settings."""
    model = tiny_model(("nats", "nats"), rope=True, branch_norm=branch_norm,
                       softmax_heads_per_head=r, output_gate=output_gate,
                       branch_gamma=branch_gamma)
    if branch_gamma:
        with torch.no_grad():
            for layer in model.nats_layers:
                layer.softmax_gamma.uniform_(0.5, 1.5)
    ids = torch.randint(0, 50, (3, 45), generator=torch.Generator().manual_seed(r))
    assert rel_err(decode_logits(model, ids, 20), model(ids).logits) < 1e-12


@pytest.mark.parametrize("gain", [None, 0.3])
def test_decoding_divides_by_the_trained_softmax_scale(gain):
    """``branch_norm="scaled"``: decoding reads the running RMS a training step set (and
    each head's learned gain, ``softmax_gain_init``)."""
    model = tiny_model(("nats", "nats"), branch_norm="scaled", softmax_gain_init=gain)
    if gain is not None:
        with torch.no_grad():
            for layer in model.nats_layers:
                layer.softmax_gain.uniform_(-2.0, 2.0)
    ids = torch.randint(0, 50, (3, 53), generator=torch.Generator().manual_seed(3))
    model.train()
    model(ids)
    model.update_routing_statistics()
    model.eval()
    scales = [layer.softmax_scale.running_mean for layer in model.nats_layers]
    assert all(((s - 1).abs() > 1e-3).all() for s in scales)  # moved from the initial 1
    assert rel_err(decode_logits(model, ids, 21), model(ids).logits) < 1e-12


@pytest.mark.parametrize("override", ["softmax", "linear", 0.25])
def test_decoding_follows_forced_routes(override):
    model = tiny_model(("nats", "nats"))
    model.set_route_override(override)
    ids = torch.randint(0, 50, (2, 67), generator=torch.Generator().manual_seed(1))
    assert rel_err(decode_logits(model, ids, 10), model(ids).logits) < 1e-12


def test_decoding_follows_a_routes_tensor_and_stops_where_it_ends():
    """A given routes tensor decides the chunks decoding closes too; the step that would
    close a chunk it does not cover raises before it changes the cache (a graphed step
    could not check it, so the host does, before every step)."""
    model = tiny_model(("nats", "nats"))
    given = torch.rand(5, 2, generator=torch.Generator().manual_seed(6)) > 0.5
    model.set_route_override(given)
    ids = torch.randint(0, 50, (2, 16 * 5), generator=torch.Generator().manual_seed(7))
    full = model(ids).logits
    assert rel_err(decode_logits(model, ids, 9), full) < 1e-12
    _, cache = model.prefill(ids)
    for t in range(15):  # into the sixth chunk, which only its last token closes
        model.decode_step(ids[:, t], cache)
    state = [t.clone() for t in cache.buffers()]
    with pytest.raises(ValueError, match="covers 5 chunks; the input needs 6"):
        model.decode_step(ids[:, 0], cache)
    assert cache.position == 16 * 5 + 15
    assert all(torch.equal(a, b) for a, b in zip(state, cache.buffers(), strict=True))


def test_float32_decode_within_rounding():
    model = tiny_model(("nats", "linear"), dtype=torch.float32)
    ids = torch.randint(0, 50, (2, 50), generator=torch.Generator().manual_seed(2))
    assert rel_err(decode_logits(model, ids, 7), model(ids).logits) < 1e-4


def test_kv_cache_holds_only_softmax_chunks():
    """KV memory follows the softmax fraction: 16 finished chunks, a quarter softmax."""
    model = tiny_model(("nats",))
    ids = torch.randint(0, 50, (1, 16 * 16), generator=torch.Generator().manual_seed(3))
    sizes, softmax_chunks = {}, {"softmax": 16, 0.25: 4, "linear": 0}
    for override in softmax_chunks:
        model.set_route_override(override)
        _, cache = model.prefill(ids)
        layer = cache.layers[0]
        sizes[override] = layer.kv_bytes()
        assert layer.store_chunks.tolist() == [[softmax_chunks[override]] * 2]
    # keys and values: 2 routing heads x chunks x 16 tokens x 2 x 8 channels x (k + v) x 8 bytes
    per_chunk = 2 * 16 * 2 * 8 * 2 * 8
    assert sizes == {"softmax": 16 * per_chunk, 0.25: 4 * per_chunk, "linear": 0}


@pytest.mark.parametrize("override", ["softmax", 0.25])
def test_the_store_has_room_for_the_chunks_after_the_prompt(override):
    """A store filled by the prompt would move at the next chunk's close, and a graphed
    decoder would capture its step again (what cost NAtS-L ~1 ms per token in short
    decode benchmarks); the store keeps room, as the softmax layer's cache does."""
    model = tiny_model(("nats",))
    model.set_route_override(override)
    ids = torch.randint(0, 50, (1, 16 * 16 + 16), generator=torch.Generator().manual_seed(5))
    _, cache = model.prefill(ids[:, :16 * 16])
    buffers = [t.data_ptr() for t in cache.buffers()]
    for t in range(16 * 16, ids.shape[1]):  # one more chunk, closed by its last token
        model.decode_step(ids[:, t], cache)
    if override == "softmax":  # the closed chunk claimed a slot past the prompt's
        assert cache.layers[0].store_chunks.tolist() == [[17, 17]]
    assert [t.data_ptr() for t in cache.buffers()] == buffers


def test_greedy_generate_equals_repeated_full_forward():
    model = tiny_model(("nats", "linear", "softmax"))
    prompt = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, max_new_tokens=25)
    expected = prompt
    for _ in range(25):  # the slow, obvious way: rerun the whole sequence each time
        expected = torch.cat([expected, model(expected).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, expected)


def test_generate_in_training_leaves_the_routing_statistics():
    """A model mid-training generates as in evaluation (argmax routes) and its routing
    statistics, pending or running, are as they were; it is still training after."""
    model = tiny_model(("nats", "nats"), branch_norm="scaled")
    prompt = torch.randint(0, 50, (2, 45), generator=torch.Generator().manual_seed(6))
    expected = model.eval().generate(prompt, 9)
    model.train()
    model(prompt)  # a training forward: its sums wait for the next optimizer step
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = [m for m in model.modules() if getattr(m, "pending", None) is not None]
    pending = [m.pending.clone() for m in stats]
    assert pending and all(p[0] > 0 for p in pending)
    assert torch.equal(model.generate(prompt, 9), expected)
    assert model.training
    assert all(torch.equal(m.pending, p) for m, p in zip(stats, pending, strict=True))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sampling_is_reproducible_and_respects_top_k():
    model = tiny_model(("nats",))
    prompt = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(5))

    def sample(seed: int, top_k: int | None) -> torch.Tensor:
        return model.generate(prompt, 20, do_sample=True, top_k=top_k,
                              generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(0, None), sample(0, None))
    assert not torch.equal(sample(0, None), sample(1, None))
    assert torch.equal(sample(7, 1), model.generate(prompt, 20))  # top-1 sampling is greedy


def test_a_tiny_temperature_samples_the_argmax():
    """Scaled after the shift to a maximum of 0: a tiny temperature is greedy, not NaN."""
    model = tiny_model(("nats",))
    prompt = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(2))
    for temperature in (1e-40, 1e-50, 5e-324):  # below float32's smallest: 0 there
        assert torch.equal(model.generate(prompt, 6, do_sample=True, temperature=temperature,
                                          generator=torch.Generator().manual_seed(0)),
                           model.generate(prompt, 6))


def test_generated_ids_stay_below_the_vocab_limit():
    """A tokenizer smaller than the model's vocabulary can decode everything generated,
    greedy or sampled, also where the model prefers the ids past it."""
    from nats.trainers import generate_text
    from nats.trainers.tokenization import ByteTokenizer

    model = tiny_model(("nats",), dtype=torch.float32, vocab_size=300)
    with torch.no_grad():
        model.lm_head.weight[256:] *= 50  # ids past the bytes' dominate the logits
    prompt = torch.tensor([list(b"abc")])
    assert (model.generate(prompt, 20)[0, 3:] >= 256).any()  # the limit matters here
    for sampling in ({}, {"do_sample": True, "generator": torch.Generator().manual_seed(1)}):
        out = model.generate(prompt, 20, vocab_limit=256, **sampling)[0, 3:]
        assert out.max() < 256 and len(out) == 20
    text = generate_text(model, "abc", 20, do_sample=True,
                         generator=torch.Generator().manual_seed(1))
    assert text == ByteTokenizer().decode(
        model.generate(prompt, 20, vocab_limit=256, do_sample=True,
                       generator=torch.Generator().manual_seed(1))[0, 3:].tolist())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.0}, "temperature must be a finite number > 0, got 0.0"),
    ({"temperature": float("nan")}, "temperature must be a finite number > 0, got nan"),
    ({"top_k": 0}, "top_k must be an integer >= 1 or None, got 0"),
    ({"vocab_limit": 51}, r"vocab_limit must be an integer in \[1, 50\]"),
    ({"max_prompt_tokens": -3}, "max_prompt_tokens must be an integer >= 1 or None, got -3"),
    ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
])
def test_generate_checks_its_settings_before_any_work(kwargs, message, monkeypatch):
    """Whether or not it samples: a setting no token could be generated with is refused
    before the prefill runs, and also with no token to generate."""
    model = tiny_model(("nats",))

    def no_prefill(*_):
        raise AssertionError("the prefill ran")

    monkeypatch.setattr(model, "prefill", no_prefill)
    new = kwargs.pop("max_new_tokens", 2)  # tokens to generate: the prefill would run
    for do_sample in (False, True):
        for tokens in {new, 0} if new > 0 else {new}:
            with pytest.raises(ValueError, match=message):
                model.generate(torch.zeros(1, 2, dtype=torch.long), tokens,
                               do_sample=do_sample, **kwargs)


def test_generate_rejects_bad_arguments():
    model = tiny_model(("nats",))
    with pytest.raises(ValueError, match="non-empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="5 tokens, more than the limit of 4"):
        model.generate(torch.zeros(1, 5, dtype=torch.long), 3, max_prompt_tokens=4)
    assert model.generate(torch.zeros(1, 4, dtype=torch.long), 3, max_prompt_tokens=4).shape \
        == (1, 7)


def test_nan_weights_are_reported_not_decoded():
    model = tiny_model(("nats", "linear"))
    prompt = torch.zeros(1, 4, dtype=torch.long)
    assert model.generate(prompt, 3).shape == (1, 7)
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="logits are not finite"):
        model.generate(prompt, 3)


def test_graphed_decoding_needs_a_gpu():
    from nats.cuda_graph import GraphedDecoder

    model = tiny_model(("nats",))
    _, cache = model.prefill(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="needs the model and its cache on a GPU"):
        GraphedDecoder(model, cache)


def test_graphed_prefill_needs_a_gpu_and_eval_mode():
    from nats.cuda_graph import GraphedPrefill

    model = tiny_model(("nats",))
    with pytest.raises(ValueError, match="needs the model and the prompt on a GPU"):
        GraphedPrefill(model)(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"eval mode: call model.eval\(\) first"):
        GraphedPrefill(model.train())(torch.zeros(1, 3, dtype=torch.long))


def test_a_graphed_prefill_sees_every_tensor_it_reads_move():
    """A graphed prefill replays only while every parameter and buffer it captured stays
    where it was: its check covers the tensors ``parameters()`` and ``buffers()`` reach,
    holds while they change in place, and sees a tensor's data moved, a parameter, buffer
    or submodule replaced, and a submodule added."""
    from torch import nn

    from nats.cuda_graph import GraphedPrefill, _module_tensors

    def walks_agree() -> bool:
        reached = {id(t) for t in (*model.parameters(), *model.buffers())}
        return {id(t) for t in _module_tensors(model)} == reached

    model = tiny_model(("nats", "linear", "softmax"), tie_embeddings=True)
    assert walks_agree()
    prefill = GraphedPrefill(model)
    bound = prefill._bound_to()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    assert prefill._bound_to() == bound
    block = model.blocks[0]
    weight = block.mixer_norm.weight
    changes = [
        lambda: setattr(weight, "data", weight.data.clone()),
        lambda: setattr(block.mixer_norm, "weight", nn.Parameter(weight.detach().clone())),
        lambda: setattr(block.mixer.scorer, "proj", nn.Linear(block.mixer.scorer.proj.in_features,
                                                             block.mixer.scorer.proj.out_features,
                                                             bias=False)),
        lambda: block.mixer.register_buffer("extra", torch.zeros(3)),
        lambda: setattr(block.mixer, "extra", torch.ones(3)),
        lambda: setattr(block, "extra", nn.Linear(2, 2)),
    ]
    for change in changes:
        change()
        assert prefill._bound_to() != bound
        bound = prefill._bound_to()
    assert walks_agree()


@pytest.mark.parametrize("layer_types", [("nats", "linear", "softmax"), ("nats", "nats")])
@pytest.mark.parametrize("chunks", [3.25, 2, 0.5], ids=["tail", "whole-chunks", "no-chunk"])
def test_a_prefill_finished_by_the_caller_equals_prefill(layer_types, chunks):
    """The prefill's layer work with the NAtS-L caches left as finishers, finished by the
    caller afterwards (as a replayed CUDA graph's are), gives ``prefill``'s logits and
    cache, for prompts with an open tail, of whole chunks and shorter than a chunk; the
    finishers may be called again, as after each replay. An owned cache (``own``, as
    :class:`GraphedPrefill` takes it) is equal and shares no memory with the prefill's."""
    model = tiny_model(layer_types)
    ids = torch.randint(0, model.config.vocab_size, (2, int(chunks * model.config.chunk_size)))
    want_logits, want = model.prefill(ids)
    logits, pending = model.prefill_compute(ids, finish=False)
    assert any(callable(p) for p in pending)
    assert torch.equal(logits, want_logits)
    base = model.prompt_cache(pending, ids)  # alive: its memory is not reused below
    shared = {t.untyped_storage().data_ptr() for layer in base.layers for t in layer.buffers()}
    for own in (False, False, True, True):
        got = model.prompt_cache(pending, ids, own=own)
        assert got.position == want.position
        for a, b in zip(got.layers, want.layers, strict=True):
            assert type(a) is type(b)
            for name, x in vars(a).items():
                y = getattr(b, name)
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name
                if own and isinstance(x, torch.Tensor):
                    assert x.untyped_storage().data_ptr() not in shared, name


@pytest.mark.parametrize("pool", ["mean", "max"])
def test_decode_steps_on_the_triton_kernels_match_the_reference(pool):
    """Interpreted on the CPU: the decode step's own kernels (convolution step, gates, the
    open chunk's bookkeeping, attention over the cache) give the reference backend's logits
    across chunk ends, for every layer kind."""
    layers = ("nats", "linear", "softmax")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {backend: tiny_model(layers, dtype=torch.float32, scorer_pool=pool,
                                  backend=backend).to(device)
              for backend in ("reference", "triton")}
    ids = torch.randint(0, 50, (2, 36), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        # One prefill for both: the kernels under test are the steps'.
        caches = {backend: models["reference"].prefill(ids[:, :13])[1] for backend in models}
        for t in range(13, 36):
            want = models["reference"].decode_step(ids[:, t], caches["reference"])
            got = models["triton"].decode_step(ids[:, t], caches["triton"])
            assert rel_err(got, want) < 1e-5, t
