"""nats.hf: transformers' Auto classes, generate and Trainer give the native model's numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.utils import logging

from nats import ConfigError, NatsConfig, NatsForCausalLM
from nats.generation import generate
from nats.hf import NatsCache, NatsHFConfig, NatsHFForCausalLM, register
from nats.trainers.export import export_model

from .models import tiny_model

logging.disable_progress_bar()
MIXES = [("nats", "linear", "softmax"), ("nats", "nats"), ("linear", "softmax")]


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    register()
    register()  # idempotent


def test_transformers_and_nats_hf_import_in_a_python_started_in_the_repository_root() -> None:
    """The root is then on ``sys.path``; nothing there may answer to ``kernels`` (Hugging
    Face's, which transformers imports where it is installed) or to another bare name."""
    root = Path(__file__).resolve().parents[2]
    code = ("import importlib.util, transformers.modeling_utils, nats.hf; "
            "spec = importlib.util.find_spec('kernels'); print(spec and spec.origin or '')")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    origin = run.stdout.strip()  # where `kernels` is installed, if it is
    assert not origin or "site-packages" in Path(origin).parts, origin


def budgeted_model(dtype: torch.dtype = torch.float32) -> NatsForCausalLM:
    """The default recipe (a softmax budget, normalised scorer input) with routing statistics
    and biases moved off their initial values, so that loading them is seen."""
    torch.manual_seed(0)
    config = NatsConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, head_dim_k=16,
                        head_dim_v=16, chunk_size=16, layer_types=("nats", "softmax"))
    model = NatsForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.add_(torch.rand_like(buffer) if "running_var" in name else
                        torch.randn_like(buffer))
        for layer in model.nats_layers:
            layer.scorer.proj.weight.normal_(0, 1.0)
    return model


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def load(model: NatsForCausalLM, folder: Path) -> NatsHFForCausalLM:
    """``model`` written by the native save_pretrained, read by transformers: the same
    tensors, bit for bit."""
    model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is NatsHFForCausalLM and not loaded.training
    assert loaded.dtype == model.embed.weight.dtype
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    return loaded


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to rounding: transformers keeps loaded tensors in the file's memory map, whose
    alignment can change the CPU's float64 summation order by an ulp."""
    assert (a - b).abs().max() <= (1e-12 if a.dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("layer_types", MIXES, ids="-".join)
def test_logits_and_loss_equal_the_native_models(layer_types):
    model = tiny_model(layer_types, rope=True)
    hf = NatsHFForCausalLM.from_native(model)
    tokens = ids(2, 45)  # two full 16-token chunks and a partial one
    labels = tokens.clone()
    labels[0, :7] = -100
    native, out = model(tokens, labels=labels), hf(tokens, labels=labels)
    assert torch.equal(out.logits, native.logits)
    assert torch.equal(out.loss, native.loss)
    assert out.cache is None
    # transformers' own shifted cross-entropy gives the same number (the cost term is 0).
    hf_loss = hf.loss_function(out.logits, labels, vocab_size=50)
    assert torch.allclose(hf_loss.to(out.loss.dtype), out.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("dtype", "tie_embeddings"), [(torch.float64, True),
                                                      (torch.float32, False)])
def test_native_folder_loads_through_the_auto_classes(tmp_path, dtype, tie_embeddings):
    model = tiny_model(("nats", "linear", "softmax"), dtype=dtype, rope=True,
                       tie_embeddings=tie_embeddings)
    loaded = load(model, tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is NatsHFConfig and config.to_nats() == model.config
    assert (loaded.lm_head.weight is loaded.embed.weight) == tie_embeddings
    tokens = ids(2, 45)
    assert_same_logits(loaded(tokens).logits, model(tokens).logits)


def test_budgeted_model_loads_its_routing_statistics(tmp_path):
    """Built for from_pretrained on the CPU (not the meta device), every buffer loaded."""
    model = budgeted_model()
    loaded = load(model, tmp_path)  # every tensor, buffers included
    tokens = ids(2, 40)
    assert_same_logits(loaded(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize(("prompt_len", "new"), [(13, 25), (16, 20), (1, 17)])
def test_greedy_generate_equals_nats_generate(tmp_path, prompt_len, new):
    """Prompts that end mid-chunk and on a chunk end; new tokens that cross chunk ends."""
    model = tiny_model(("nats", "linear", "softmax"), dtype=torch.float32, rope=True)
    loaded = load(model, tmp_path)
    prompt = ids(2, prompt_len, seed=prompt_len)
    out = loaded.generate(prompt, max_new_tokens=new, do_sample=False)
    assert torch.equal(out, generate(model, prompt, new))


def test_budgeted_model_generates_as_natively(tmp_path):
    model = budgeted_model()
    prompt = ids(1, 20)
    out = load(model, tmp_path).generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, generate(model, prompt, 30))


def test_generate_in_training_mode_decodes_as_in_evaluation():
    """The cached path decodes with argmax routes and leaves the routing statistics (pending
    sums of a training forward included) as they were, as the native ``generate`` does."""
    model = tiny_model(("nats", "nats"), dtype=torch.float32, branch_norm="scaled")
    prompt = ids(2, 21)
    expected = generate(model.eval(), prompt, 12)
    hf = NatsHFForCausalLM.from_native(model).train()
    model(prompt)  # a training forward: its sums wait for the next optimizer step
    stats = [m for m in model.modules() if getattr(m, "pending", None) is not None]
    pending = [m.pending.clone() for m in stats]
    assert pending and all(p[0] > 0 for p in pending)
    assert torch.equal(hf.generate(prompt, max_new_tokens=12, do_sample=False), expected)
    assert model.training
    assert all(torch.equal(m.pending, p) for m, p in zip(stats, pending, strict=True))


def test_generate_continues_a_cache_it_is_given():
    model = tiny_model(("nats", "linear", "softmax"), dtype=torch.float32)
    hf = NatsHFForCausalLM.from_native(model)
    prompt, cache = ids(2, 13), NatsCache()
    first = hf.generate(prompt, max_new_tokens=7, cache=cache)
    assert cache.get_seq_length() == 13 + 6 and cache.batch_size == 2
    second = hf.generate(first, max_new_tokens=9, cache=cache)
    assert torch.equal(second, generate(model, prompt, 16))


def test_beam_search_with_the_cache_equals_recomputing_every_step():
    """Beam search reorders the cache's rows every step (``reorder_cache``)."""
    hf = NatsHFForCausalLM.from_native(tiny_model(("nats", "linear", "softmax"),
                                                  dtype=torch.float32))
    prompt = ids(2, 13)
    cached = hf.generate(prompt, max_new_tokens=20, num_beams=3, do_sample=False)
    recomputed = hf.generate(prompt, max_new_tokens=20, num_beams=3, do_sample=False,
                             use_cache=False)
    assert torch.equal(cached, recomputed)


def test_forward_continues_a_cache_token_by_token():
    model = tiny_model(("nats", "softmax"))
    hf = NatsHFForCausalLM.from_native(model)
    tokens = ids(2, 40)
    cache = NatsCache()
    head = hf(tokens[:, :20], use_cache=True, cache=cache).logits
    tail = hf(tokens[:, 20:], cache=cache).logits
    assert cache.get_seq_length() == 40
    full = model(tokens).logits
    assert torch.allclose(torch.cat([head, tail], 1), full, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_save_pretrained_round_trip_keeps_the_native_layout(tmp_path, tie_embeddings):
    model = tiny_model(("nats", "linear", "softmax"), tie_embeddings=tie_embeddings)
    hf = NatsHFForCausalLM.from_native(model)
    hf.save_pretrained(tmp_path / "hf")
    model.save_pretrained(tmp_path / "native")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as saved:
        assert sorted(saved.keys()) == sorted(load_file(tmp_path / "native" / "model.safetensors"))
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert type(config) is NatsHFConfig and config.to_nats() == model.config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (loaded.lm_head.weight is loaded.embed.weight) == tie_embeddings
    tokens = ids(2, 40)
    assert_same_logits(loaded(tokens).logits, model(tokens).logits)


def test_exported_folder_loads_through_the_auto_classes(tmp_path):
    model = tiny_model(("nats", "linear"), dtype=torch.float32)
    export_model(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("nats", ["NatsHFForCausalLM"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokens = ids(1, 33)
    assert_same_logits(loaded(tokens).logits, model(tokens).logits)


def test_one_trainer_step_changes_the_weights(tmp_path):
    torch.manual_seed(0)
    config = NatsHFConfig.from_nats(tiny_model(("nats", "linear", "softmax")).config)
    model = AutoModelForCausalLM.from_config(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [{"input_ids": row, "labels": row} for row in ids(4, 40)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "embed.weight" in changed and "blocks.0.mixer.scorer.proj.weight" in changed
    assert model.native.blocks is model.blocks  # the native model trained with it


def test_a_checkpoint_without_a_tensor_is_refused(tmp_path):
    tiny_model(("nats", "softmax")).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["blocks.0.mixer_norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds no blocks\.0\.mixer_norm\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_resized_embeddings_are_drawn_and_the_native_model_follows(tmp_path):
    model = tiny_model(("nats", "linear"), tie_embeddings=False)
    hf = NatsHFForCausalLM.from_native(model)
    old = hf.embed.weight.detach().clone()
    hf.resize_token_embeddings(60, mean_resizing=False)
    assert model.embed is hf.embed and model.config.vocab_size == 60
    assert torch.equal(hf.embed.weight[:50], old) and 0 < hf.embed.weight[50:].std() < 0.05
    assert hf(ids(1, 20) + 10).logits.shape == (1, 20, 60)
    model.save_pretrained(tmp_path)
    assert NatsForCausalLM.from_pretrained(tmp_path).lm_head.weight.shape == (60, 32)


def test_padding_and_a_loss_on_the_cache_are_refused():
    hf = NatsHFForCausalLM.from_native(tiny_model(("nats",)))
    tokens = ids(2, 20)
    mask = torch.ones_like(tokens)
    assert torch.equal(hf(tokens, attention_mask=mask).logits, hf(tokens).logits)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        hf(tokens, attention_mask=mask)
    with pytest.raises(ValueError, match="labels need the parallel forward"):
        hf(tokens, labels=tokens, use_cache=True)


def test_a_model_built_from_a_config_is_initialised_as_natively():
    """transformers' weight initialisation leaves what NatsForCausalLM drew alone."""
    config = budgeted_model().config
    torch.manual_seed(3)
    native = NatsForCausalLM(config)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(NatsHFConfig.from_nats(config))
    for (name, a), (_, b) in zip(native.state_dict().items(), hf.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_config_is_checked_by_nats_config():
    config = tiny_model(("nats", "linear")).config
    assert NatsHFConfig.from_nats(config).to_nats() == config
    with pytest.raises(ConfigError, match="chunk_size"):
        NatsHFConfig(chunk_size=5)
    with pytest.raises(ConfigError, match="hybrid_layers"):
        NatsHFConfig(**{**config.to_dict(), "hybrid_layers": [1]})
