"""``nats analyze`` end to end: a tiny trained run, its checkpoint, a model folder and a
search folder built as a search writes it; bad paths are one-line errors."""

from __future__ import annotations

import base64
import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.cli import main
from nats.folder_lock import exclusive
from nats.trainers import TrainConfig, train

MODEL = NatsConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, softmax_heads_per_head=2,
                   head_dim_k=16, head_dim_v=16, chunk_size=16, layer_types=("nats", "nats"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training steps of MQAR (its relevant positions are marked)."""
    out = tmp_path_factory.mktemp("analyze") / "run"
    config = TrainConfig(model=MODEL, task="mqar", steps=2, batch_size=2, seq_len=48,
                         mqar_pairs=4, lr=3e-3, warmup_steps=1, eval_interval=2, eval_batches=2,
                         log_interval=1, checkpoint_interval=2, device="cpu", out_dir=str(out))
    train(config)
    return out


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(d) for d in re.findall(r'src="data:image/png;base64,([^"]+)"',
                                                    page)]


def _check_page(page: str) -> None:
    images = _images(page)
    assert images and all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in images)
    assert not re.search(r'(src|href)="(?!data:)', page), "the report must load nothing"
    assert "http://" not in page and "https://" not in page


def test_run_report(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    assert main(["analyze", str(run), "--out", str(out)]) == 0
    assert f"{out / 'report.html'}" in capsys.readouterr().out
    page = (out / "report.html").read_text()
    _check_page(page)
    for title in ("Model", "Routing map", "Token view", "Routing statistics",
                  "Cost against context length"):
        assert f"<h2>{title}</h2>" in page
    assert "softmax rate, relevant chunks" in page  # MQAR marks its pairs
    assert page.count('<span class="chunk ') == 2 * 2 * 3  # layers x heads x 48/16 chunks
    assert '<span class="rel">' in page
    data = json.loads((out / "report.json").read_text())
    stats = data["route_stats"]
    assert [s["layer"] for s in stats] == [0, 1]
    assert all(s["chunks"] == 2 * 2 * 3 and s["relevant_chunks"] > 0 for s in stats)
    assert data["cost"][0]["context"] == 1024
    for name in ("routing_map.png", "cost.png", "route_probs_layer0.png", "tokens.html"):
        assert (out / name).is_file()


def test_checkpoint_and_model_folder(run: Path, tmp_path: Path) -> None:
    checkpoint = sorted((run / "checkpoints").glob("step_*.safetensors"))[-1]
    assert main(["analyze", str(checkpoint), "--out", str(tmp_path / "ckpt")]) == 0
    _check_page((tmp_path / "ckpt" / "report.html").read_text())
    # A byte-level model folder has no evaluation data: it is shown on stdlib prose.
    torch.manual_seed(0)
    NatsForCausalLM(MODEL.replace(vocab_size=256)).save_pretrained(tmp_path / "bytes")
    assert main(["analyze", str(tmp_path / "bytes"), "--out", str(tmp_path / "b")]) == 0
    page = (tmp_path / "b" / "report.html").read_text()
    _check_page(page)
    assert "The same input, its text" in page and "with" in page


def test_text_input_and_errors(run: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("héllo <world>")
    # The MQAR run's vocabulary (64) cannot hold the text's bytes.
    assert main(["analyze", str(run), "--out", str(tmp_path / "x"), "--text", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nats: error: --text") and err.count("\n") == 1
    NatsForCausalLM(MODEL.replace(vocab_size=256)).save_pretrained(tmp_path / "bytes")
    assert main(["analyze", str(tmp_path / "bytes"), "--out", str(tmp_path / "y"),
                 "--text", str(text)]) == 0
    assert "&lt;world&gt;" in (tmp_path / "y" / "report.html").read_text()
    capsys.readouterr()
    for bad in (tmp_path / "missing", tmp_path):
        assert main(["analyze", str(bad), "--out", str(tmp_path / "z")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nats: error:") and err.count("\n") == 1
    assert main(["analyze", str(run), "--out", str(tmp_path / "z"), "--batches", "0"]) == 2


def _search_dir(run: Path, out: Path) -> list[str]:
    """The files a finished search leaves: settings, trial runs and records, the study."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from nats.search_spaces.search import STUDY_FILE, _optuna_storage, make_settings
    from nats.search_spaces.spaces import load_space

    base = TrainConfig.from_dict(json.loads((run / "train_config.json").read_text()))
    settings = make_settings(load_space("chunk-and-mix"), base)
    out.mkdir()
    settings.save(out)
    keys, modes = settings.keys_and_modes  # eval/ce (min), cost/flops_per_token (min)
    study = optuna.create_study(study_name=settings.study_name,
                                storage=_optuna_storage(str(out / STUDY_FILE)),
                                directions=["minimize" if m == "min" else "maximize"
                                            for m in modes])
    dists = {"chunk_size": CategoricalDistribution([16, 32, 64]),
             "reg_lambda": FloatDistribution(0.001, 0.3, log=True)}
    # (ce, flops): t0 and t2 are on the front, t2 has the best quality; t1 is dominated.
    trials = {"t0": (2.0, 1e5, 16, 0.2), "t1": (2.5, 2e5, 32, 0.05), "t2": (1.5, 3e5, 64, 0.01),
              "t3": (2.2, 4e5, 32, 0.1)}
    for trial_id, (ce, flops, chunk, lam) in trials.items():
        shutil.copytree(run, out / "trials" / trial_id)
        params = {"chunk_size": chunk, "reg_lambda": lam}
        record = {"trial_id": trial_id, "params": params, "status": "done", "step": 2,
                  "steps": 2, "model": MODEL.to_dict(),
                  "metrics": {keys[0]: ce, keys[1]: flops, "eval/attn_frac": 0.5}}
        (out / "trials" / trial_id / "search_trial.json").write_text(json.dumps(record))
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                  values=[ce, flops]))
    return list(trials)


