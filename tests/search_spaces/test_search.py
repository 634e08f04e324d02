"""Tiny searches on the CPU with a local Ray: results, front and export agree; an
interrupted search resumes, also from a copied or moved folder; the local Ray listens on
the loopback interface only; the command's errors are one line."""

from __future__ import annotations

import csv
import dataclasses
import ipaddress
import json
import os
import pickle
import shutil
import signal
import subprocess
import threading
import time
import types
from pathlib import Path

import pytest

from nats.cli import main
from nats.search_spaces import search
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
    """A Ray started as `nats search` starts one (on the loopback interface), small and
    quiet."""
    search._start_local_ray(num_cpus=2, log_to_driver=False)
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


@pytest.mark.parametrize("sampler", search.SAMPLERS)
def test_the_sampler_survives_the_pickling_tune_gives_it(sampler: str) -> None:
    """Ray Tune pickles its search algorithm, the sampler in it, when a search starts
    (Optuna 5.1's NSGA-II sampler holds a thread lock); the copy still samples."""
    import optuna

    settings = types.SimpleNamespace(sampler=sampler, num_trials=8, seed=0)  # what it reads
    copy = pickle.loads(pickle.dumps(search._sampler(settings)))
    study = optuna.create_study(sampler=copy, directions=["minimize", "minimize"])
    study.optimize(lambda t: (t.suggest_float("x", 0, 1), t.suggest_float("y", 0, 1)),
                   n_trials=6, n_jobs=2)
    assert len(study.trials) == 6


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
    # A configuration proposed again reports its twin's result ("duplicate").
    assert len(got["rows"]) == 3
    assert all(r["status"] in ("done", "duplicate") for r in got["rows"])
    # The uniform stacks were trained first, as the baselines a mix must beat.
    trained = [json.loads((out / "trials" / r["trial_id"] / "train_config.json").read_text())
               for r in got["rows"] if r["status"] == "done"]
    assert {tuple(t["model"]["layer_types"]) for t in trained} == \
        {("softmax", "softmax"), ("linear", "linear"), ("nats", "nats")}
    assert "Pareto front" in printed and "exported trial" in printed
    # The chosen architecture's cost against the pure forms, and how to retrain it on its
    # own task.
    assert "attention cost at 8,192 tokens" in printed and "all-softmax" in printed
    # The one TensorBoard hint names the trials' folder (Tune's pointed into its staging).
    assert [line for line in printed.splitlines() if "tensorboard --logdir" in line] == [
        f"      TensorBoard of every trial: tensorboard --logdir {out / 'trials'}"]
    assert f"nats train --config {out / 'export' / 'training.json'}" in printed
    # The default pick is the front's knee: the cheapest trial whose quality is within a
    # tenth of the front's quality range of the best.
    front = got["front"]["trials"]
    ces = [t["eval/ce"] for t in front]
    near = [t for t in front if t["eval/ce"] <= min(ces) + 0.1 * (max(ces) - min(ces))]
    knee = min(near, key=lambda t: t["cost/flops_per_token"])
    assert f"exported trial {knee['trial_id']}" in printed
    # The Optuna study saw every trial complete, with both objectives.
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    loaded = optuna.load_study(study_name="nats-search",
                               storage=JournalStorage(JournalFileBackend(str(study))))
    assert [t.state.name for t in loaded.trials] == ["COMPLETE"] * 3
    assert all(len(t.values) == 2 for t in loaded.trials)
    # Every trial logged to TensorBoard under the one logdir.
    for row in got["rows"]:
        if row["status"] == "done":
            assert list((out / "trials" / row["trial_id"]).glob("events.out.tfevents.*"))
    # show reprints, and --pick exports another front entry.
    assert main(["search", "show", str(out)]) == 0
    assert "Pareto front" in capsys.readouterr().out
    last = len(got["front"]["trials"])
    assert main(["search", "show", str(out), "--pick", str(last)]) == 0
    picked = got["front"]["trials"][last - 1]["trial_id"]
    assert f"exported trial {picked}" in capsys.readouterr().out
    # A --pick that names no entry fails `show`, but a search that has just run exports
    # its knee with a warning instead of ending with status 2 and no export.
    assert main(["search", "show", str(out), "--pick", "99"]) == 2
    assert f"--pick 99: the front has entries 1..{last}" in capsys.readouterr().err
    from nats.search_spaces.cli import _report
    _report(out, {}, "99", pick_or_knee=True)
    captured = capsys.readouterr()
    assert f"exported trial {knee['trial_id']}" in captured.out
    assert f"nats: warning: --pick 99: the front has entries 1..{last}; exporting the knee" \
        in captured.err
    # A second search into the same folder is refused.
    assert main(["search", *TINY, "--out", str(out)]) == 2
    assert "already holds a search" in capsys.readouterr().err


