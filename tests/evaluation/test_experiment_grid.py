"""``experiments/common.run_grid --jobs N``: parallel runs give the sequential grid's numbers,
divergence is recorded from any process, other failures name the run, finished runs are
read back, and prefill is timed afterwards from the saved model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nats import NatsConfig
from nats.folder_lock import exclusive
from nats.trainers import TrainConfig
from nats.trainers.checkpoint import list_checkpoints

# The scripts' helper module, imported as they import it; spawned workers inherit the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import common

CUDA = torch.cuda.is_available()
GOOD_LR, DIVERGING_LR = 1e-2, 1e8  # 1e8 gives a NaN loss within 3 steps for both archs
ARCHS = ["transformer", "gdn"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Workers of ``--jobs 2`` on these 2 cores get 1 thread each; the in-process ``--jobs 1``
    run gets the same, so both do the same float operations in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _base(device: str = "cpu") -> TrainConfig:
    model = NatsConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                       layer_types=("nats", "nats"), rope=True)
    return TrainConfig(model=model, task="mqar", steps=10, batch_size=4, seq_len=32,
                       mqar_pairs=4, warmup_steps=1, eval_interval=10, eval_batches=1,
                       log_interval=5, checkpoint_interval=10, keep_checkpoints=1,
                       device=device)


def _grid(out: Path, jobs: int, archs: list[str] = ARCHS, lrs: tuple[float, ...] = (
        GOOD_LR, DIVERGING_LR), device: str = "cpu",
          settings: tuple[tuple[str, Any], ...] = ()) -> list[dict[str, Any]]:
    base = _base(device)
    slices = [base, base.replace(seq_len=64, mqar_pairs=8)]
    args = argparse.Namespace(scale="test", device=device, max_minutes=10.0, archs=archs,
                              out=out, jobs=jobs, no_prefill=False,
                              settings=list(settings))
    return common.run_grid("mqar", args, base, lrs, (0,), slices, eval_batches=1)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_two_jobs_give_the_sequential_grid_and_resume(tmp_path: Path) -> None:
    parallel, sequential = tmp_path / "parallel", tmp_path / "sequential"
    reports = _grid(parallel, jobs=2)
    _grid(sequential, jobs=1)

    tags = [f"{arch}-lr{GOOD_LR:g}-seed0" for arch in ARCHS]
    for out in (parallel, sequential):
        assert sorted(p.stem for p in out.glob("*.json") if p.stem != "summary") == sorted(tags)
    for tag in tags:
        a, b = _json(parallel / f"{tag}.json"), _json(sequential / f"{tag}.json")
        assert a["steps"] == b["steps"] == 10
        assert a["final_train_loss"] == b["final_train_loss"]  # same seed, same thread count
        for sa, sb in zip(a["slices"], b["slices"], strict=True):
            for key in ("accuracy", "sequence_accuracy", "loss", "softmax_fraction"):
                assert sa[key] == sb[key], (tag, sa["name"], key)
        assert a["prefill"] == b["prefill"] == []  # timed only on CUDA
        # Validated on the training stream, tested on another: the first slice is the
        # training setting itself, on different sequences.
        assert a["validation_loss"] == b["validation_loss"]
        assert a["validation_loss"] != a["slices"][0]["loss"]
    assert [(r["arch"], r["lr"]) for r in reports] == [(arch, GOOD_LR) for arch in ARCHS]

    for out, jobs in ((parallel, 2), (sequential, 1)):
        summary = _json(out / "summary.json")
        assert summary["jobs"] == jobs
        assert [(r["arch"], r["lr"], r["seed"]) for r in summary["runs"]] == \
            [(arch, GOOD_LR, 0) for arch in ARCHS]
        assert [d.split(" ")[0] for d in summary["diverged"]] == \
            [f"{arch}-lr{DIVERGING_LR:g}-seed0" for arch in ARCHS]
        assert all("training diverged" in d for d in summary["diverged"])
        assert summary["skipped"] == []
        common.write_table(out, "t", "table", [])
        shared = "Up to 2 runs trained at once" in (out / "table.md").read_text()
        assert shared == (jobs == 2)
    assert "nats: training" in (parallel / "runs" / tags[0] / "console.log").read_text()

    # Resume: a finished run is read back untouched, a deleted one is trained again.
    kept, redone = (parallel / f"{tag}.json" for tag in tags)
    kept_mtime, redone_report = kept.stat().st_mtime_ns, _json(redone)
    redone.unlink()
    shutil.rmtree(parallel / "runs" / tags[1])
    again = _grid(parallel, jobs=2, lrs=(GOOD_LR,))
    assert kept.stat().st_mtime_ns == kept_mtime
    assert again[0] == _json(kept)
    assert [(s["accuracy"], s["loss"]) for s in _json(redone)["slices"]] == \
        [(s["accuracy"], s["loss"]) for s in redone_report["slices"]]


def test_router_lr_scale_reaches_every_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          ) -> None:
    monkeypatch.setattr(sys, "argv", ["mqar.py", "--router-lr-scale", "5"])
    args, _ = common.parse_args("test", {"cpu": {"minutes": 1}})
    _grid(tmp_path / "grid", jobs=1, archs=["natsl-all"], lrs=(GOOD_LR,),
          settings=tuple(args.settings))
    saved = json.loads((tmp_path / "grid" / "runs" / "natsl-all-lr0.01-seed0" /
                        "train_config.json").read_text())
    assert saved["router_lr_scale"] == 5.0 and _base().router_lr_scale == 1.0


def test_settings_reach_every_run_and_forced_rows_route_one_side(tmp_path: Path) -> None:
    reports = _grid(tmp_path / "grid", jobs=1, archs=["natsl-all:softmax", "natsl-all:linear"],
                    lrs=(GOOD_LR,), settings=(("branch_norm", "linear"), ("budget_anneal", 0.5)))
    for tag in ("natsl-all_softmax-lr0.01-seed0", "natsl-all_linear-lr0.01-seed0"):
        saved = _json(tmp_path / "grid" / "runs" / tag / "train_config.json")
        assert saved["budget_anneal"] == 0.5 and saved["model"]["branch_norm"] == "linear"
    assert [r["slices"][0]["softmax_fraction"] for r in reports] == [1.0, 0.0]
    with pytest.raises(ValueError, match="branch_nrom"):
        common.with_settings(_base(), {"branch_nrom": "linear"})


@pytest.mark.parametrize("text", ["lr", "=1", "steps=3"])
def test_set_parses_field_equals_json(text: str) -> None:
    if "=" not in text[1:]:
        with pytest.raises(argparse.ArgumentTypeError):
            common._setting(text)
    else:
        assert common._setting(text) == ("steps", 3)
    assert common._setting("branch_norm=linear") == ("branch_norm", "linear")


def test_learning_rate_is_chosen_on_validation_not_test() -> None:
    runs = [{"arch": "gdn", "seed": 0, "lr": lr, "validation_loss": val,
             "slices": [{"accuracy": acc}]}
            for lr, val, acc in ((1e-3, 2.0, 0.9), (1e-2, 1.5, 0.1))]
    assert [r["lr"] for r in common.best_per_seed(runs)["gdn"]] == [1e-2]


def test_an_interrupted_run_writes_no_report_and_resumes(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C makes the trainer save a checkpoint and return early: that run must not be
    read back as finished, and the next call continues it from the checkpoint."""
    real_train = common.train

    def cut_short(config: TrainConfig, **kwargs: Any):
        result = real_train(config.replace(steps=5), **kwargs)
        return dataclasses.replace(result, interrupted=True)

    monkeypatch.setattr(common, "train", cut_short)
    tag = f"transformer-lr{GOOD_LR:g}-seed0"
    with pytest.raises(SystemExit, match=r"the same command resumes: .*interrupted at step 5"):
        _grid(tmp_path, jobs=1, archs=["transformer"], lrs=(GOOD_LR,))
    assert not (tmp_path / f"{tag}.json").exists()

    monkeypatch.setattr(common, "train", real_train)
    (report,) = _grid(tmp_path, jobs=1, archs=["transformer"], lrs=(GOOD_LR,))
    assert report["steps"] == 10
    assert report["final_train_loss"] is not None  # steps 6..10 ran in this call
    assert _json(tmp_path / f"{tag}.json")["steps"] == 10


