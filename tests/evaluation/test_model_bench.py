"""`nats bench model` on the CPU with small shapes: every form is built as named, every
measurement is recorded, and what the forms hold follows from their layers and routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nats.cli import main
from nats.evaluation.model_bench import (
    ModelBenchConfig,
    hybrid_ratio_table,
    ratio_table,
    run_model_benchmark,
    variants,
)

SMALL = dict(d_model=32, n_layers=4, n_heads=2, head_dim=16, vocab_size=64, chunk_size=16,
             fractions=(0.0, 0.25, 1.0), layer_hybrid_shares=(0.25,), train_lens=(32,),
             train_tokens=64, prefill_lens=(128,), decode_contexts=(136,), decode_steps=20,
             repeats=1, device="cpu")


def test_the_forms_and_what_they_hold(tmp_path: Path) -> None:
    config = ModelBenchConfig(**SMALL)
    names = [v.name for v in variants(config)]
    assert names == ["transformer", "all-linear", "nats@0", "nats@0.25", "nats@1",
                     "layer-hybrid@0.25"]
    hybrid = variants(config)[-1]
    assert hybrid.layer_types == ("linear", "linear", "linear", "softmax")
    assert hybrid.softmax_share == 0.25
    assert [v.layer_types for v in variants(ModelBenchConfig(
        **{**SMALL, "layer_hybrid_shares": (1.0, 0.5, 0.3)}))][-3:] == [
        ("softmax",) * 4, ("linear", "softmax") * 2, ("linear", "linear", "softmax", "linear")]
    # A share typed as 1/3 rounds to every 3rd layer, whatever its last digits.
    three = ModelBenchConfig(**{**SMALL, "n_layers": 3, "layer_hybrid_shares": (0.333,)})
    assert variants(three)[-1].layer_types == ("linear", "linear", "softmax")

    report = run_model_benchmark(config, tmp_path / "model.json", log=lambda _: None)
    assert json.loads((tmp_path / "model.json").read_text()) == json.loads(json.dumps(report))
    rows = {(r["variant"], r["measure"]): r for r in report["rows"]}
    assert len(rows) == len(names) * 3 and not any(r.get("oom") for r in report["rows"])
    for name in names:
        assert rows[(name, "train")]["tokens_per_s"] > 0 and rows[(name, "train")]["batch"] == 2
        assert rows[(name, "prefill")]["ms"] > 0 and rows[(name, "decode")]["ms_per_token"] > 0
    # The forced routes give the named share of 128 tokens (8 chunks, every 4th softmax).
    for f in (0.0, 0.25, 1.0):
        assert rows[(f"nats@{f:g}", "prefill")]["softmax_fraction"] == pytest.approx(f)
    # The KV cache follows the softmax share.
    kv = {name: rows[(name, "decode")]["kv_bytes"] for name in names}
    assert kv["nats@0"] < kv["nats@0.25"] < kv["nats@1"]
    assert kv["all-linear"] == 0 < kv["layer-hybrid@0.25"] < kv["transformer"]
    table = ratio_table(report)
    assert table.splitlines()[2].startswith("| transformer | ") and "(1.00x)" in table


def test_the_hybrid_ratios_are_to_the_all_linear_model_and_the_same_share() -> None:
    """Each NAtS-L variant over the all-linear model and over the layer hybrid of its own
    softmax share; a dash where that figure is missing (no such hybrid, out of memory)."""
    def row(variant: str, share: float, measure: str, length: int, **figure: float):
        return dict(variant=variant, softmax_share=share, measure=measure, length=length,
                    **figure)

    report = {"rows": [
        row("transformer", 1.0, "decode", 8192, ms_per_token=2.0),
        row("all-linear", 0.0, "train", 4096, tokens_per_s=200.0),
        row("all-linear", 0.0, "decode", 8192, ms_per_token=0.5),
        row("nats@0.25", 0.25, "train", 4096, tokens_per_s=150.0),
        row("nats@0.25", 0.25, "decode", 8192, ms_per_token=1.1),
        row("nats@0.5", 0.5, "train", 4096, oom=True),
        row("nats@0.5", 0.5, "decode", 8192, ms_per_token=1.5),
        row("layer-hybrid@0.25", 0.25, "train", 4096, tokens_per_s=180.0),
        row("layer-hybrid@0.25", 0.25, "decode", 8192, ms_per_token=1.0)]}
    assert hybrid_ratio_table(report).splitlines() == [
        "| x all-linear / x layer hybrid | train 4,096 (tokens/s) | decode 8,192 (ms/token) |",
        "|---|---|---|",
        "| nats@0.25 | 0.75x / 0.83x | 2.20x / 1.10x |",
        "| nats@0.5 | - / - | 3.00x / - |"]


def test_the_command_and_its_refusals(tmp_path: Path, capsys) -> None:
    args = ["bench", "model", "--device", "cpu", "--d-model", "32", "--n-layers", "2",
            "--n-heads", "2", "--head-dim", "16", "--vocab-size", "64", "--chunk-size", "16",
            "--fractions", "0.25", "--layer-hybrid-shares", "0.5", "--train-lens", "32",
            "--train-tokens", "32", "--prefill-lens", "64", "--decode-contexts", "20",
            "--decode-steps", "4", "--repeats", "1", "--out", str(tmp_path / "m.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| nats@0.25 | " in out and f"wrote {tmp_path / 'm.json'}" in out
    assert "| x all-linear / x layer hybrid | " in out
    assert main([*args, "--head-dim", "8"]) == 2  # 2 x 8 is not the width
    assert "n_heads x head_dim must be d_model" in capsys.readouterr().err
    assert main([*args, "--fractions", "1.5"]) == 2
    assert "--fractions must lie in [0, 1]" in capsys.readouterr().err
    assert main([*args, "--layer-hybrid-shares", "0.25"]) == 2  # under one layer of two
    assert "--layer-hybrid-shares must lie in [1/n_layers, 1] = [0.5, 1]" \
        in capsys.readouterr().err
    assert main([*args, "--device", "bogus"]) == 2
    assert "device 'bogus' is invalid" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path)]) == 2  # before measuring
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err
    assert main([*args, "--train-lens", "32", "64"]) == 2  # every length fills a step
    assert "--train-tokens 32 holds no sequence of 64 tokens" in capsys.readouterr().err
    assert main([*args, "--train-lens", "--prefill-lens", "--decode-contexts"]) == 2
    assert "nothing to measure" in capsys.readouterr().err
    assert main(["bench", "decode", "--steps", "0"]) == 2
    assert "--steps must be integers >= 1, got [0]" in capsys.readouterr().err
    assert main([*args, "--cuda-graph"]) == 2  # graphs replay on a GPU only
    assert "--cuda-graph replays CUDA graphs: it needs --device cuda, got 'cpu'" \
        in capsys.readouterr().err


def test_a_measure_given_no_lengths_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    assert main(["bench", "model", "--device", "cpu", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "2", "--head-dim", "16", "--vocab-size", "64", "--fractions",
                 "0.25", "--layer-hybrid-shares", "0.5", "--train-lens", "32", "--train-tokens",
                 "32", "--prefill-lens", "--decode-contexts", "--repeats", "1", "--out",
                 str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["measure"] for r in rows} == {"train"} and len(rows) == 4
    with pytest.raises(ValueError, match="compile must be True or False"):
        ModelBenchConfig(**{**SMALL, "compile": "yes"})
    with pytest.raises(ValueError, match="cuda_graph must be True or False"):
        ModelBenchConfig(**{**SMALL, "cuda_graph": 1})
    with pytest.raises(ValueError, match="--cuda-graph and --compile: give one"):
        ModelBenchConfig(**{**SMALL, "cuda_graph": True, "compile": True})


def test_device_cpu_defaults_to_a_small_model(tmp_path: Path, capsys) -> None:
    """``--device cpu`` alone checks the command on a small model (the GPU-sized defaults,
    138 M parameters up to 128k tokens, would run for hours there); sizes given still win."""
    out = tmp_path / "m.json"
    assert main(["bench", "model", "--device", "cpu", "--fractions", "0.25", "--out",
                 str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["d_model"], config["n_layers"], config["train_lens"],
            config["prefill_lens"], config["layer_hybrid_shares"]) == (32, 2, [32], [128], [0.5])
    assert main(["bench", "model", "--device", "cpu", "--fractions", "0.25", "--d-model", "64",
                 "--n-heads", "4", "--prefill-lens", "--decode-contexts", "--out",
                 str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["d_model"], config["n_heads"], config["head_dim"], config["prefill_lens"],
            config["train_tokens"]) == (64, 4, 16, [], 64)
    assert "| nats@0.25 | " in capsys.readouterr().out
