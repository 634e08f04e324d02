"""Checkpoints round-trip model, optimizer and RNG exactly, through safetensors only."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(micro: MicroConfig, capsys,
                                                            damage: str) -> None:
    """A newest checkpoint cut short (a full disk, an interrupted copy) or with a byte
    changed inside its tensor data (which safetensors loads without complaint) is skipped
    with a warning; the run resumes from the older one and ends as if never damaged."""
    from nats.trainers import train

    straight = train(micro(steps=6, checkpoint_interval=2,
                           out_dir=str(Path(micro().out_dir).parent / "straight")))
    config = micro(steps=4, checkpoint_interval=2, keep_checkpoints=2)
    train(config)
    newest = latest_checkpoint(config.out_dir)
    assert newest.name == "step_00000004.safetensors"
    data = bytearray(newest.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[-100] ^= 0x01  # inside the last tensor's bytes, past header and metadata
    newest.write_bytes(bytes(data))
    resumed = train(config.replace(steps=6), resume=True)
    out = capsys.readouterr().out
    assert "warning: skipping step_00000004.safetensors" in out
    assert "resuming from" in out and "at step 2" in out
    assert resumed.step == 6
    assert resumed.train_losses == straight.train_losses[2:]
    # Moved aside: latest_checkpoint, export and pruning no longer see it.
    assert newest.with_name(newest.name + ".corrupt").is_file()


def _rewrite(path: Path, meta_change=None, tensor_change=None) -> None:
    """Rewrite a checkpoint as another program might have: well-formed, wrong inside
    (no digest, so only the contents can be wrong)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    meta = json.loads(header["nats"])
    meta.pop("digest")
    tensors = load_file(str(path))
    if meta_change:
        meta_change(meta)
    if tensor_change:
        tensor_change(tensors)
    save_file(tensors, str(path), metadata={**header, "nats": json.dumps(meta)})


@pytest.mark.parametrize("damage", ["step a string", "no optimizer state", "config a number",
                                    "no RNG state", "a tensor of the wrong shape"])
def test_a_well_formed_checkpoint_with_wrong_contents_is_skipped(
        micro: MicroConfig, capsys, damage: str) -> None:
    """Damaged metadata or tensors that do not fit the model are a damaged checkpoint
    (skipped for the older one with a one-line warning), not a traceback."""
    from nats.trainers import train

    config = micro(steps=4, checkpoint_interval=2, keep_checkpoints=2)
    train(config)
    newest = latest_checkpoint(config.out_dir)

    def wrong_shape(tensors: dict) -> None:
        key = next(k for k in tensors if k.startswith("model/"))
        tensors[key] = torch.zeros(3)

    meta_change, tensor_change = {
        "step a string": (lambda m: m.update(step="4"), None),
        "no optimizer state": (lambda m: m.pop("optimizer"), None),
        "config a number": (lambda m: m.update(config=5), None),
        "no RNG state": (None, lambda t: t.pop("rng/cpu")),
        "a tensor of the wrong shape": (None, wrong_shape)}[damage]
    _rewrite(newest, meta_change, tensor_change)
    resumed = train(config.replace(steps=6), resume=True)
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if "warning: skipping" in line)
    assert "step_00000004.safetensors" in warning
    assert "resuming from" in out and "at step 2" in out and resumed.step == 6


def test_resume_refuses_fewer_steps_than_the_checkpoint_holds(micro: MicroConfig) -> None:
    from nats.trainers import train

    config = micro(steps=4, checkpoint_interval=2)
    train(config)
    with pytest.raises(ValueError, match=r"at step 4 for 2 steps: give --steps 4 or more"):
        train(config.replace(steps=2), resume=True)


def test_resume_with_no_checkpoint_says_it_starts_over(micro: MicroConfig, capsys) -> None:
    from nats.trainers import train

    result = train(micro(steps=1), resume=True)
    assert result.step == 1 and "holds no checkpoint: starting from step 0" in \
        capsys.readouterr().out


