"""Tiny searches on the CPU with a local Ray: results, front and export agree; an
interrupted search resumes; the command's errors are one line."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from nats.cli import main
from nats.search_spaces.objectives import COSTS, QUALITY
from nats.search_spaces.pareto import pareto_front

ray = pytest.importorskip("ray")

TINY = ["--steps", "6", "--cpus-per-trial", "1"]
"""The mqar-search base at 6 steps: a trial trains in about a second."""


@pytest.fixture(autouse=True)
def state_key(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signing key of the Tune state: a test's own, not the user's."""
    monkeypatch.setenv("NATS_STATE_KEY_FILE",
                       str(tmp_path_factory.mktemp("key") / "search-state.key"))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _check_consistent(out: Path, metric: str = "loss", cost: str = "flops") -> dict:
    """results.csv, pareto.json, pareto.png and export/ agree with each other."""
    rows = _rows(out)
    (qk, qm), (ck, cm) = QUALITY[metric], COSTS[cost]
    done = [r for r in rows if r["status"] == "done"]
    points = [(float(r[qk]), float(r[ck])) for r in done]
    expected = {done[i]["trial_id"] for i in pareto_front(points, [qm, cm])}
    front = json.loads((out / "pareto.json").read_text())
    assert [o["metric"] for o in front["objectives"]] == [qk, ck]
    assert {t["trial_id"] for t in front["trials"]} == expected
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    exported = json.loads((out / "export" / "config.json").read_text())
    matches = []
    for trial in front["trials"]:
        run = json.loads((out / "trials" / trial["trial_id"] / "train_config.json").read_text())
        if run["model"] == {k: exported[k] for k in run["model"]}:
            matches.append(trial["trial_id"])
    assert matches, "the exported config is none of the front's trials"
    return {"rows": rows, "front": front, "exported": exported}


def test_search_writes_consistent_results(tmp_path: Path, local_ray, capsys) -> None:
    out = tmp_path / "search"
    # ASHA stops some trials at their last report, which must not cost them their model;
    # NSGA-II and a journal file for the Optuna study.
    study = tmp_path / "study.log"
    sigint = signal.getsignal(signal.SIGINT)
    assert main(["search", *TINY, "--num-trials", "3", "--out", str(out), "--seed", "3",
                 "--asha", "--sampler", "nsga2", "--optuna-storage", str(study)]) == 0
    assert signal.getsignal(signal.SIGINT) is sigint  # Tune's handler does not stay behind
    printed = capsys.readouterr().out
    got = _check_consistent(out)
    assert len(got["rows"]) == 3 and all(r["status"] == "done" for r in got["rows"])
    assert "Pareto front" in printed and "exported trial" in printed
    # The default pick is the front's best quality.
    best = min(got["front"]["trials"], key=lambda t: t["eval/ce"])
    assert f"exported trial {best['trial_id']}" in printed
    # The Optuna study saw every trial complete, with both objectives.
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    loaded = optuna.load_study(study_name="nats-search",
                               storage=JournalStorage(JournalFileBackend(str(study))))
    assert [t.state.name for t in loaded.trials] == ["COMPLETE"] * 3
    assert all(len(t.values) == 2 for t in loaded.trials)
    # Every trial logged to TensorBoard under the one logdir.
    for row in got["rows"]:
        assert list((out / "trials" / row["trial_id"]).glob("events.out.tfevents.*"))
    # show reprints, and --pick exports another front entry.
    assert main(["search", "show", str(out)]) == 0
    assert "Pareto front" in capsys.readouterr().out
    last = len(got["front"]["trials"])
    assert main(["search", "show", str(out), "--pick", str(last)]) == 0
    picked = got["front"]["trials"][last - 1]["trial_id"]
    assert f"exported trial {picked}" in capsys.readouterr().out
    # A second search into the same folder is refused.
    assert main(["search", *TINY, "--out", str(out)]) == 2
    assert "already holds a search" in capsys.readouterr().err


def test_a_trial_whose_worker_dies_resumes_from_its_checkpoint(tmp_path: Path, local_ray,
                                                              capsys) -> None:
    out = tmp_path / "search"
    killed: list[int] = []

    def kill_worker_after_a_checkpoint() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for path in (out / "trials").glob("*/search_trial.json"):
                record = json.loads(path.read_text())
                saved = path.parent / "checkpoints" / "step_00000200.safetensors"
                if saved.exists() and record["status"] == "running":
                    os.kill(record["pid"], signal.SIGKILL)
                    killed.append(record["pid"])
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_worker_after_a_checkpoint, daemon=True)
    watcher.start()
    status = main(["search", "--steps", "300", "--num-trials", "1", "--out", str(out)])
    watcher.join()
    assert killed and status == 0
    (record_file,) = (out / "trials").glob("*/search_trial.json")
    record = json.loads(record_file.read_text())
    assert record["status"] == "done" and record["step"] == 300
    assert record["pid"] != killed[0] and record["resumed_from"] >= 200
    assert _rows(out)[0]["status"] == "done"