@pytest.mark.slow
def test_a_piped_search_prints_a_plain_log(tmp_path: Path) -> None:
    """As a user's redirected run prints it (its own Ray, worker logs forwarded)."""
    done = subprocess.run(["nats", "search", *TINY, "--num-trials", "2", "--out",
                           str(tmp_path / "s")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    log = done.stdout + done.stderr
    assert "nats: training" in log  # the trials' own lines reach the console ...
    assert "\x1b[" not in log  # ... without colour codes
    assert "Checkpoint successfully created" not in log
    assert "Failed to fetch metrics" not in log
    # Tune's live table leads with the objectives and accuracy (and the softmax fraction,
    # when the first trial to report has NAtS-L layers: Tune picks the columns once).
    header = [line for line in log.splitlines() if "Trial name" in line][-1]
    assert all(k in header for k in ("eval/ce", "cost/flops_per_token", "eval/acc")), header


def test_the_default_folder_moves_on_when_taken(tmp_path: Path, monkeypatch) -> None:
    from nats.search_spaces.cli import default_out

    monkeypatch.chdir(tmp_path)
    assert default_out() == Path("runs/search")
    for taken in ("runs/search", "runs/search-2"):
        (tmp_path / taken).mkdir(parents=True)
        (tmp_path / taken / "search.json").write_text("{}")
    (tmp_path / "runs/search-3").mkdir()  # empty: a new search may start there
    assert default_out() == Path("runs/search-3")
    (tmp_path / "runs/search-3" / "notes.txt").write_text("not a search, not empty")
    assert default_out() == Path("runs/search-4")


@pytest.mark.parametrize("checkpointed", [True, False], ids=["after-checkpoint", "before"])
def test_a_trial_whose_worker_dies_is_retried(tmp_path: Path, local_ray, capsys,
                                              checkpointed: bool) -> None:
    """Killed after its first checkpoint, a trial resumes from it; killed before (its
    folder holds only the start of a run), it starts over."""
    out = tmp_path / "search"
    killed: list[int] = []

    def kill_worker() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for path in (out / "trials").glob("*/search_trial.json"):
                record = json.loads(path.read_text())
                saved = path.parent / "checkpoints" / "step_00000150.safetensors"
                started = (path.parent / "train_config.json").exists()
                unsaved = not list((path.parent / "checkpoints").glob("*.safetensors"))
                ready = saved.exists() if checkpointed else started and unsaved
                if ready and record["status"] == "running":
                    os.kill(record["pid"], signal.SIGKILL)
                    killed.append(record["pid"])
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_worker, daemon=True)
    watcher.start()
    status = main(["search", "--steps", "300", "--num-trials", "1", "--out", str(out)])
    watcher.join()
    assert killed and status == 0
    (record_file,) = (out / "trials").glob("*/search_trial.json")
    record = json.loads(record_file.read_text())
    assert record["status"] == "done" and record["step"] == 300
    assert record["pid"] != killed[0]
    assert record["resumed_from"] >= 150 if checkpointed else record["resumed_from"] == 0
    assert _rows(out)[0]["status"] == "done"


def _interrupt_at_the_second_trial(out: Path, options: list[str],
                                   capsys: pytest.CaptureFixture[str],
                                   stop_signal: int = signal.SIGUSR1) -> dict[str, int]:
    """Run a search of 3 trials of 40 steps, one at a time, into ``out`` and stop it with
    ``stop_signal`` once the second has started; the finished first trial's id and its
    model's mtime."""
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
                os.kill(os.getpid(), stop_signal)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=interrupt_after_first_trial, daemon=True)
    # A continuous dimension: no trial repeats another's configuration (which would report
    # at once, without training, and could end the search before the interrupt).
    space = out.parent / f"{out.name}-space.yaml"
    space.write_text("params:\n  layers: {choices: [nats, linear]}\n"
                     "  lr: {low: 0.001, high: 0.01, log: true}\n")
    watcher.start()
    try:
        status = main(["search", "--steps", "40", "--num-trials", "3", "--max-concurrent", "1",
                       "--space", str(space), *options, "--out", str(out)])
    finally:
        stop.set()
        watcher.join()
    assert status == 130
    assert "nats search --resume" in capsys.readouterr().err
    assert not (out / "export").exists()
    assert len(finished) == 1
    return finished