def test_a_run_stopped_before_its_first_checkpoint_is_kept_or_started_over(
        micro: MicroConfig) -> None:
    """Its folder (``train_config.json`` and the events of steps 0-5, no checkpoint) is
    not trained over without ``--resume``; resumed, it starts over and the old events
    are gone from TensorBoard's view."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from nats.trainers import train

    config = micro(steps=2)
    out = Path(config.out_dir)
    out.mkdir(parents=True)
    (out / "train_config.json").write_text(json.dumps(config.to_dict()))
    with SummaryWriter(str(out)) as old:
        for step in range(6):
            old.add_scalar("train/loss", 99.0, step)
    with pytest.raises(FileExistsError, match=r"a run without a checkpoint .*--resume"):
        train(config)
    train(config, resume=True)
    events = EventAccumulator(str(out), size_guidance={"scalars": 0})
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2] and all(e.value < 99 for e in losses)


def test_atomic_writes_clean_up_after_a_killed_writer_and_keep_normal_permissions(
        tmp_path: Path) -> None:
    """A writer killed mid-write leaves ``.NAME.*.tmp`` behind (145-254 MB for a checkpoint);
    the next write of that file removes it. Files get the umask's permissions, not 0600."""
    target = tmp_path / "model.safetensors"
    stale = tmp_path / ".model.safetensors.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    other = tmp_path / ".config.json.xyz.tmp"  # another file's: not this write's business
    other.write_bytes(b"{")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new" and not stale.exists() and other.exists()
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_checkpoints_from_before_the_scorer_group_resume(micro: MicroConfig) -> None:
    """Checkpoints written when the optimizer had two groups (matrices, vectors) load into
    today's three (the scorers apart), each parameter's Adam state where it belongs."""
    config = micro()
    torch.manual_seed(0)
    model = NatsForCausalLM(config.model)
    params = [p for p in model.parameters() if p.requires_grad]
    legacy = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                {"params": [p for p in params if p.dim() < 2]}], lr=1e-3)
    x, y = build_batches(config).train(0)
    model(x, labels=y).loss.backward()
    legacy.step()
    path = save_checkpoint(config.out_dir, 1, model, legacy, config.to_dict(), keep=1)

    fresh = NatsForCausalLM(config.model)
    optimizer = build_optimizer(fresh, config.replace(router_lr_scale=2.0))
    load_checkpoint(path, fresh, optimizer)
    assert len(optimizer.param_groups) == 3
    scorer = fresh.nats_layers[0].scorer.proj.weight
    old_scorer = model.nats_layers[0].scorer.proj.weight
    assert torch.equal(optimizer.state[scorer]["exp_avg"], legacy.state[old_scorer]["exp_avg"])
    embed, old_embed = fresh.embed.weight, model.embed.weight
    assert torch.equal(optimizer.state[embed]["exp_avg"], legacy.state[old_embed]["exp_avg"])
    assert optimizer.param_groups[2]["lr_scale"] == 2.0  # the config's, not the file's
    assert optimizer.param_groups[2]["weight_decay"] == 0.0


@pytest.mark.parametrize(("saved", "visible", "restored", "warned"),
                         [(2, 1, [0], True), (1, 2, [0], True), (2, 2, [0, 1], False),
                          (1, 0, [], True), (0, 0, [], False)])
def test_gpu_random_states_follow_the_gpus_visible(monkeypatch, capsys, saved: int,
                                                   visible: int, restored: list[int],
                                                   warned: bool) -> None:
    """A run saved with 2 GPUs visible (torchrun, or no CUDA_VISIBLE_DEVICES) resumed where
    1 is: every checkpoint was refused as damaged (IndexError in set_rng_state_all)."""
    from nats.trainers import checkpoint

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, i: calls.append(i))
    cpu = torch.get_rng_state()
    tensors = {"rng/cpu": cpu, **{f"rng/cuda/{i}": cpu.clone() for i in range(saved)}}
    checkpoint.restore_rng(tensors)
    assert calls == restored
    err = capsys.readouterr().err
    assert (f"holds the random state of {saved} GPU(s) and this process sees {visible}"
            in err) == warned