def test_interrupted_search_resumes(tmp_path: Path, local_ray, capsys) -> None:
    out = tmp_path / "search"
    stop = threading.Event()
    finished: dict[str, int] = {}

    def interrupt_after_first_trial() -> None:
        # One trial at a time: the second starts once Tune has the first one finished.
        # Tune stops the experiment on SIGUSR1 (as on Ctrl-C) and saves its state.
        while not stop.is_set():
            records = list((out / "trials").glob("*/search_trial.json"))
            if len(records) >= 2:
                for path in records:
                    if json.loads(path.read_text())["status"] == "done":
                        finished[path.parent.name] = (path.parent / "model").stat().st_mtime_ns
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=interrupt_after_first_trial, daemon=True)
    watcher.start()
    try:
        status = main(["search", "--steps", "40", "--num-trials", "3", "--max-concurrent", "1",
                       "--metric", "acc", "--cost", "kv", "--out", str(out)])
    finally:
        stop.set()
        watcher.join()
    assert status == 130
    assert "nats search --resume" in capsys.readouterr().err
    assert not (out / "export").exists()
    assert len(finished) == 1

    assert main(["search", "--resume", str(out)]) == 0
    got = _check_consistent(out, metric="acc", cost="kv")
    assert len(got["rows"]) == 3 and all(r["status"] == "done" for r in got["rows"])
    # Finished trials were kept, not trained again.
    for trial_id, mtime in finished.items():
        assert (out / "trials" / trial_id / "model").stat().st_mtime_ns == mtime


def test_latency_cost_is_measured_per_trial(tmp_path: Path, local_ray, capsys) -> None:
    out = tmp_path / "search"
    assert main(["search", *TINY, "--num-trials", "2", "--cost", "latency",
                 "--latency-len", "64", "--out", str(out)]) == 0
    got = _check_consistent(out, cost="latency")
    latencies = [float(r["cost/latency_ms"]) for r in got["rows"]]
    assert len(latencies) == 2 and all(ms > 0 for ms in latencies)
    # Each trial says where it ran and for how long (for trials-per-hour on a cluster).
    assert all(r["node"] and float(r["wall_s"]) > 0 for r in got["rows"])
    for row in got["rows"]:
        record = json.loads((out / "trials" / row["trial_id"] / "search_trial.json").read_text())
        assert record["metrics"]["cost/latency_ms"] == float(row["cost/latency_ms"])


def test_a_refused_cluster_connection_names_token_authentication(monkeypatch, capsys) -> None:
    """Ray >= 2.59 clusters from `ray start` require a token that a client only sends with
    RAY_AUTH_MODE=token: the one-line error says so (seen with Ray 2.60 here)."""
    import nats.search_spaces.search as search

    def refuse(**kwargs) -> None:
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConnectionError, match="set RAY_AUTH_MODE=token"):
        search._ray_init("10.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(ConnectionError) as refused:
        search._ray_init("10.0.0.1:6379")
    assert str(refused.value) == "Failed to connect to Ray cluster at 10.0.0.1:6379"


class _Planted:
    """A pickle that, when loaded, creates a file: what a crafted folder could carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_resume_restores_only_tune_state_this_user_signed(tmp_path: Path, local_ray,
                                                           capsys) -> None:
    out = tmp_path / "search"
    assert main(["search", *TINY, "--num-trials", "1", "--out", str(out)]) == 0
    assert (out / "tune_state.sig").is_file()
    marker = tmp_path / "planted-code-ran"
    tuner_pkl = next((out / "tune").rglob("tuner.pkl"))
    tuner_pkl.write_bytes(pickle.dumps(_Planted(marker)))
    for _ in range(2):  # a refusal must not sign what it refused
        assert main(["search", "--resume", str(out)]) == 2
        err = capsys.readouterr().err
        assert "does not match its signature" in err and err.count("\n") == 1
    assert not marker.exists()
    (out / "tune_state.sig").unlink()  # a driver killed before it signed
    assert main(["search", "--resume", str(out)]) == 2
    assert "is not signed" in capsys.readouterr().err and not marker.exists()


def test_a_search_killed_before_ray_saved_anything_starts_again(tmp_path: Path, local_ray,
                                                                 capsys) -> None:
    """Only search.json (and perhaps trial folders that never reported): neither resumable
    nor re-runnable before; --resume now starts it again from its settings."""
    out = tmp_path / "search"
    assert main(["search", *TINY, "--num-trials", "1", "--out", str(out)]) == 0
    for gone in ("tune", "trials"):
        shutil.rmtree(out / gone)
    for gone in ("tune_state.sig", "results.csv", "pareto.json", "optuna_study.journal"):
        (out / gone).unlink()
    assert main(["search", "--resume", str(out)]) == 0
    assert "starting the search again from its settings" in capsys.readouterr().out
    assert len(_check_consistent(out)["rows"]) == 1