def test_interrupted_search_resumes(tmp_path: Path, local_ray, capsys) -> None:
    out = tmp_path / "search"
    finished = _interrupt_at_the_second_trial(out, ["--metric", "acc", "--cost", "kv"], capsys)

    assert main(["search", "--resume", str(out)]) == 0
    got = _check_consistent(out, metric="acc", cost="kv")
    assert len(got["rows"]) == 3 and all(r["status"] == "done" for r in got["rows"])
    # Finished trials were kept, not trained again.
    for trial_id, mtime in finished.items():
        assert (out / "trials" / trial_id / "model").stat().st_mtime_ns == mtime


def test_a_search_stopped_by_sigterm_resumes_its_running_trial(tmp_path: Path, local_ray,
                                                               capsys) -> None:
    """``kill`` (SIGTERM) stopped the driver at once: Tune's saved state predated the
    running trial, and ``--resume`` dropped it (status "stopped", never trained) while
    calling the search complete. It now stops as Ctrl-C does."""
    out = tmp_path / "search"
    sigterm = signal.getsignal(signal.SIGTERM)
    finished = _interrupt_at_the_second_trial(out, [], capsys, signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is sigterm

    assert main(["search", "--resume", str(out)]) == 0
    rows = _check_consistent(out)["rows"]
    assert len(rows) == 3 and all(r["status"] == "done" for r in rows)
    for trial_id, mtime in finished.items():
        assert (out / "trials" / trial_id / "model").stat().st_mtime_ns == mtime


def test_resume_refuses_options_that_would_set_up_another_search(tmp_path: Path,
                                                                  capsys) -> None:
    """``--resume DIR --num-trials 6 --out elsewhere`` ran the search as it was and exited
    0: the new options were dropped without a word."""
    assert main(["search", "--resume", str(tmp_path), "--num-trials", "6", "--out",
                 str(tmp_path / "elsewhere"), "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert err == ("nats: error: --resume continues a search as it was set up and does not "
                   "take --out, --num-trials, --no-baselines; start a new search (--out) to "
                   "change them\n")
    assert not (tmp_path / "elsewhere").exists()


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_a_copied_or_moved_search_resumes_in_the_copy_alone(tmp_path: Path, local_ray,
                                                             capsys) -> None:
    """Tune's pickled state named the folder by its absolute path (the Optuna journal, the
    storage of the trials made after a restore): resuming a copy wrote the original's
    journal and Tune trial folders, and failed with ENOENT once the original was gone."""
    out = tmp_path / "search"
    # No retries: a trial that fails once (its Tune storage in the vanished original) fails.
    _interrupt_at_the_second_trial(out, ["--max-failures", "0"], capsys)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    moved = out.rename(tmp_path / "moved")  # the copy's origin is gone; the moved folder ...
    untouched = _files(moved)
    journal = (copy / "optuna_study.journal").read_bytes()
    started = {p.name for p in (copy / "trials").iterdir()}
    assert len(started) == 2

    assert main(["search", "--resume", str(copy)]) == 0  # the copy's signature verifies
    assert not out.exists() and _files(moved) == untouched  # ... is never written
    rows = _check_consistent(copy)["rows"]
    assert len(rows) == 3 and all(r["status"] == "done" for r in rows)
    assert started < {r["trial_id"] for r in rows}
    grown = (copy / "optuna_study.journal").read_bytes()
    assert grown.startswith(journal) and len(grown) > len(journal)
    study = search.load_study(copy)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    # Tune's trial folders: run_trial_<trial id>_<number>_<parameters>_<time>
    tune_trials = {p.name.split("_")[2] for p in (copy / "tune").glob("run_trial_*")}
    assert tune_trials == {r["trial_id"] for r in rows}


def test_a_configuration_proposed_again_is_not_trained_again(tmp_path: Path, local_ray,
                                                             capsys) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  layers: {choices: [linear, softmax]}\n  lr: [0.003]\n")
    out = tmp_path / "search"
    assert main(["search", *TINY, "--space", str(space), "--num-trials", "6",
                 "--max-concurrent", "1", "--seed", "0", "--out", str(out)]) == 0
    rows = _rows(out)
    done = {r["layer_types"]: r for r in rows if r["status"] == "done"}
    duplicates = [r for r in rows if r["status"] == "duplicate"]
    # Four configurations exist: six trials must repeat at least two, trained once each.
    assert len(done) + len(duplicates) == 6 and len(duplicates) >= 2
    by_id = {r["trial_id"]: r for r in rows}
    for dup in duplicates:
        twin = by_id[dup["duplicate_of"]]
        assert twin["status"] == "done" and dup["eval/ce"] == twin["eval/ce"]
        assert not (out / "trials" / dup["trial_id"] / "model").exists()
    front = json.loads((out / "pareto.json").read_text())["trials"]
    assert all(t["status"] == "done" for t in front)


def test_searched_model_fields_reach_the_trials_and_the_table(tmp_path: Path, local_ray,
                                                              capsys) -> None:
    """A space over the branch norm and the softmax gain (``null`` a choice): every trial's
    model has the values its row names, and the printed table shows them."""
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  layers: {choices: [nats]}\n  branch_norm: [linear, scaled]\n"
                     "  softmax_gain_init: [null, 0.05]\n")
    out = tmp_path / "search"
    assert main(["search", *TINY, "--space", str(space), "--num-trials", "4",
                 "--max-concurrent", "1", "--seed", "1", "--out", str(out)]) == 0
    rows = [r for r in _rows(out) if r["status"] == "done"]
    assert rows
    for row in rows:
        model = json.loads((out / "trials" / row["trial_id"] / "train_config.json").read_text()
                           )["model"]
        assert row["branch_norm"] == model["branch_norm"]
        gain = model["softmax_gain_init"]
        assert row["softmax_gain_init"] == ("" if gain is None else str(gain))
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.lstrip().startswith("trial_id"))
    assert "branch_norm" in header and "softmax_gain_init" in header


