"""TrainConfig validation names the field and what it allows; presets are valid runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nats import ConfigError, NatsConfig
from nats.trainers import PRESETS, TrainConfig, preset, run_config, save_checkpoint
from nats.trainers.loop import build_optimizer

from .conftest import MicroConfig


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_valid_and_round_trip_through_json(name: str) -> None:
    config = preset(name)
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_tiny_preset_is_a_small_nats_model() -> None:
    config = preset("tiny")
    assert set(config.model.layer_types) == {"nats"} and config.device == "auto"
    assert config.model.d_model <= 64 and config.steps <= 300


@pytest.mark.parametrize(("changes", "field", "allowed"), [
    ({"task": "poems"}, "task", "'copy', 'mqar', 'needle', 'text'"),
    ({"steps": 0}, "steps", "integer >= 1"),
    ({"batch_size": 2.5}, "batch_size", "integer >= 1"),
    ({"warmup_steps": -1}, "warmup_steps", "integer >= 0"),
    ({"lr": 0.0}, "lr", "number > 0"),
    ({"lr": float("nan")}, "lr", "number > 0"),
    ({"lr": float("inf")}, "lr", "finite number > 0"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio", "[0, 1]"),
    ({"weight_decay": -0.1}, "weight_decay", ">= 0"),
    ({"weight_decay": float("inf")}, "weight_decay", "a finite number >= 0"),  # nan at step 2
    ({"weight_decay": True}, "weight_decay", "a finite number >= 0"),
    ({"min_lr_ratio": True}, "min_lr_ratio", "a number in [0, 1]"),  # bool counts as 1
    ({"val_fraction": float("nan")}, "val_fraction", "a number in [0, 1]"),
    ({"device": "gpu"}, "device", "'cuda:N'"),
    ({"out_dir": ""}, "out_dir", "non-empty path"),
    ({"data_paths": ["a"]}, "data_paths", "tuple"),
    ({"copy_symbols": 64}, "copy_symbols", "vocab_size - 1 = 63"),
    ({"task": "mqar", "mqar_pairs": 9, "seq_len": 32}, "seq_len", "4 * mqar_pairs = 36"),
    ({"task": "mqar", "mqar_pairs": 40, "seq_len": 512}, "mqar_pairs", "= 31"),
    ({"task": "text"}, "model.vocab_size", "at least 256"),
    ({"eval_seed": -1}, "eval_seed", "integer >= 0"),
    ({"data_format": "xml"}, "data_format", "'parquet', 'saved'"),
    ({"text_field": ""}, "text_field", "non-empty string"),
    ({"data_glob": ""}, "data_glob", "non-empty string"),
    ({"tokenizer": ""}, "tokenizer", "tokenizer.json"),
    ({"streaming": "yes"}, "streaming", "true or false"),
    ({"cuda_graph": 1}, "cuda_graph", "true, false or null"),
    ({"cuda_graph": "auto"}, "cuda_graph", "true, false or null"),
    ({"cuda_graph": True, "compile": True}, "cuda_graph", "false with compile = true"),
    ({"cuda_graph": True, "route_explore": 0.2}, "cuda_graph", "route_explore = 0.2"),
    ({"cuda_graph": True, "device": "cpu"}, "cuda_graph", "false on device cpu"),
    ({"needle_key_len": 0}, "needle_key_len", "integer >= 1"),
    ({"task": "needle", "model": NatsConfig(vocab_size=15)}, "model.vocab_size", "at least 16"),
    ({"task": "needle", "seq_len": 20}, "seq_len", "+ 7) + 1 = 21"),
])
def test_bad_values_name_the_field_and_the_allowed_values(
        micro: MicroConfig, changes: dict[str, Any], field: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        micro(**changes)
    assert f"TrainConfig.{field} = " in str(err.value)
    assert allowed in str(err.value)


def test_from_dict_rejects_unknown_fields_and_bad_models(micro: MicroConfig) -> None:
    data = micro().to_dict()
    with pytest.raises(ConfigError, match=r"unknown TrainConfig field.*'stepz'"):
        TrainConfig.from_dict({**data, "stepz": 3})
    with pytest.raises(ConfigError, match=r"NatsConfig\.chunk_size"):
        TrainConfig.from_dict({**data, "model": {**data["model"], "chunk_size": 3}})
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'.*tiny"):
        preset("huge")
    with pytest.raises(ConfigError, match=r"TrainConfig\.model = 5 .*NatsConfig dict"):
        TrainConfig.from_dict({**data, "model": 5})


def test_run_config_resumes_with_the_saved_config(micro: MicroConfig) -> None:
    saved = micro(seq_len=17, seed=4)
    model_config = preset("tiny").model
    fresh = run_config("tiny", {"out_dir": saved.out_dir, "steps": 9}, resume=True)
    assert fresh == preset("tiny").replace(out_dir=saved.out_dir, steps=9)

    from nats import NatsForCausalLM

    model = NatsForCausalLM(saved.model)
    save_checkpoint(saved.out_dir, 3, model, build_optimizer(model, saved), saved.to_dict(),
                    keep=1)
    resumed = run_config("tiny", {"out_dir": saved.out_dir, "steps": 9}, resume=True)
    assert resumed == saved.replace(steps=9) and resumed.model != model_config
    assert run_config("tiny", {"out_dir": saved.out_dir}, resume=False).seq_len == 17


def test_resuming_with_changed_settings_says_which(micro: MicroConfig, capsys) -> None:
    """``--resume --lr 0.5 --task mqar`` went on with the new settings without a word."""
    from nats import NatsForCausalLM

    saved = micro()
    model = NatsForCausalLM(saved.model)
    save_checkpoint(saved.out_dir, 3, model, build_optimizer(model, saved), saved.to_dict(),
                    keep=1)
    capsys.readouterr()
    run_config(None, {"out_dir": saved.out_dir}, resume=True)
    assert capsys.readouterr().err == ""
    run_config(None, {"out_dir": saved.out_dir, "lr": 0.5, "steps": 9}, resume=True)
    assert capsys.readouterr().err == (
        "nats: warning: resuming with changed settings: steps 6 -> 9, lr 0.003 -> 0.5; the "
        "learning-rate schedule and the routing cost's start follow the new steps\n")
    # A preset or config file named with --resume is not what the run goes on with.
    resumed = run_config("bytes-small", {"out_dir": saved.out_dir}, resume=True)
    assert resumed == saved
    assert capsys.readouterr().err == (
        "nats: warning: --preset bytes-small ignored: a resumed run keeps the settings of its "
        "checkpoint (change one with its own option, e.g. --lr)\n")


def test_run_config_resumes_a_run_stopped_before_its_first_checkpoint(
        micro: MicroConfig) -> None:
    """Killed before its first checkpoint, a run's only record of its config is its
    ``train_config.json``: resuming starts over with that, not with the preset."""
    saved = micro(seq_len=49, lr=0.005, seed=4)
    out = Path(saved.out_dir)
    out.mkdir(parents=True)
    (out / "train_config.json").write_text(json.dumps(saved.to_dict()))
    resumed = run_config("tiny", {"out_dir": saved.out_dir, "steps": 9}, resume=True)
    assert resumed == saved.replace(steps=9)
    assert run_config("tiny", {"out_dir": saved.out_dir}, resume=False).seq_len == 17


def test_run_config_applies_model_and_run_overrides_together() -> None:
    """A text task needs 256 symbols: valid with ``--vocab-size 256`` given beside it,
    whatever the preset's vocabulary; the architecture replaces the mixers first."""
    config = run_config("tiny", {"task": "text"}, resume=False,
                        model_overrides={"vocab_size": 256}, arch=("gdn", 2))
    assert config.task == "text" and config.model.vocab_size == 256
    assert set(config.model.layer_types) == {"linear"}
    with pytest.raises(ConfigError, match="at least 256"):
        run_config("tiny", {"task": "text"}, resume=False)


def test_text_options_on_a_generated_task_are_refused(tmp_path: Path, capsys) -> None:
    """``--data``, ``--tokenizer`` ... on an MQAR run trained MQAR and ignored them."""
    from nats.cli import main

    assert main(["train", "--preset", "mqar-tiny", "--data", "corpus.txt", "--tokenizer",
                 "tok", "--streaming", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == (
        "nats: error: --data, --tokenizer, --streaming: read by task 'text' only, and this "
        "run's task is 'mqar' (add --task text to train on text)\n")
    assert not (tmp_path / "r").exists()