def test_a_script_row_resumes_after_an_interruption_and_is_read_back_once_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_row`` (the one-row-per-seed scripts): a row cut short is continued by the
    next call from its checkpoint, not refused; a finished row is not trained again."""
    real_train = common.train
    config = _base().replace(out_dir=str(tmp_path / "row"))

    def cut_short(config: TrainConfig, **kwargs: Any):
        result = real_train(config.replace(steps=5), **kwargs)
        return dataclasses.replace(result, interrupted=True)

    monkeypatch.setattr(common, "train", cut_short)
    with pytest.raises(KeyboardInterrupt, match="interrupted at step 5"):
        common.train_row(config)
    assert not (tmp_path / "row" / common.ROW_METRICS_FILE).exists()

    monkeypatch.setattr(common, "train", real_train)
    metrics = common.train_row(config)
    assert list_checkpoints(tmp_path / "row")[-1][0] == 10 and 0 <= metrics["eval/acc"] <= 1

    def no_training(*_: Any, **__: Any) -> None:
        raise AssertionError("a finished row was trained again")

    monkeypatch.setattr(common, "train", no_training)
    assert common.train_row(config) == metrics
    with pytest.raises(ValueError, match="holds a row of another config"):
        common.train_row(config.replace(lr=config.lr * 2))


def test_a_row_finished_before_its_metrics_were_written_is_evaluated(tmp_path: Path) -> None:
    """A run trained to the end whose metrics file is missing (trained by an older script,
    or killed just before the write): its saved model is evaluated, as training would."""
    config = _base().replace(out_dir=str(tmp_path / "row"))
    trained = common.train(config)
    metrics = common.train_row(config)
    assert metrics == pytest.approx(trained.eval_metrics)
    assert json.loads((tmp_path / "row" / common.ROW_METRICS_FILE).read_text())[
        "metrics"] == metrics


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_workers_with_a_checkpoint(tmp_path: Path, sig: signal.Signals,
                                                      ) -> None:
    """``kill`` of the script (what a job scheduler sends) or Ctrl-C must stop its worker
    processes with a checkpoint each, not leave them training on, orphaned, with their
    folders locked against the command that resumes them, nor end in a traceback."""
    archs, endless = ["transformer", "gdn"], 10**6  # only the signal ends these runs
    logs = [tmp_path / "runs" / f"{arch}-lr{GOOD_LR:g}-seed0" / "console.log" for arch in archs]

    def signal_once_training() -> None:
        # Polled without a deadline: the runs cannot end before the signal arrives.
        while not all(p.is_file() and "nats: training" in p.read_text() for p in logs):
            time.sleep(0.2)
        # SIGTERM goes to the script alone, as ``kill PID`` sends it; Ctrl-C in a terminal
        # reaches every process of the foreground group.
        targets = [] if sig == signal.SIGTERM else multiprocessing.active_children()
        for pid in [os.getpid(), *(child.pid for child in targets)]:
            os.kill(pid, sig)

    sender = threading.Thread(target=signal_once_training, daemon=True)
    sender.start()
    with pytest.raises(SystemExit, match="interrupted, the same command resumes") as stopped:
        _grid(tmp_path, jobs=2, archs=archs, lrs=(GOOD_LR,),
              settings=(("steps", endless), ("checkpoint_interval", endless)))
    sender.join()
    assert multiprocessing.active_children() == []
    for arch, log in zip(archs, logs, strict=True):
        assert f"{arch}-lr{GOOD_LR:g}-seed0" in str(stopped.value)
        assert f"{sig.name}: stopping after this step" in log.read_text()
        (checkpoint,) = list_checkpoints(log.parent)
        assert 0 < checkpoint[0] < endless
        with exclusive(log.parent):  # released: the same command can resume it
            pass
    assert not list(tmp_path.glob("*.json"))  # no half-trained run reported as finished


def test_a_failing_worker_names_its_run(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"mqar run mamba-lr0\.01-seed0 failed: .*mamba"):
        _grid(tmp_path, jobs=2, archs=["mamba"], lrs=(GOOD_LR,))


def test_prefill_is_timed_from_the_saved_model(tmp_path: Path) -> None:
    _grid(tmp_path, jobs=1, archs=["gdn"], lrs=(GOOD_LR,))
    report = _json(tmp_path / f"gdn-lr{GOOD_LR:g}-seed0.json")
    common.add_prefill(report, tmp_path / "runs" / f"gdn-lr{GOOD_LR:g}-seed0", _base(),
                       torch.device("cpu"))
    (prefill,) = report["prefill"]
    assert prefill["seq_len"] == common.PREFILL_LEN and prefill["batch_size"] == 1
    assert prefill["seconds"] > 0


@pytest.mark.parametrize("text", ["0", "-1", "two"])
def test_jobs_must_be_a_positive_integer(text: str, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["mqar.py", "--jobs", text])
    with pytest.raises(SystemExit) as exit_info:
        common.parse_args("test", {"cpu": {"minutes": 1}})
    assert exit_info.value.code == 2
    assert f"--jobs: must be an integer >= 1, got '{text}'" in capsys.readouterr().err


@pytest.mark.gpu
def test_parallel_gpu_grid_times_prefill_afterwards(tmp_path: Path) -> None:
    _grid(tmp_path, jobs=2, lrs=(GOOD_LR,), device="cuda")
    for arch in ARCHS:
        (prefill,) = _json(tmp_path / f"{arch}-lr{GOOD_LR:g}-seed0.json")["prefill"]
        assert prefill["seq_len"] == common.PREFILL_LEN and prefill["seconds"] > 0
    assert all(r["prefill"] for r in _json(tmp_path / "summary.json")["runs"])


def test_settings_win_over_the_rows_architecture(tmp_path: Path) -> None:
    """``--set layer_types=...`` trains that mix (a NAtS-L layer before a Gated DeltaNet one,
    which no row names), not the row's."""
    reports = _grid(tmp_path / "grid", jobs=1, archs=["natsl-all"], lrs=(GOOD_LR,),
                    settings=(("layer_types", ["nats", "linear"]),))
    saved = _json(tmp_path / "grid" / "runs" / "natsl-all-lr0.01-seed0" / "train_config.json")
    assert saved["model"]["layer_types"] == ["nats", "linear"]
    assert reports[0]["model"]["layer_types"] == ["nats", "linear"]
    assert reports[0]["slices"][0]["layers"][1]["softmax_fraction"] == 0.0