def test_search_report(run: Path, tmp_path: Path) -> None:
    search = tmp_path / "search"
    _search_dir(run, search)
    out = tmp_path / "report"
    assert main(["analyze", str(search), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    _check_page(page)
    for title in ("Search", "Pareto front", "Parameter importance", "Routing map",
                  "Routing statistics"):
        assert f"<h2>{title}</h2>" in page
    assert "<h1>Chosen trial t2</h1>" in page
    front = re.findall(r"<tr><td>(\d+)( \*)?</td><td>(t\d)</td>", page)
    assert [(n, star, t) for n, star, t in front] == [("1", "", "t0"), ("2", " *", "t2")]
    data = json.loads((out / "report.json").read_text())
    importances = data["importances"]
    assert set(importances) == {"eval/ce", "cost/flops_per_token"}
    for values in importances.values():
        assert set(values) == {"chunk_size", "reg_lambda"}
        assert sum(values.values()) == pytest.approx(1.0)
    assert (out / "pareto.png").is_file() and (out / "importance.png").is_file()
    assert (out / "chosen_routing_map.png").is_file()
    # Without a kept study the report says why instead of failing.
    (search / "optuna_study.journal").unlink()
    assert main(["analyze", str(search), "--out", str(tmp_path / "r2")]) == 0
    assert "Not available:" in (tmp_path / "r2" / "report.html").read_text()


def test_a_search_report_with_an_unreadable_study_says_so(run: Path, tmp_path: Path,
                                                          monkeypatch) -> None:
    """A database storage that cannot be read (no driver, an empty study: SQLAlchemy's,
    the drivers' and Optuna's own errors) leaves the importances out, not the report."""
    from nats.search_spaces import search as search_module

    search = tmp_path / "search"
    _search_dir(run, search)

    def unreadable(out):
        raise KeyError("Record does not exist.")

    monkeypatch.setattr(search_module, "load_study", unreadable)
    assert main(["analyze", str(search), "--out", str(tmp_path / "r")]) == 0
    page = (tmp_path / "r" / "report.html").read_text()
    assert "the study could not be read (KeyError" in page and "<h1>Chosen trial t2</h1>" in page


def test_failed_trials_survive_show_and_analyze(run: Path, tmp_path: Path, capsys) -> None:
    """A failure is known only to Tune's result grid while the search runs; recorded at its
    end, it stays in `nats search show` (which rewrites results.csv) and the report, unless
    the trial finished since (retried by --resume)."""
    from nats.search_spaces.results import load_errors, save_errors

    search = tmp_path / "search"
    _search_dir(run, search)
    record = search / "trials" / "t3" / "search_trial.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "status": "running"}))
    save_errors(search, {"t3": "CUDA error: an illegal memory access", "t9": "died at start"})
    save_errors(search, {"t1": "retried later"})
    assert load_errors(search) == {"t1": "retried later", "t3": "CUDA error: an illegal "
                                   "memory access", "t9": "died at start"}
    (search / "results.csv").write_text("")  # a finished search: show rewrites its results
    assert main(["search", "show", str(search)]) == 0
    err = capsys.readouterr().err
    assert "trial t3 failed: CUDA error: an illegal memory access" in err
    assert "trial t9 failed: died at start" in err and "t1" not in err
    with open(search / "results.csv", newline="") as f:
        status = {row["trial_id"]: row["status"] for row in csv.DictReader(f)}
    assert status == {"t0": "done", "t1": "done", "t2": "done", "t3": "error", "t9": "error"}
    assert main(["analyze", str(search), "--out", str(tmp_path / "r")]) == 0
    assert "illegal memory access" in (tmp_path / "r" / "report.html").read_text()


def test_show_does_not_rewrite_a_running_search(run: Path, tmp_path: Path, capsys) -> None:
    """`nats search show DIR --pick N` writes results and exports: refused in one line while
    a search holds the folder, and a folder that is no search is not made one."""
    from nats.folder_lock import exclusive

    search = tmp_path / "search"
    _search_dir(run, search)
    with exclusive(search, "search folder"):
        assert main(["search", "show", str(search), "--pick", "1"]) == 2
    assert "is in use by process" in capsys.readouterr().err
    assert not (search / "results.csv").exists() and not (search / "export").exists()
    assert main(["search", "show", str(tmp_path / "nothing"), "--pick", "1"]) == 2
    assert not (tmp_path / "nothing").exists()


def test_a_model_folder_of_a_large_vocabulary_needs_its_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes fed as ids to a 32k-token model would be shown as text they are not; a byte
    model's default input is named as the prose it is, not as "the given text"."""
    NatsForCausalLM(MODEL.replace(vocab_size=32000)).save_pretrained(tmp_path / "bpe")
    text = tmp_path / "t.txt"
    text.write_text("hello")
    for extra in ([], ["--text", str(text)]):
        assert main(["analyze", str(tmp_path / "bpe"), "--out", str(tmp_path / "x"),
                     *extra]) == 2
        err = capsys.readouterr().err
        assert "32000-token vocabulary, not of UTF-8 bytes" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # a failed analysis leaves no new folder
    NatsForCausalLM(MODEL.replace(vocab_size=266)).save_pretrained(tmp_path / "bytes")
    assert main(["analyze", str(tmp_path / "bytes"), "--out", str(tmp_path / "b")]) == 0
    page = (tmp_path / "b" / "report.html").read_text()
    assert "English prose from Python&#x27;s documentation" in page
    assert "the given text" not in page


def test_an_earlier_report_is_replaced_and_other_folders_are_refused(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A report over an earlier one leaves none of the earlier files it does not write (a
    NAtS-L model's token view and map, then a transformer's report); a folder holding other
    files (an export, a search) is not written into."""
    out = tmp_path / "report"
    assert main(["analyze", str(run), "--out", str(out)]) == 0
    assert (out / "tokens.html").is_file() and (out / "routing_map.png").is_file()
    capsys.readouterr()
    torch.manual_seed(0)
    NatsForCausalLM(MODEL.replace(vocab_size=256, layer_types=("softmax", "softmax"))
                    ).save_pretrained(tmp_path / "transformer")
    assert main(["analyze", str(tmp_path / "transformer"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["cost.png", "report.html", "report.json"]
    assert "beside it: cost.png, report.json" in printed and "tokens.html" not in printed
    assert "no NAtS-L layer" in (out / "report.html").read_text()
    for other in (tmp_path / "transformer", run):
        before = sorted(p.name for p in other.iterdir())
        assert main(["analyze", str(run), "--out", str(other)]) == 2
        err = capsys.readouterr().err
        assert "holds files that are not a report's" in err and err.count("\n") == 1
        assert sorted(p.name for p in other.iterdir()) == before


def test_a_search_report_survives_an_unloadable_chosen_trial(run: Path, tmp_path: Path
                                                             ) -> None:
    search = tmp_path / "search"
    _search_dir(run, search)
    for name in ("model", "checkpoints"):
        shutil.rmtree(search / "trials" / "t2" / name)
    assert main(["analyze", str(search), "--out", str(tmp_path / "r")]) == 0
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<h2>Pareto front</h2>" in page and "<h1>Chosen trial t2</h1>" in page
    assert "The chosen trial&#x27;s model could not be loaded" in page
    assert "holds no trained model" in json.loads(
        (tmp_path / "r" / "report.json").read_text())["chosen_error"]


@pytest.mark.parametrize("damage", ["no trial_id", "a list", "settings a list"])
def test_damaged_search_files_are_one_line_errors_or_skipped(
        run: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    search = tmp_path / "search"
    _search_dir(run, search)
    record = search / "trials" / "t1" / "search_trial.json"
    if damage == "no trial_id":
        data = json.loads(record.read_text())
        del data["trial_id"]
        record.write_text(json.dumps(data))
    elif damage == "a list":
        record.write_text("[1]")
    else:
        (search / "search.json").write_text("[1]")
    code = main(["analyze", str(search), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    if damage == "settings a list":
        assert code == 2 and "must hold a JSON object, not list" in err
        assert err.count("\n") == 1
    else:
        assert code == 0 and f"skipping {record}: not a trial record" in err
        page = (tmp_path / "r" / "report.html").read_text()
        assert "<h1>Chosen trial t2</h1>" in page and "<td>t1</td>" not in page


def test_the_shown_input_is_routed_in_evaluation_mode(run: Path) -> None:
    """Through the Python API a model may come in training mode: the routing map of a
    given text is the same on every call (argmax routes, not the exploration's noisy
    ones) and the model's pending routing statistics are left as they were."""
    from nats.analysis.report import Report, load_model_input, model_sections

    inp = load_model_input(run, text="0123456789:;<=>?" * 6)  # ids below the vocabulary's 64
    inp.model.train()
    for layer in inp.model.nats_layers:
        layer.route_noise = 5.0  # a model mid-exploration

    def routes_shown(tmp: Path) -> bytes:
        report = Report(tmp)
        model_sections(report, inp, progress=False)
        return (tmp / "routing_map.png").read_bytes()

    pending = [m.pending.clone() for m in inp.model.modules()
               if getattr(m, "pending", None) is not None]
    maps = []
    for i in range(3):
        (folder := run.parent / f"tm{i}").mkdir(exist_ok=True)
        maps.append(routes_shown(folder))
    assert maps[0] == maps[1] == maps[2] and inp.model.training
    assert all(torch.equal(m.pending, p) for m, p in zip(
        [m for m in inp.model.modules() if getattr(m, "pending", None) is not None], pending,
        strict=True))


def test_report_json_is_standard_json() -> None:
    """A non-finite number (a diverged trial's metric) is written as null, arrays as lists:
    browsers' JSON.parse refuses NaN."""
    from nats.analysis.report import _plain

    data = {"front": [{"eval/ce": float("nan"), "cost": float("inf"), "n": 3, "ok": True}],
            "hist": torch.tensor([1.5, 2.0]), 7: None, "path": Path("a/b")}
    text = json.dumps(_plain(data), allow_nan=False)
    assert json.loads(text) == {"front": [{"eval/ce": None, "cost": None, "n": 3, "ok": True}],
                                "hist": [1.5, 2.0], "7": None, "path": "a/b"}


def test_an_analysis_cut_short_keeps_the_earlier_page(run: Path, tmp_path: Path,
                                                      monkeypatch) -> None:
    """Interrupted while the new files move in, the earlier ``report.html`` is still there
    whole (it moves last) and no staging folder is left."""
    from nats.analysis import report as report_module

    out = tmp_path / "report"
    assert main(["analyze", str(run), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    moves = []
    real_replace = os.replace

    def cut_short(src, dst):
        moves.append(Path(dst).name)
        if len(moves) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(report_module.os, "replace", cut_short)
    with pytest.raises(KeyboardInterrupt):
        report_module.analyze(run, out, progress=False)
    assert (out / "report.html").read_text() == page
    assert "report.html" not in moves[:1] and not list(out.glob(".nats-analyze-*"))


def test_out_folder_checks(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                           ) -> None:
    """Bad options of a search report are errors before any work; a failed analysis leaves
    none of the folders it made; a folder another analysis is writing, a folder named like
    a report file and a link to nothing are one-line errors; what a killed analysis left is
    cleared."""
    search = tmp_path / "search"
    _search_dir(run, search)
    for bad in (["--batches", "0"], ["--device", "bogus"]):
        assert main(["analyze", str(search), "--out", str(tmp_path / "a" / "b"), *bad]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    NatsForCausalLM(MODEL.replace(vocab_size=32000)).save_pretrained(tmp_path / "bpe")
    assert main(["analyze", str(tmp_path / "bpe"), "--out", str(tmp_path / "a" / "b")]) == 2
    assert not (tmp_path / "a").exists()
    out = tmp_path / "busy"
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    with exclusive(out, "report folder"):  # another analysis is writing into it
        assert main(["analyze", str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"report folder {out} is in use by process {os.getpid()}" in err
        assert err.count("\n") == 1
    assert main(["analyze", str(run), "--out", str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err
    assert "is a link to" in err and err.count("\n") == 1
    (out / "report.html").mkdir()
    # What a killed analysis leaves: its lock file (above), staging folder, a write's temp.
    (out / ".nats-analyze-999999999-0a1b").mkdir()
    (out / ".cost.png.x1y2.tmp").write_bytes(b"half a picture")
    assert main(["analyze", str(run), "--out", str(out)]) == 2
    assert "not a report's (report.html)" in capsys.readouterr().err
    (out / "report.html").rmdir()
    assert main(["analyze", str(run), "--out", str(out)]) == 0
    assert not list(out.glob(".*"))