def test_settings_of_earlier_versions_load() -> None:
    from nats.search_spaces import load_space, search_base

    settings = search.make_settings(load_space("hybrid"), search_base("mqar-search"))
    data = settings.to_dict()
    assert search.SearchSettings.from_dict({**data, "extra": {}}) == settings
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['extra'\]"):
        search.SearchSettings.from_dict({**data, "extra": {"a": 1}})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("cpus_per_trial", "x", "--cpus-per-trial 'x': must be > 0"),
    ("gpus_per_trial", "1", "--gpus-per-trial '1': must be >= 0"),
    ("gpus_per_trial", True, "--gpus-per-trial True: must be >= 0"),
    ("time_budget_s", "1", "--time-budget '1': must be > 0 seconds"),
    ("time_budget_s", float("inf"), "--time-budget inf: must be > 0 seconds"),
])
def test_wrong_typed_settings_are_one_line_errors(key: str, value: object,
                                                  message: str) -> None:
    """A hand-edited search.json with a string where a number goes was a TypeError."""
    from nats.search_spaces import load_space, search_base

    data = search.make_settings(load_space("hybrid"), search_base("mqar-search")).to_dict()
    with pytest.raises(ValueError) as info:
        search.SearchSettings.from_dict({**data, key: value})
    assert str(info.value) == message


