"""``nats eval``: metrics against a direct recount, labels, JSON, loading and CLI errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.cli import main
from nats.evaluation import run_eval, slice_configs
from nats.evaluation.harness import summary_lines
from nats.softmax_fraction import measure_softmax_fraction
from nats.trainers import MQARTask, TrainConfig
from nats.trainers.data import stream_generator
from nats.trainers.sources import LoadedModel, load_model

CPU = torch.device("cpu")


def _model(layers: tuple[str, ...] = ("linear", "nats")) -> NatsForCausalLM:
    torch.manual_seed(0)
    config = NatsConfig(vocab_size=32, d_model=32, n_layers=len(layers), n_heads=2,
                        softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                        layer_types=layers)
    return NatsForCausalLM(config).eval()


def _run_config(model: NatsForCausalLM, **changes) -> TrainConfig:
    return TrainConfig(model=model.config, task="mqar", seq_len=32, mqar_pairs=4,
                       batch_size=4, device="cpu", **changes)


def test_metrics_match_a_direct_recount(tmp_path: Path) -> None:
    model = _model()
    config = _run_config(model, eval_seed=5)
    slices = slice_configs(config, "mqar", [64], pairs=[6], knobs={"mqar_filler": ["noise"]})
    report = run_eval(LoadedModel(model, config, "test"), slices, 3, CPU,
                      out=tmp_path / "e.json", show_progress=False)
    (s,) = report["slices"]
    # The same batches, drawn independently from the task and the evaluation stream.
    task = MQARTask(32, 64, 6, filler="noise")
    batches = [task.sample(4, stream_generator(5, "eval", i)) for i in range(3)]
    hits = total = solved = 0
    for x, y in batches:
        pred = model(x).logits.argmax(-1)[:, :-1]
        target = y[:, 1:]
        scored = target != -100
        hits += int(((pred == target) & scored).sum())
        total += int(scored.sum())
        solved += int(((pred == target) | ~scored).all(1).sum())
    assert s["accuracy"] == pytest.approx(hits / total)
    assert s["sequence_accuracy"] == pytest.approx(solved / 12)
    measured = measure_softmax_fraction(model, batches)[1].overall
    assert s["layers"][1]["softmax_fraction"] == pytest.approx(measured)
    assert s["layers"][0] == {"layer": 0, "kind": "linear", "measured": False,
                              "softmax_fraction": 0.0}
    assert s["softmax_fraction"] == pytest.approx(measured / 2)
    assert s["params"] == {"seq_len": 64, "pairs": 6, "placement": "start",
                           "filler": "noise", "queries": "power-law"}
    assert s["length"] == "longer than training (32)"
    assert s["tokens_per_second"] > 0 and s["memory"]["peak_rss_bytes"] > 0
    assert set(s["cost"]) == {"4096", "32768"}
    assert json.loads((tmp_path / "e.json").read_text()) == json.loads(json.dumps(report))


def test_bits_per_byte_of_a_text_slice(tmp_path: Path) -> None:
    from nats.trainers.text_data import in_validation

    names = iter(f"doc{i}.txt" for i in range(1000))
    for split in (False, True):  # one file in each split
        name = next(n for n in names if in_validation(tmp_path / n, 0.5) == split)
        (tmp_path / name).write_text("def f(x):\n    return x + 1\n" * 20)
    model = _model(("softmax", "linear"))
    model = NatsForCausalLM(model.config.replace(vocab_size=256)).eval()
    config = TrainConfig(model=model.config, task="text", seq_len=32, batch_size=2,
                         data_paths=(str(tmp_path),), val_fraction=0.5, device="cpu")
    report = run_eval(LoadedModel(model, config, "t"), [config], 2, CPU, show_progress=False)
    (s,) = report["slices"]
    assert s["bits_per_byte"] == pytest.approx(s["loss"] / math.log(2))  # bytes: 1 per token
    assert s["length"] == "training length" and s["softmax_fraction"] == 0.5
    assert "stdlib" not in report  # its own files, not the standard library


def test_a_slice_on_the_standard_library_records_which_one() -> None:
    import hashlib
    import platform

    from nats.trainers.text import stdlib_sources

    model = _model()
    config = TrainConfig(model=model.config, task="needle", seq_len=64, batch_size=2,
                         needle_haystack="text", device="cpu")
    report = run_eval(LoadedModel(model, config, "t"), [config], 1, CPU, show_progress=False)
    files = stdlib_sources()
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    assert report["stdlib"] == {"python": platform.python_version(), "files": len(files),
                                "bytes": sum(f.stat().st_size for f in files),
                                "sha256": digest}
    repeated = config.replace(needle_haystack="repeated")
    report = run_eval(LoadedModel(model, repeated, "t"), [repeated], 1, CPU,
                      show_progress=False)
    assert "stdlib" not in report


def test_exported_folder_has_no_training_length_unless_told(tmp_path: Path) -> None:
    model = _model()
    model.save_pretrained(tmp_path / "export")
    loaded = load_model(tmp_path / "export", CPU)
    assert loaded.train_config is None
    config = _run_config(model)
    report = run_eval(loaded, [config], 1, CPU, show_progress=False)
    assert report["slices"][0]["length"] == "training length unknown"
    report = run_eval(loaded, [config], 1, CPU, train_seq_len=32, show_progress=False)
    assert report["slices"][0]["length"] == "training length"
    # A run's model/ folder finds the run's config one level up.
    (tmp_path / "run").mkdir()
    model.save_pretrained(tmp_path / "run" / "model")
    (tmp_path / "run" / "train_config.json").write_text(json.dumps(config.to_dict()))
    assert load_model(tmp_path / "run" / "model", CPU).train_config == config


def test_cli_writes_json_and_labels_lengths(tmp_path: Path, capsys) -> None:
    model = _model()
    model.save_pretrained(tmp_path / "m")
    out = tmp_path / "r.json"
    # --needle-distractors: the spelling `nats train` uses works here too.
    assert main(["eval", str(tmp_path / "m"), "--task", "needle", "--seq-len", "64", "128",
                 "--haystack", "random", "repeated", "--needle-distractors", "1", "--batches", "1",
                 "--batch-size", "2", "--train-seq-len", "64", "--device", "cpu",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [s["name"] for s in report["slices"]]
    assert names == [f"needle seq_len={t} distractors=1 haystack={h}"
                     for t in (64, 128) for h in ("random", "repeated")]
    assert [s["length"] for s in report["slices"]] == ["training length"] * 2 + [
        "longer than training (64)"] * 2
    assert "wrote" in capsys.readouterr().out


def test_cli_evaluates_on_the_stream_it_is_given(tmp_path: Path) -> None:
    """By default the run's own eval_seed (its validation rows); --eval-seed another stream,
    recorded per slice, whose rows are those the task draws from that seed."""
    model = _model()
    model.save_pretrained(tmp_path / "m")

    def evaluate(*seed: str) -> dict:
        out = tmp_path / f"r{''.join(seed)}.json"
        assert main(["eval", str(tmp_path / "m"), "--task", "mqar", "--seq-len", "32",
                     "--pairs", "4", "--batches", "2", "--batch-size", "4", "--device", "cpu",
                     *(["--eval-seed", *seed] if seed else []), "--out", str(out)]) == 0
        return json.loads(out.read_text())["slices"][0]

    default, test = evaluate(), evaluate("1001")
    assert (default["eval_seed"], test["eval_seed"]) == (TrainConfig.eval_seed, 1001)
    config = slice_configs(_run_config(model, eval_seed=1001), "mqar", [32], [4])[0]
    direct = run_eval(LoadedModel(model, config, "direct"), [config], 2, CPU,
                      show_progress=False)["slices"][0]
    assert test["loss"] == direct["loss"] and default["loss"] != test["loss"]


def test_cli_calibrates_the_budget_and_saves_the_model(tmp_path: Path, capsys) -> None:
    model = _model(("nats", "nats"))
    model = NatsForCausalLM(model.config.replace(softmax_target=0.25))
    for layer in model.nats_layers:  # ranked scores (zero-initialised scorers tie)
        torch.nn.init.normal_(layer.scorer.proj.weight)
    model.save_pretrained(tmp_path / "m")
    out, saved = tmp_path / "r.json", tmp_path / "calibrated"
    argv = ["eval", str(tmp_path / "m"), "--task", "mqar", "--seq-len", "128", "--pairs", "8",
            "--batches", "4", "--batch-size", "16", "--device", "cpu", "--out", str(out)]
    assert main([*argv, "--calibrate-budget", "0.4", "--save-model", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert "calibrated the routing biases to 0.4 on mqar seq_len=128 pairs=8" in printed
    report = json.loads(out.read_text())
    assert "routing biases calibrated to 0.4" in report["source"]
    # Evaluation draws other batches than calibration: the share lands near, not on, 0.4.
    assert report["slices"][0]["routing"]["route_frac"] == pytest.approx(0.4, abs=0.07)
    reloaded = load_model(saved, CPU).model
    biases = [float(layer.budget.route_bias.unique()) for layer in reloaded.nats_layers]
    assert f"layer 0 bias {biases[0]:.3f} share 0.4" in printed
    assert f"layer 1 bias {biases[1]:.3f} share 0.4" in printed
    original = load_model(tmp_path / "m", CPU).model  # untouched
    assert [float(x.budget.route_bias.unique()) for x in original.nats_layers] == [
        float(x.budget.route_bias.unique()) for x in model.nats_layers]
    assert biases != [float(x.budget.route_bias.unique()) for x in model.nats_layers]
    _model(("nats",)).save_pretrained(tmp_path / "tied")  # a zero-initialised scorer
    assert main(["eval", str(tmp_path / "tied"), *argv[2:], "--calibrate-budget", "0.4"]) == 0
    assert "tied routing scores" in capsys.readouterr().err
    unbudgeted = NatsForCausalLM(model.config.replace(softmax_target=None))
    unbudgeted.save_pretrained(tmp_path / "free")
    assert main(["eval", str(tmp_path / "free"), *argv[2:], "--calibrate-budget", "0.4"]) == 2
    assert "--calibrate-budget: the model has no NAtS-L layer" in capsys.readouterr().err
    assert main([*argv, "--calibrate-budget", "1"]) == 2
    assert "--calibrate-budget must lie in (0, 1), got 1" in capsys.readouterr().err


def _ranked_budgeted_model(tmp_path: Path) -> tuple[list[str], Path]:
    """A saved 2-layer budgeted model whose scorers rank chunks, and ``nats eval`` argv up
    to ``--calibrate-budget``; the report path."""
    model = NatsForCausalLM(_model(("nats", "nats")).config.replace(softmax_target=0.25))
    for layer in model.nats_layers:
        torch.nn.init.normal_(layer.scorer.proj.weight)
    model.save_pretrained(tmp_path / "m")
    out = tmp_path / "r.json"
    return ["eval", str(tmp_path / "m"), "--task", "mqar", "--seq-len", "128", "--pairs",
            "8", "--batches", "2", "--batch-size", "8", "--device", "cpu", "--out", str(out),
            "--calibrate-budget"], out


def test_cli_splits_a_model_wide_budget_among_the_layers(tmp_path: Path, capsys) -> None:
    argv, out = _ranked_budgeted_model(tmp_path)
    argv.append("0.25")
    assert main([*argv, "--calibrate-scope", "model"]) == 0
    printed = capsys.readouterr().out
    kept = float(re.search(r"biases to (\d\.?\d*) on average over the layers \(a split of "
                           r"0.25 at share price 0\) on mqar seq_len=128", printed)[1])
    assert 0 <= kept <= 0.25 and f"it kept {kept:.4g}, loss" in printed
    shares = [float(x) for x in re.findall(r"share (\d\.\d+)", printed)]
    assert len(shares) == 2 and sum(shares) / 2 == pytest.approx(kept, abs=0.01)
    report = json.loads(out.read_text())
    assert "on average over the layers" in report["source"]
    # A price no route pays keeps no share; a price needs a split.
    assert main([*argv, "--calibrate-scope", "model", "--share-price", "100"]) == 0
    assert "biases to 0 on average over the layers (a split of 0.25 at share price 100)" in \
        capsys.readouterr().out
    assert main([*argv, "--share-price", "0.1"]) == 2
    assert "--share-price prices a split" in capsys.readouterr().err
    assert main([*argv, "--calibrate-scope", "model", "--share-price", "-1"]) == 2
    assert "--share-price must be a number >= 0" in capsys.readouterr().err
    assert main([*argv[:-2], "--calibrate-scope", "model"]) == 2
    assert "--calibrate-scope says how to calibrate" in capsys.readouterr().err
    assert main([*argv, "0.5", "--calibrate-scope", "model"]) == 2
    assert "splits one fraction: give one" in capsys.readouterr().err


def test_cli_splits_a_model_wide_budget_among_the_heads(tmp_path: Path, capsys) -> None:
    argv, out = _ranked_budgeted_model(tmp_path)
    assert main([*argv, "0.25", "--calibrate-scope", "head"]) == 0
    printed = capsys.readouterr().out
    assert "splitting 0.25 among the heads by the loss on 2 batches" in printed
    kept = float(re.search(r"biases to (\d\.?\d*) on average over the heads \(a split of "
                           r"0.25 at share price 0\) on mqar seq_len=128", printed)[1])
    found = re.findall(r"layer (\d) head (\d) bias -?\d+\.\d+ share (\d\.\d+)", printed)
    assert [(int(i), int(h)) for i, h, _ in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert 0 <= kept <= 0.25
    assert sum(float(x) for *_, x in found) / 4 == pytest.approx(kept, abs=0.01)
    assert "on average over the heads" in json.loads(out.read_text())["source"]
    assert main([*argv, "0.2", "0.3", "--calibrate-scope", "head"]) == 2
    assert "--calibrate-scope head splits one fraction" in capsys.readouterr().err


def test_cli_calibrates_one_fraction_per_layer(tmp_path: Path, capsys) -> None:
    argv, out = _ranked_budgeted_model(tmp_path)
    assert main([*argv, "1", "0"]) == 0
    printed = capsys.readouterr().out
    assert "biases to 1 0 per layer on mqar seq_len=128" in printed
    assert re.findall(r"share (\d\.\d+)", printed) == ["1.000", "0.000"]
    routing = json.loads(out.read_text())["slices"][0]["routing"]  # other batches: exact
    assert (routing["route_frac/layer0"], routing["route_frac/layer1"]) == (1.0, 0.0)
    assert main([*argv, "0.2", "0.3", "0.1"]) == 2
    assert "3 calibration targets for 2 budgeted NAtS-L layers" in capsys.readouterr().err
    assert main([*argv, "1.5", "0"]) == 2
    assert "one fraction per layer must lie in [0, 1], got 1.5 0" in capsys.readouterr().err


def test_an_unknown_training_task_is_said(tmp_path: Path, capsys) -> None:
    _model().save_pretrained(tmp_path / "m")
    argv = ["eval", str(tmp_path / "m"), "--batches", "1", "--batch-size", "2", "--seq-len",
            "64", "--device", "cpu", "--out", str(tmp_path / "r.json")]
    assert main(argv) == 0
    assert "the task model folder" in capsys.readouterr().err
    assert main([*argv, "--task", "mqar"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["missing"], "does not exist"),
    (["{tmp}"], "neither a run folder"),
    (["{m}", "--task", "needle", "--pairs", "4"], "--pairs is an MQAR knob"),
    (["{m}", "--seq-len", "32", "64", "--pairs", "1", "2", "3"], "one per --seq-len"),
    (["{m}", "--task", "mqar", "--haystack", "text"], "not a knob of task 'mqar'"),
    (["{m}", "--pairs", "40"], "mqar_pairs = 40"),
    (["{m}", "--batches", "0"], "--batches must be"),
    (["{m}", "--eval-seed", "-1"], "--eval-seed must be >= 0, got -1"),
    (["{m}", "--save-model", "{tmp}/c"], "give --calibrate-budget"),
    (["{m}", "--calibrate-budget", "0.3", "--save-model", "{m}"], "not an empty folder"),
    (["{m}", "--prefill", "64", "0"], "--prefill lengths must be integers >= 1, got [0]"),
    (["{m}", "--out", "{tmp}"], "is a folder: give a file name"),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    _model().save_pretrained(tmp_path / "m")
    argv = [a.format(tmp=tmp_path, m=tmp_path / "m") for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "x.json")]
    assert main(["eval", *argv, "--device", "cpu", *out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nats: error:") and message in err


def test_prefill_is_timed_by_the_latency_module_on_the_first_slice(monkeypatch) -> None:
    """One timer (src/nats/latency.py): a batch-1 forward over real tokens of the first slice."""
    import nats.latency
    from nats.trainers import build_batches

    model = _model()
    config = _run_config(model, eval_seed=3)
    timed: list[torch.Tensor] = []
    real_median = nats.latency.median_ms

    def recording_median(fn, device, *args, **kwargs):
        timed.append(fn())
        return real_median(fn, device, *args, **kwargs)

    monkeypatch.setattr(nats.latency, "median_ms", recording_median)
    model.train()  # a model mid-training is evaluated as evaluation sees it, and left training
    report = run_eval(LoadedModel(model, config, "test"), [config], 1, CPU,
                      prefill_lens=[40, 20], show_progress=False)
    assert model.training
    model.eval()
    assert [(p["seq_len"], p["batch_size"]) for p in report["prefill"]] == [(40, 1), (20, 1)]
    assert all(p["seconds"] > 0 for p in report["prefill"])
    first = build_batches(config).eval(1)[0][0].flatten()
    with torch.no_grad():
        assert torch.equal(timed[0].logits, model(first[:40][None]).logits)
        assert torch.equal(timed[1].logits, model(first[:20][None]).logits)


def test_slices_of_a_mixture_trained_run_are_fixed_tasks() -> None:
    """A run trained on a mixture of pair counts is evaluated on one count per slice, even at
    lengths too short for the mixture's largest count."""
    config = _run_config(_model()).replace(seq_len=64, mqar_pairs_mix=(4, 8))
    (s,) = slice_configs(config, "mqar", [16], pairs=[2])
    assert (s.seq_len, s.mqar_pairs, s.mqar_pairs_mix) == (16, 2, ())


