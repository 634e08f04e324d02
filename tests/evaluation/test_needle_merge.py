"""``experiments/needle_merge.py``: each row changes what its docstring says and nothing else,
and every patch is undone after the run (the study's conclusions rest on both)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nats import NatsForCausalLM
from nats.layers import nats_attention
from nats.model import next_token_cross_entropy
from nats.trainers.data import build_batches
from nats.trainers.distributed import World
from nats.trainers.step import records_graph

# The script's folder, as the scripts put it on the path themselves.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import needle_merge


def _model_and_batch(tmp_path: Path, layer: str = "nats"):
    cfg = needle_merge.config(0, layer, tmp_path).replace(batch_size=2)
    torch.manual_seed(0)
    model = NatsForCausalLM(cfg.model)
    model.set_route_override("softmax")
    return model, build_batches(cfg).train(0)


def _qkv_grads(model: NatsForCausalLM, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids, labels = batch
    model.zero_grad()
    logits = model(ids).logits
    next_token_cross_entropy(logits, labels).backward()
    return logits.detach(), [b.mixer.qkv.proj.weight.grad.clone() for b in model.blocks]


def test_detach_keeps_the_forward_and_drops_only_the_linear_gradient(tmp_path: Path) -> None:
    model, batch = _model_and_batch(tmp_path)
    logits, grads = _qkv_grads(model, batch)
    merge = nats_attention.NatsAttention._merge
    try:  # independent of the script: the softmax branch's gradient alone
        nats_attention.NatsAttention._merge = (
            lambda self, q, o_la, o_sm, x: merge(self, q, o_la.detach(), o_sm, x))
        want_logits, want = _qkv_grads(model, batch)
    finally:
        nats_attention.NatsAttention._merge = merge
    with needle_merge._row_patches("detach", 100):
        got_logits, got = _qkv_grads(model, batch)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=0)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    for g, w, full in zip(got, want, grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert (g - full).abs().max() > 1e-6 * full.abs().max()  # the linear path is gone


def test_direct_merge_with_a_softmax_layers_weights_is_that_layer(tmp_path: Path) -> None:
    nats_model, batch = _model_and_batch(tmp_path)
    softmax_model, _ = _model_and_batch(tmp_path, "softmax")
    names = {n.replace("mixer.out.weight", "mixer.out.out.weight"): p
             for n, p in softmax_model.named_parameters()}
    nats_params = dict(nats_model.named_parameters())
    with torch.no_grad():
        for name, p in names.items():
            nats_params[name].copy_(p)
    with needle_merge._row_patches("direct", 100):
        got = nats_model(batch[0]).logits
    torch.testing.assert_close(got, softmax_model(batch[0]).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row", ["own-qk", "own-qkv", "routed-own-qkv-anneal", "routed-detach-half",
                                 "half", "routed-plus-qkv"])
def test_every_patch_is_undone(row: str, tmp_path: Path) -> None:
    cls = nats_attention.NatsAttention
    before = {n: getattr(cls, n) for n in ("__init__", "forward", "_softmax_heads",
                                           "_shares_qk_norms", "_merge")}
    hook = needle_merge.loop.set_exploration
    with needle_merge._row_patches(row, 100):
        model, batch = _model_and_batch(tmp_path)
        model(batch[0])
    assert {n: getattr(cls, n) for n in before} == before
    assert needle_merge.loop.set_exploration is hook


def test_own_projection_feeds_the_softmax_heads_only(tmp_path: Path) -> None:
    with needle_merge._row_patches("own-qk", 100):
        model, batch = _model_and_batch(tmp_path)
        ids, labels = batch
        next_token_cross_entropy(model(ids).logits, labels).backward()
    for block in model.blocks:
        own = block.mixer.softmax_qk.proj.weight
        assert own.shape[0] == 2 * model.config.n_heads * model.config.head_dim_k
        assert own.grad is not None and own.grad.abs().max() > 0


def test_own_qkv_row_is_the_config_field_softmax_qkv_own(tmp_path: Path) -> None:
    """The study's patch (a second projection) and ``NatsConfig.softmax_qkv="own"`` (one
    projection of twice the rows) compute the same model from the same weights."""
    with needle_merge._row_patches("own-qkv", 100):
        patched, batch = _model_and_batch(tmp_path)
        want = patched(batch[0]).logits
    cfg = patched.config.replace(softmax_qkv="own")
    model = NatsForCausalLM(cfg)
    model.set_route_override("softmax")
    state = patched.state_dict()
    for i in range(cfg.n_layers):
        prefix = f"blocks.{i}.mixer."
        for part in ("proj", "conv"):
            shared, own = (state.pop(f"{prefix}{name}.{part}.weight")
                           for name in ("qkv", "softmax_qk"))
            state[f"{prefix}qkv.{part}.weight"] = torch.cat([shared, own])
    model.load_state_dict(state)
    torch.testing.assert_close(model(batch[0]).logits, want, rtol=0, atol=0)


def test_plus_qkv_starts_as_the_shared_model_and_trains_its_own_part(tmp_path: Path) -> None:
    with needle_merge._row_patches("routed-plus-qkv", 100):
        patched, batch = _model_and_batch(tmp_path)
        got = patched(batch[0]).logits
        next_token_cross_entropy(got, batch[1]).backward()
    shared, _ = _model_and_batch(tmp_path)
    state = {k: v for k, v in patched.state_dict().items() if ".softmax_qk." not in k}
    shared.load_state_dict(state)
    torch.testing.assert_close(got, shared(batch[0]).logits, rtol=0, atol=0)
    for block in patched.blocks:
        own = block.mixer.softmax_qk.conv.weight
        assert not own.any() and own.grad.abs().max() > 0


def test_rows_train_eagerly_on_a_gpu(tmp_path: Path) -> None:
    """A row's patches are Python run at every step (``routed-detach-half`` counts them):
    a step replayed from a CUDA graph would keep the recorded step's choice."""
    cfg = needle_merge.config(0, "nats", tmp_path, "gpu", "cuda")
    assert not records_graph(cfg, torch.device("cuda"), World())
