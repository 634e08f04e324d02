"""``nats analyze`` end to end: a tiny trained run, its checkpoint, a model folder and a
search folder built as a search writes it; bad paths are one-line errors."""

from __future__ import annotations

import base64
import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.cli import main
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