def test_summary_names_the_query_chunks_only_where_a_slice_has_them() -> None:
    routing = {"route_informative": 0.9, "route_filler": 0.05, "route_lift": 18.0}
    base = {"name": "s", "accuracy": 1.0, "sequence_accuracy": 1.0, "softmax_fraction": 0.25,
            "tokens_per_second": 10.0, "length": "training length"}
    report = {"source": "m", "device_name": "cpu", "prefill": [],
              "slices": [{**base, "routing": routing},
                         {**base, "routing": {**routing, "route_query": 0.5}}]}
    without, with_query = summary_lines(report)[1:]
    assert "informative chunks to softmax 0.90 vs filler 0.05," in without
    assert "query" not in without and "nan" not in without
    assert "filler 0.05 (query chunks 0.50)," in with_query


def test_summary_shows_each_head_where_the_layer_has_several() -> None:
    """Pooled over heads, a layer whose heads split the work reads as a blind router."""
    routing = {"route_informative": 0.45, "route_filler": 0.2, "route_lift": 2.2,
               "route_informative/layer0/head0": 0.0, "route_filler/layer0/head0": 0.38,
               "route_informative/layer0/head1": 0.9, "route_filler/layer0/head1": 0.02}
    report = {"source": "m", "device_name": "cpu", "prefill": [],
              "slices": [{"name": "s", "accuracy": 1.0, "sequence_accuracy": 1.0,
                          "softmax_fraction": 0.25, "tokens_per_second": 10.0,
                          "length": "training length", "routing": routing}]}
    heads = summary_lines(report)[2]
    assert heads.strip() == ("per head, informative / filler to softmax: layer0 head0 0.00 / "
                             "0.38, layer0 head1 0.90 / 0.02")