def test_a_study_journal_inside_the_folder_follows_a_copy(tmp_path: Path) -> None:
    """`--optuna-storage` inside DIR is saved relative to it, and the journal that Tune
    pickles with the searcher names its place in the folder alone: unpickled for a copy,
    it is the copy's journal."""
    import optuna

    from nats.search_spaces.builtin import DEFAULT_BASE, DEFAULT_SPACE, search_base
    from nats.search_spaces.folder_state import searching
    from nats.search_spaces.spaces import load_space

    made, copy = tmp_path / "made", tmp_path / "copy"
    settings = search.make_settings(load_space(DEFAULT_SPACE), search_base(DEFAULT_BASE),
                                    optuna_storage=str(made / "study.log"))
    saved = search._storage_in_folder(settings, made)
    assert saved.optuna_storage == "study.log"
    assert search.study_storage(saved, copy) == str(copy / "study.log")
    outside = dataclasses.replace(settings, optuna_storage=str(tmp_path / "study.log"))
    assert search._storage_in_folder(outside, made) == outside
    made.mkdir()
    copy.mkdir()
    state = pickle.dumps(search._optuna_storage(search.study_storage(saved, made), made))
    assert str(made).encode() not in state
    with pytest.raises(RuntimeError, match="nats search --resume"):
        pickle.loads(state)
    with searching(copy):
        optuna.create_study(storage=pickle.loads(state), study_name="nats-search")
    assert (copy / "study.log").stat().st_size > 0
    assert (made / "study.log").stat().st_size == 0


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_a_local_ray_listens_on_the_loopback_interface_only(local_ray) -> None:
    """Ray's servers listened on every interface (`*:port`); a local search's Ray is this
    machine's alone."""
    psutil = pytest.importorskip("psutil")

    def worker_pid() -> int:
        return os.getpid()

    worker = ray.get(ray.remote(worker_pid).remote())
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    assert worker in ours
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ours}
    gcs_port = int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
    assert gcs_port in {port for _, port in listening}
    exposed = [(ip, port) for ip, port in listening if not _loopback(ip)]
    assert not exposed, f"Ray listens beyond this machine: {exposed}"


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


def test_asha_refuses_a_space_that_searches_the_steps() -> None:
    """ASHA stops every trial at the base's steps, so a longer trial could never finish
    and reach the front: refused when the settings are made."""
    from nats.search_spaces.builtin import DEFAULT_BASE, DEFAULT_SPACE, search_base
    from nats.search_spaces.spaces import load_space, space_from_dict

    space = load_space(DEFAULT_SPACE)
    steps = space_from_dict({**space.source, "name": "with-steps",
                             "params": {**space.source["params"], "steps": [6, 12]}})
    base = search_base(DEFAULT_BASE).replace(steps=6)
    with pytest.raises(ValueError, match="--asha cannot search 'steps'"):
        search.make_settings(steps, base, asha=True)
    assert search.make_settings(steps, base).asha is False
    assert search.make_settings(space, base, asha=True).asha is True


