"""Checkpoints round-trip model, optimizer and RNG exactly, through safetensors only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nats import NatsForCausalLM
from nats.atomic_write import atomic_write_bytes
from nats.trainers import build_batches, latest_checkpoint, load_checkpoint, save_checkpoint
from nats.trainers.checkpoint import list_checkpoints, read_checkpoint_meta
from nats.trainers.optim import build_optimizer

from .conftest import MicroConfig


def _trained(config, steps: int):
    torch.manual_seed(config.seed)
    model = NatsForCausalLM(config.model)
    optimizer = build_optimizer(model, config)
    batches = build_batches(config)
    for step in range(steps):
        x, y = batches.train(step)
        model(x, labels=y).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_round_trip_restores_everything(micro: MicroConfig) -> None:
    config = micro()
    model, optimizer = _trained(config, 2)
    path = save_checkpoint(config.out_dir, 2, model, optimizer, config.to_dict(), keep=2)
    expected_draw = torch.rand(4)

    other, other_opt = _trained(config.replace(seed=1), 1)
    torch.manual_seed(123)
    restored = load_checkpoint(path, other, other_opt)

    assert restored.step == 2 and restored.config == config.to_dict()
    assert torch.equal(torch.rand(4), expected_draw)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    want, got = optimizer.state_dict(), other_opt.state_dict()
    # JSON keeps the param groups' values; only the betas tuple comes back as a list.
    assert json.loads(json.dumps(want["param_groups"])) == got["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for idx, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got["state"][idx][key]), (idx, key)
    assert set(load_file(str(path))) >= {"rng/cpu", "optimizer/0/exp_avg", "model/embed.weight"}


def test_keeps_the_newest_and_leaves_no_temporary_files(micro: MicroConfig) -> None:
    config = micro()
    model, optimizer = _trained(config, 0)
    for step in (1, 2, 10, 3):
        save_checkpoint(config.out_dir, step, model, optimizer, {}, keep=2)
    assert [s for s, _ in list_checkpoints(config.out_dir)] == [3, 10]
    assert latest_checkpoint(config.out_dir).name == "step_00000010.safetensors"
    assert sorted(p.name for p in (Path(config.out_dir) / "checkpoints").iterdir()) == [
        "step_00000003.safetensors", "step_00000010.safetensors"]
    assert latest_checkpoint(Path(config.out_dir) / "nowhere") is None


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_rejects_foreign_safetensors(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="not a nats checkpoint"):
        read_checkpoint_meta(tmp_path / "w.safetensors")
