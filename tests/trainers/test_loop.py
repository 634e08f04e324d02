"""The training loop: exact resume after Ctrl-C, TensorBoard contents, learning, export."""

from __future__ import annotations

import contextlib
import io
import math
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from nats import NatsForCausalLM
from nats.trainers import build_batches, evaluate, latest_checkpoint, preset, train
from nats.trainers.distributed import World
from nats.trainers.routing_maps import routing_figure, routing_map_image
from nats.trainers.step import GraphedGradients, records_graph
from nats.trainers.tensorboard_log import MAP_SEQUENCES

from .conftest import MicroConfig


def _interrupt_at(step: int):
    """An eval callback that presses Ctrl-C (a real SIGINT) after ``step``."""

    def on_eval(at: int, metrics: dict[str, float], model: object) -> None:
        if at == step:
            signal.raise_signal(signal.SIGINT)

    return on_eval


def test_ctrl_c_then_resume_equals_an_uninterrupted_run(micro: MicroConfig,
                                                         tmp_path: Path) -> None:
    straight = train(micro(out_dir=str(tmp_path / "straight")))

    # What the process had (a shell's background job starts with SIGINT ignored).
    handler = signal.getsignal(signal.SIGINT)
    config = micro(out_dir=str(tmp_path / "split"))
    first = train(config, on_eval=_interrupt_at(3))
    assert first.interrupted and first.step == 3 and len(first.train_losses) == 3
    assert first.checkpoint == latest_checkpoint(config.out_dir)
    assert first.checkpoint.name == "step_00000003.safetensors"
    assert not (Path(config.out_dir) / "model").exists()
    assert signal.getsignal(signal.SIGINT) is handler  # left as it was found

    second = train(config, resume=True)
    assert not second.interrupted and second.step == 6
    assert first.train_losses + second.train_losses == straight.train_losses
    for (name, a), (_, b) in zip(straight.model.state_dict().items(),
                                 second.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert second.eval_metrics == straight.eval_metrics
    # TensorBoard: every step's loss once, the checkpoint step's included.
    events = EventAccumulator(config.out_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_while_the_finished_run_saves_does_not_cut_the_save(
        micro: MicroConfig, monkeypatch) -> None:
    """A Ctrl-C that lands while the last checkpoint and the model are written asks the
    run to stop, which it is doing: both are written whole and the run ends finished."""
    save = NatsForCausalLM.save_pretrained

    def pressed_while_saving(self, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(NatsForCausalLM, "save_pretrained", pressed_while_saving)
    config = micro(steps=2, checkpoint_interval=100)
    try:
        result = train(config)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C cut the final save short")
    assert not result.interrupted and result.step == 2
    assert result.checkpoint.name == "step_00000002.safetensors"
    assert NatsForCausalLM.from_pretrained(Path(config.out_dir) / "model") is not None


def test_refuses_to_overwrite_a_run(micro: MicroConfig) -> None:
    config = micro(steps=1)
    train(config)
    with pytest.raises(FileExistsError, match="--resume"):
        train(config)
    with pytest.raises(ValueError, match="another model config"):
        train(config.replace(model=config.model.replace(d_model=16)), resume=True)


def test_tensorboard_has_losses_fractions_maps_histograms_and_hparams(
        micro: MicroConfig) -> None:
    config = micro()
    result = train(config)
    events = EventAccumulator(config.out_dir, size_guidance={
        "images": 0, "scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/ce", "train/reg", "train/lr", "train/tokens_per_s",
            "eval/loss", "eval/ce", "eval/ppl", "eval/acc", "eval/seq_acc"} <= scalars
    for prefix in ("train", "eval"):
        assert {f"{prefix}/attn_frac/layer{i}/head{h}" for i in range(2) for h in range(2)} \
            <= scalars
        assert {f"{prefix}/attn_frac/layer{i}" for i in range(2)} <= scalars
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 7))
    assert [e.value for e in losses] == pytest.approx(result.train_losses)
    assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
    assert events.Scalars("eval/ppl")[-1].value == pytest.approx(
        math.exp(events.Scalars("eval/ce")[-1].value), rel=1e-5)

    assert set(events.Tags()["images"]) == {"routing/layer0", "routing/layer1",
                                            "routing/all_layers"}
    image = events.Images("routing/layer1")[-1]
    routes = evaluate(result.model, build_batches(config).eval(1), torch.device("cpu")).routes
    expected = routing_map_image(routes[1][:MAP_SEQUENCES])
    assert (image.step, image.height, image.width) == (6, *expected.shape[:2])
    n_chunks = math.ceil(config.seq_len / config.model.chunk_size)
    rows = min(config.batch_size, MAP_SEQUENCES) * config.model.n_heads
    assert expected.shape[0] % rows == 0 and expected.shape[1] % n_chunks == 0
    assert expected.shape[0] // rows == expected.shape[1] // n_chunks  # square cells
    figure = routing_figure(routes, config.model.layer_types, config.model.chunk_size,
                            config.seq_len, title="routes of evaluation sequence 0 at step 6")
    logged = events.Images("routing/all_layers")[-1]
    assert (logged.step, logged.height, logged.width) == (6, figure.height, figure.width)
    pixels = Image.open(io.BytesIO(logged.encoded_image_string)).convert("RGB")
    assert np.array_equal(np.asarray(pixels), np.asarray(figure))

    assert set(events.Tags()["histograms"]) == {"routing/softmax_prob/layer0",
                                                "routing/softmax_prob/layer1"}
    histogram = events.Histograms("routing/softmax_prob/layer0")[-1].histogram_value
    n_scored = config.eval_batches * config.batch_size * n_chunks * config.model.n_heads
    assert histogram.num == n_scored and 0 <= histogram.min <= histogram.max <= 1
    assert "config/text_summary" in events.Tags()["tensors"]

    hparams = EventAccumulator(str(Path(config.out_dir) / "hparams"))
    hparams.Reload()
    content = hparams.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    session = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert session.hparams["model.d_model"].number_value == config.model.d_model
    assert session.hparams["task"].string_value == "copy"
    assert session.hparams["model.layer_types"].string_value == "nats,nats"
    assert {"eval/loss", "eval/acc"} <= set(hparams.Tags()["scalars"])


def test_gradient_accumulation_matches_one_large_batch(micro: MicroConfig,
                                                       tmp_path: Path) -> None:
    # MQAR labels only some positions, so micro-batches hold different token counts. No
    # budget: its scores' gradient is centred per micro-batch (as batch norm's is); the
    # routing statistics are committed once per step and split exactly.
    model = micro().model.replace(vocab_size=64, softmax_target=None)
    whole = train(micro(task="mqar", batch_size=4, seq_len=32, mqar_pairs=4, model=model,
                        out_dir=str(tmp_path / "whole")))
    split = train(micro(task="mqar", batch_size=4, seq_len=32, mqar_pairs=4, model=model,
                        grad_accum_steps=4, out_dir=str(tmp_path / "split")))
    assert split.train_losses == pytest.approx(whole.train_losses, rel=1e-5)
    for (name, a), (_, b) in zip(whole.model.state_dict().items(),
                                 split.model.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def test_init_from_starts_at_the_saved_weights(micro: MicroConfig, tmp_path: Path) -> None:
    first = train(micro(steps=3, out_dir=str(tmp_path / "first")))
    saved = str(tmp_path / "first" / "model")
    # One step at a negligible rate: the weights stay where the run started (the routing
    # statistics and budget bias, which are not trained by the rate, move on).
    second = train(micro(steps=1, lr=1e-12, warmup_steps=0, init_from=saved,
                         out_dir=str(tmp_path / "second")))
    for (name, a), (_, b) in zip(first.model.named_parameters(),
                                 second.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-8, msg=name)
    with pytest.raises(ValueError, match=r"another architecture.*d_model"):
        train(micro(init_from=saved, model=micro().model.replace(d_model=48),
                    out_dir=str(tmp_path / "third")))


@pytest.mark.slow
def test_compiled_training_follows_eager(micro: MicroConfig, tmp_path: Path) -> None:
    # One layer keeps TorchInductor's compile time (minutes on 2 cores) down.
    model = micro().model.replace(n_layers=1, layer_types=("nats",))
    eager = train(micro(steps=2, seq_len=32, model=model, out_dir=str(tmp_path / "eager")))
    compiled = train(micro(steps=2, seq_len=32, model=model, compile=True,
                           out_dir=str(tmp_path / "comp")))
    assert compiled.train_losses == pytest.approx(eager.train_losses, rel=1e-4)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        train(micro(compile=True, seq_len=33, out_dir=str(tmp_path / "odd")))


def test_a_diverging_run_stops_with_a_clear_error(micro: MicroConfig) -> None:
    config = micro(lr=float("1e30"), warmup_steps=0, steps=20)  # the weights blow up
    with pytest.raises(ValueError, match="training diverged: the loss is nan"):
        train(config)
    # The events of the steps before it are on disk: the writer was closed on the way out.
    events = EventAccumulator(config.out_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")][:1] == [1]


def test_bf16_autocast_trains_close_to_fp32(micro: MicroConfig, tmp_path: Path) -> None:
    fp32 = train(micro(precision="fp32", out_dir=str(tmp_path / "fp32")))
    bf16 = train(micro(precision="bf16", out_dir=str(tmp_path / "bf16")))
    assert bf16.train_losses == pytest.approx(fp32.train_losses, rel=3e-2)
    assert bf16.train_losses != fp32.train_losses  # autocast really ran in bf16


def test_loss_falls_on_the_copy_task(micro: MicroConfig) -> None:
    # The acceptance test: a tiny model, a few dozen CPU steps.
    config = micro(steps=40, batch_size=8, lr=1e-2, warmup_steps=5, eval_interval=40)
    losses = train(config).train_losses
    assert losses[0] > 0.9 * math.log(config.model.vocab_size)
    assert sum(losses[-5:]) / 5 < 0.65 * losses[0]


def test_tiny_preset_learns_to_copy(tmp_path: Path) -> None:
    """Below half of ln(symbols): the model copies, it has not merely learnt the alphabet."""
    config = preset("tiny").replace(steps=120, eval_interval=120, out_dir=str(tmp_path))
    result = train(config)
    assert result.eval_metrics["eval/ce"] < 0.5 * math.log(config.copy_symbols)


def test_exported_model_reloads_exactly(micro: MicroConfig) -> None:
    config = micro(steps=2)
    result = train(config)
    loaded = NatsForCausalLM.from_pretrained(Path(config.out_dir) / "model")
    x, _ = build_batches(config).train(0)
    result.model.eval()
    assert torch.equal(loaded(x).logits, result.model(x).logits)


@pytest.mark.parametrize("task", ["mqar", "needle", "text"])
def test_other_tasks_train(micro: MicroConfig, tmp_path: Path, task: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"m{i}.py").write_text(f"x = {i}\n" * 20)
    config = micro(task=task, steps=2, seq_len=32, mqar_pairs=4, data_paths=(str(corpus),),
                   val_fraction=0.2, model=micro().model.replace(vocab_size=256))
    result = train(config)
    assert result.step == 2 and all(math.isfinite(v) for v in result.train_losses)


def test_the_cost_term_applies_from_reg_start_on(micro: MicroConfig, tmp_path: Path) -> None:
    def run(name: str, reg_lambda: float, reg_start: float):
        config = micro(out_dir=str(tmp_path / name), eval_interval=6)
        # No budget: it, too, starts at reg_start, and would tell the runs apart anyway.
        config = config.replace(model=config.model.replace(reg_lambda=reg_lambda,
                                                           softmax_target=None),
                                reg_start=reg_start)
        return train(config)

    plain = run("plain", 0.0, 0.0)
    never = run("never", 0.5, 1.0)  # the cost term never applies: the plain run exactly
    assert never.train_losses == plain.train_losses
    for (name, a), b in zip(never.model.state_dict().items(), plain.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    half = run("half", 0.5, 0.5)  # steps 0-2 without it, 3-5 with it
    assert half.train_losses[:3] == plain.train_losses[:3]
    assert half.train_losses[3] > plain.train_losses[3]  # ce and the same params + 0.5 * reg


@pytest.mark.parametrize(("device", "world"), [("cpu", World()), ("cuda", World(size=2))])
def test_cuda_graph_steps_refuse_what_they_cannot_record(micro: MicroConfig, device: str,
                                                          world: World) -> None:
    """Where ``device="auto"`` resolved to a CPU, or under ``torchrun``, the graphed step
    says why it cannot run (the GPU test module checks what it records)."""
    with pytest.raises(ValueError, match="needs one process on a CUDA GPU"):
        GraphedGradients(NatsForCausalLM(micro().model), micro(), world, torch.device(device),
                         contextlib.nullcontext())


@pytest.mark.parametrize(("given", "device", "world", "changes", "graphed"), [
    (None, "cuda", World(), {}, True),
    (None, "cuda:1", World(), {}, True),
    (None, "cpu", World(), {}, False),
    (None, "cuda", World(size=2), {}, False),
    (None, "cuda", World(), {"compile": True}, False),
    (None, "cuda", World(), {"route_explore": 0.2}, False),
    (False, "cuda", World(), {}, False),
    (True, "cuda", World(), {}, True),
])
def test_steps_are_graphed_by_default_wherever_they_can_record(
        micro: MicroConfig, given: bool | None, device: str, world: World, changes: dict,
        graphed: bool) -> None:
    """``cuda_graph=None`` (the default) records on one GPU unless ``compile`` or route
    exploration rule it out, and runs eagerly elsewhere; a given value is obeyed."""
    config = micro().replace(device="auto", cuda_graph=given, **changes)
    assert records_graph(config, torch.device(device), world) is graphed


def test_running_out_of_memory_while_recording_says_how_to_train_without_the_graph(
        micro: MicroConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph holds the step's working memory apart, so a run that fits eagerly can fail
    to record; the error must name the switch back to eager steps."""
    import nats.trainers.step as step

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(step, "check_graphable", lambda device, world: None)  # on a CPU
    monkeypatch.setattr(step, "warm_then_capture", out_of_memory)
    config = micro()
    batches = build_batches(config)
    gradients = step.GraphedGradients(NatsForCausalLM(config.model), config, World(),
                                      torch.device("cpu"), contextlib.nullcontext())
    gradients(batches.train(0), 0.0)  # the first step runs eagerly
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        gradients(batches.train(1), 0.0)
    assert "Tried to allocate 2.00 GiB" in str(raised.value)
    assert "--no-cuda-graph" in str(raised.value)


def test_cuda_graph_on_a_cpu_is_refused_before_the_run_folder_is_made(
        micro: MicroConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``device="auto"`` passes the config's checks and resolves to the CPU only in
    ``train``: the refusal must come before data is built or the folder is claimed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="needs one process on a CUDA GPU"):
        train(micro().replace(out_dir=str(out), device="auto", cuda_graph=True))
    assert not out.exists()


def test_tokens_per_second_leaves_out_evaluations(micro: MicroConfig, monkeypatch) -> None:
    """The rate was the steps' tokens over all the time since the start, evaluations and
    checkpoints included: a slow evaluation pulled every later value down by 10-20x."""
    import time

    from nats.trainers import loop

    evaluate = loop.evaluate

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", slow)
    config = micro(eval_interval=2)
    train(config)
    events = EventAccumulator(config.out_dir, size_guidance={"scalars": 0})
    events.Reload()
    rate = {e.step: e.value for e in events.Scalars("train/tokens_per_s")}
    # 66 tokens a step; with the 2 s evaluations counted, step 6's rate would be < 66.
    assert min(rate[s] for s in (3, 4, 5, 6)) > 0.25 * rate[2] and rate[6] > 100