def test_a_new_search_refuses_a_folder_that_holds_anything(tmp_path: Path, capsys) -> None:
    """The Tune state signed when the search ends covers every file of the folder, so a
    new search starts only in a new or empty one, before Ray starts."""
    out = tmp_path / "out"
    (out / "tune").mkdir(parents=True)
    (out / "tune" / "searcher-state-9999.pkl").write_bytes(b"planted")
    assert main(["search", *TINY, "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"nats: error: --out {out} is not empty; choose a new " \
                                      "or empty folder\n"
    assert sorted(p.name for p in out.rglob("*")) == ["searcher-state-9999.pkl", "tune"]


def test_a_relative_sqlite_storage_is_made_absolute(tmp_path: Path, monkeypatch) -> None:
    """`--optuna-storage sqlite:///study.db` names a file in the working directory of the
    command that starts the search, not of each later `--resume` or `nats analyze`."""
    from nats.search_spaces import cli

    seen = {}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "run_search", lambda settings, out, **kw: seen.update(
        storage=settings.optuna_storage) or search.FitOutcome({}, False))
    monkeypatch.setattr(cli, "_finish", lambda out, outcome, pick: 0)
    assert main(["search", *TINY, "--out", str(tmp_path / "s"),
                 "--optuna-storage", "sqlite:///study.db"]) == 0
    assert seen["storage"] == f"sqlite:///{tmp_path / 'study.db'}"


def test_an_interrupted_search_with_a_time_budget_is_not_finished(tmp_path: Path, local_ray,
                                                                   capsys) -> None:
    """Tune returns alike when its time budget runs out and on Ctrl-C; a Ctrl-C long before
    the budget leaves the search to `--resume`, not reported and exported as finished."""
    out = tmp_path / "search"
    _interrupt_at_the_second_trial(out, ["--time-budget", "3600"], capsys)
    assert 0 < json.loads((out / search.TIME_FILE).read_text())["seconds"] < 3600


def test_a_spent_time_budget_ends_the_search() -> None:
    from nats.search_spaces.builtin import DEFAULT_BASE, DEFAULT_SPACE, search_base
    from nats.search_spaces.spaces import load_space

    class Grid(list):  # one trial still pending: the budget, not the trials, ended it
        num_terminated, num_errors = 1, 0

    settings = search.make_settings(load_space(DEFAULT_SPACE), search_base(DEFAULT_BASE),
                                    num_trials=4, time_budget_s=60.0)
    finished = type("Result", (), {"error": None, "metrics": {}, "path": "t"})()
    grid = Grid([finished, finished])
    assert search._outcome(grid, settings, 61.0).complete
    assert not search._outcome(grid, settings, 59.0).complete


def test_the_knee_is_the_cheapest_front_trial_near_the_best_quality() -> None:
    """Quality within KNEE of the front's range from the best, then the cheapest; a front
    trial without a finite quality (a front by cost alone) is never the knee unless no
    trial has one."""
    from nats.search_spaces.builtin import DEFAULT_BASE, DEFAULT_SPACE, search_base
    from nats.search_spaces.results import KNEE, SearchResults, pick
    from nats.search_spaces.spaces import load_space

    settings = search.make_settings(load_space(DEFAULT_SPACE), search_base(DEFAULT_BASE))
    (qk, qm), (ck, _) = settings.quality_key, settings.cost_key
    sign = 1 if qm == "min" else -1
    best, worst = 1.0, 2.0
    qualities = [best, best + KNEE * 0.5 * (worst - best), worst, float("nan")]
    rows = [{"trial_id": f"t{i}", "status": "done", qk: sign * q, ck: c}
            for i, (q, c) in enumerate(zip(qualities, [10.0, 2.0, 1.0, 0.5], strict=True))]
    results = SearchResults(settings, rows, [0, 1, 2, 3], [qk, ck], [qm, "min"])
    assert pick(results) == 1
    nan_only = SearchResults(settings, rows, [3], [qk, ck], [qm, "min"])
    assert pick(nan_only) == 3


def test_a_storage_file_that_is_not_a_journal_is_refused_untouched(tmp_path: Path,
                                                                   capsys) -> None:
    """A one-line file of anything else passed the storage check (Optuna's reader skips a
    bad last line), had the study appended to it, and failed the search after Ray started,
    leaving a half-made folder that refused a rerun."""
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    out = tmp_path / "search"
    assert main(["search", *TINY, "--optuna-storage", str(afile), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"nats: error: --optuna-storage {str(afile)!r} is not "
                                       "an Optuna journal file; give a new file, a journal, "
                                       "or a database URL\n")
    assert afile.read_text() == "x\n" and not out.exists()
