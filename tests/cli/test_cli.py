"""The ``nats`` command: one-line errors with status 2, and train / info / generate work."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nats.cli import main
from nats.trainers import latest_checkpoint


def _status(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def _nats(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run the installed console script the way a user does."""
    return subprocess.run(["nats", *args], capture_output=True, text=True, **kwargs)


@pytest.mark.parametrize("argv", [
    [],
    ["fly"],
    ["train", "--preset", "enormous"],
    ["train", "--steps", "many"],
    ["train", "--steps", "0"],
    ["train", "--task", "poetry"],
    ["train", "--device", "tpu"],
    ["train", "--lr", "-1"],
    ["train", "--preset", "bytes-small", "--data", "/no/such/corpus"],
    ["train", "--preset", "bytes-small", "--streaming", "--data", "/no/such/corpus"],
    ["train", "--preset", "bytes-small", "--data", "."],  # an empty folder: no documents
    ["train", "--preset", "bytes-small", "--tokenizer", "/no/such/tokenizer"],
    ["train", "--preset", "bytes-small", "--tokenizer", "."],  # no tokenizer.json
    ["train", "--data-format", "xml"],
    ["train", "--eval-seed", "-1"],
    ["train", "--reg-lambda", "-1"],
    ["train", "--reg-start", "1.5"],
    ["train", "--preset", "mqar-tiny", "--mqar-pairs-mix", "4", "9"],  # 4 * 9 > seq_len 32
    ["train", "--preset", "mqar-tiny", "--mqar-pairs-mix", "0"],
    ["train", "--preset", "mqar-tiny", "--mqar-pairs-mix", "four"],
    ["train", "--preset", "mqar-tiny", "--mqar-pairs-mix"],
    ["train", "--mqar-pairs-mix", "4"],  # preset tiny is a copy task
    ["train", "--preset", "mqar-tiny", "--data", "/no/such/corpus"],  # text options on a
    ["train", "--preset", "mqar-tiny", "--tokenizer", "tok", "--streaming"],  # generated task
    ["train", "--task", "needle", "--seq-len", "8"],
    ["train", "--config", "/no/such/config.json"],
    ["train", "--config", "."],
    ["train", "--precision", "fp8"],
    ["train", "--grad-accum-steps", "3"],  # does not divide the preset's batch of 32
    ["train", "--init-from", "/no/such/model"],
    ["generate", "/no/such/model"],
    ["generate", "."],
    ["info", "/no/such/model"],
    ["export", "/no/such/run", "--out", "exported"],
    ["export", ".", "--out", "exported"],
    ["export", "/no/such/run"],
    ["export", ".", "--out", "exported", "--eval-batches", "some"],
    ["search", "--space", "no-such-space"],
    ["search", "--optuna-storage", "bogus://"],
    ["search", "--space", "."],
    ["search", "--num-trials", "0"],
    ["search", "--steps", "0"],
    ["search", "--metric", "bpb"],  # bits per byte need task 'text'
    ["search", "--metric", "beauty"],
    ["search", "--context", "0"],
    ["search", "--sampler", "grid"],
    ["search", "--resume", "/no/such/search"],
    ["search", "show"],
    ["search", "show", "/no/such/search"],
    ["search", "runs/x"],
])
def test_bad_input_is_one_line_and_status_2(argv: list[str], capsys, tmp_path: Path,
                                            monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a run that wrongly started would write here, not in the repo
    assert _status(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("nats: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    assert not (tmp_path / "runs").exists()


def test_console_script_reports_bad_input_without_traceback(tmp_path: Path) -> None:
    done = _nats("train", "--steps", "-3", "--out", str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr == "nats: error: TrainConfig.steps = -3 is invalid: " \
                          "must be an integer >= 1\n"


def test_train_info_generate(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = _nats("train", "--preset", "tiny", "--steps", "3", "--batch-size", "2",
                 "--seq-len", "32", "--device", "cpu", "--out", str(run))
    assert done.returncode == 0, done.stderr
    assert "nats: done, 3 steps" in done.stdout
    assert (run / "model" / "config.json").is_file()
    assert latest_checkpoint(run).name == "step_00000003.safetensors"

    info = _nats("info", str(run / "model"))
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["layer_types"] == ["nats", "nats"] and described["parameters"] > 0

    gen = _nats("generate", str(run / "model"), "--tokens", "3,9 4", "--max-new-tokens", "5",
                "--sample", "--top-k", "10")
    assert gen.returncode == 0, gen.stderr
    ids = [int(t) for t in gen.stdout.split()]
    assert ids[:3] == [3, 9, 4] and len(ids) == 8
    assert all(0 <= t < described["config"]["vocab_size"] for t in ids)
    for bad in ("3 x", "3 32", ""):
        refused = _nats("generate", str(run / "model"), "--tokens", bad)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    refused = _nats("generate", str(run / "model"), "--prompt", "ab")  # a 32-token model
    assert refused.returncode == 2 and "--tokenizer" in refused.stderr
    refused = _nats("generate", str(run / "model"), "--tokens", "3 9 4",
                    "--max-prompt-tokens", "2")
    assert refused.returncode == 2 and "3 tokens, more than the limit of 2" in refused.stderr

    # The run folder and its checkpoint name the same model as run/model.
    greedy = [_nats("generate", source, "--tokens", "3 9 4", "--max-new-tokens", "6")
              for source in (str(run / "model"), str(run), str(latest_checkpoint(run)))]
    assert all(g.returncode == 0 for g in greedy), [g.stderr for g in greedy]
    assert greedy[0].stdout == greedy[1].stdout == greedy[2].stdout
    assert json.loads(_nats("info", str(run)).stdout)["parameters"] == described["parameters"]

    again = _nats("train", "--preset", "tiny", "--out", str(run))
    assert again.returncode == 2 and "--resume" in again.stderr


def test_bad_config_files_are_one_line(tmp_path: Path) -> None:
    for name, text in (("broken.json", "{not json"), ("list.json", "[1, 2]"),
                       ("typo.json", json.dumps({"d_modle": 64}))):
        (tmp_path / name).write_text(text)
        done = _nats("train", "--config", str(tmp_path / name), "--out", str(tmp_path / "r"))
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "d_modle" in done.stderr


def test_mqar_run_exports_and_its_architecture_retrains(tmp_path: Path) -> None:
    """The README's three commands: train on MQAR, export, train the export again."""
    run, exported = tmp_path / "mqar", tmp_path / "exported"
    done = _nats("train", "--preset", "mqar-tiny", "--steps", "150", "--out", str(run),
                 "--device", "cpu")
    assert done.returncode == 0, done.stderr
    accuracy = float(done.stdout.split("step 150: eval ")[1].split("acc ")[1].split(",")[0])
    assert accuracy > 0.9, done.stdout

    done = _nats("export", str(run), "--out", str(exported))
    assert done.returncode == 0, done.stderr
    assert json.loads((exported / "config.json").read_text())["softmax_layers"] == [0, 1]

    # From scratch with the exported architecture, then from its weights.
    scratch = _nats("train", "--preset", "mqar-tiny", "--config", str(exported / "config.json"),
                    "--steps", "2", "--out", str(tmp_path / "scratch"), "--device", "cpu")
    assert scratch.returncode == 0, scratch.stderr
    warm = _nats("train", "--preset", "mqar-tiny", "--config", str(exported / "config.json"),
                 "--init-from", str(exported), "--steps", "1", "--eval-interval", "1",
                 "--out", str(tmp_path / "warm"), "--device", "cpu")
    assert warm.returncode == 0, warm.stderr
    assert "starting from the weights" in warm.stdout
    warm_acc = float(warm.stdout.split("step 1: eval ")[1].split("acc ")[1].split(",")[0])
    assert warm_acc > 0.9  # it starts where the exported model stopped


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_saves_a_checkpoint_and_resume_continues(tmp_path: Path,
                                                          sig: signal.Signals) -> None:
    """Ctrl-C, or the SIGTERM that kill and job schedulers send; while the run is alive, a
    second writer of its folder is refused in one line naming it."""
    run = tmp_path / "run"
    args = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--device", "cpu",
            "--out", str(run)]
    proc = subprocess.Popen(["nats", "train", "--steps", "100000", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:  # the handler is installed once this line is printed
        if line.startswith("nats: training"):
            break
    second = _nats("train", "--resume", "--out", str(run), "--steps", "100000")
    assert second.returncode == 2
    assert second.stderr == f"nats: error: run folder {run} is in use by process {proc.pid}; " \
                            "wait for it to finish or choose another folder\n"
    proc.send_signal(sig)
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "nats train --resume --out" in err
    step = int(latest_checkpoint(run).stem.removeprefix("step_"))

    done = _nats("train", "--resume", "--out", str(run), "--steps", str(step + 2))
    assert done.returncode == 0, done.stderr
    assert f"resuming from {latest_checkpoint(run).parent}" in done.stdout
    assert f"steps {step} -> {step + 2}" in done.stdout
    assert (run / "model" / "model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on GPU-less machines")
def test_bad_search_space_file_is_one_line(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  chunk_size: [16, 48]\n  layers: {choices: [nats, linear]}\n")
    done = _nats("search", "--space", str(space), "--out", str(tmp_path / "search"))
    assert done.returncode == 2
    assert done.stderr == f"nats: error: space file {space}: params.chunk_size = 48 is " \
                          "invalid: must be chunk sizes from (16, 32, 64, 128, 256)\n"
    assert not (tmp_path / "search").exists()
    listed = _nats("search", "--list-spaces")
    assert listed.returncode == 0 and "hybrid (default)" in listed.stdout


def test_kernel_benchmark_needs_a_gpu(capsys) -> None:
    assert _status(["bench", "kernels", "--seq-lens", "2048"]) == 2
    assert capsys.readouterr().err == ("nats: error: nats bench kernels needs a CUDA GPU: kernel "
                                       "timings under the CPU interpreter mean nothing\n")


def test_module_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "nats.cli", "--help"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and "train" in done.stdout and "generate" in done.stdout


def test_routing_cost_options_reach_the_run_config(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--preset", "mqar-tiny", "--arch", "natsl-all", "--reg-lambda", "0.1",
                 "--reg-start", "0.5", "--steps", "2", "--eval-interval", "2",
                 "--out", str(out)]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["model"]["reg_lambda"], saved["reg_start"]) == (0.1, 0.5)
    assert saved["cuda_graph"] is None  # an optional switch not given: graphed where it can


def test_mqar_pairs_mix_reaches_the_run_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--preset", "mqar-tiny", "--mqar-pairs-mix", "2", "4", "8",
                 "--steps", "2", "--batch-size", "4", "--eval-interval", "2",
                 "--device", "cpu", "--out", str(out)]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["mqar_pairs_mix"], saved["mqar_pairs"]) == ([2, 4, 8], 4)
    assert _status(["train", "--preset", "mqar-tiny", "--mqar-pairs-mix", "4", "9",
                    "--out", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err.endswith(
        "nats: error: TrainConfig.mqar_pairs_mix = (4, 9) is invalid: must be pair counts in "
        "1 .. seq_len // 4 = 8 (seq_len >= 4 * pairs)\n")


def test_every_config_field_is_an_option_with_its_docstring_as_help() -> None:
    """A new field of ``TrainConfig`` or ``NatsConfig`` gets its ``nats train`` option and
    help for free: the field needs only a docstring (which this test demands)."""
    import dataclasses

    from nats import NatsConfig
    from nats.cli import _BY_HAND, _field_docs, build_parser
    from nats.trainers import TrainConfig

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    options = {a.dest: a for a in train._actions}
    for cls in (TrainConfig, NatsConfig):
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in _BY_HAND:
                continue
            assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring"
            flag = "--" + f.name.replace("_", "-")
            switch = f.type in (bool, "bool", "bool | None")  # a switch has its negation too
            assert options[f.name].option_strings == (
                [flag, "--no-" + flag[2:]] if switch else [flag]), f.name
            assert options[f.name].help.split()[0] == docs[f.name].replace("``", "").split()[0]
    assert "copy, mqar, needle, text" in options["task"].help  # TASKS spelled out


def test_model_and_training_fields_reach_the_run_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--preset", "mqar-tiny", "--arch", "natsl-all", "--branch-norm",
                 "linear", "--router-lr-scale", "5", "--no-scorer-detach", "--softmax-target",
                 "none", "--budget-anneal", "0.5", "--steps", "2", "--eval-interval", "2",
                 "--no-cuda-graph", "--device", "cpu", "--out", str(out)]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["router_lr_scale"], saved["budget_anneal"]) == (5.0, 0.5)
    assert saved["cuda_graph"] is False
    model = saved["model"]
    assert (model["branch_norm"], model["scorer_detach"], model["softmax_target"]) == \
        ("linear", False, None)
    assert model["layer_types"] == ["nats", "nats"]  # --arch, then the model's fields
    capsys.readouterr()
    assert _status(["train", "--branch-norm", "rms", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nats: error: NatsConfig.branch_norm = 'rms' is invalid") and \
        err.count("\n") == 1


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 25600000000 bytes"),
    MemoryError()])
def test_out_of_memory_is_one_line(monkeypatch, capsys, error: BaseException) -> None:
    """Sizes a user gave that do not fit end in one line; any other RuntimeError is a
    defect and keeps its traceback."""
    import argparse

    import nats.cli

    def command_raising(raised: BaseException) -> None:
        def run(args: argparse.Namespace) -> int:
            raise raised

        parsed = argparse.Namespace(func=run)
        monkeypatch.setattr(nats.cli, "build_parser", lambda: argparse.Namespace(
            parse_args=lambda argv: parsed))

    command_raising(error)
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nats: error: out of memory") and err.count("\n") == 1
    command_raising(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["train"])


def test_a_reader_that_stops_early_is_not_an_error(tmp_path) -> None:
    """``nats info MODEL | head -1``: the reader is gone when the command writes; it ends
    quietly with the shell's status for it (141), not with 'Broken pipe' on stderr. (The
    reader here, ``true``, exits at once: a reader that reads a byte first would race with
    the command's one write.)"""
    import subprocess
    import sys

    import torch

    from nats import NatsConfig, NatsForCausalLM

    torch.manual_seed(0)
    NatsForCausalLM(NatsConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2,
                               head_dim_k=16, head_dim_v=16, chunk_size=16,
                               layer_types=("nats",))).save_pretrained(tmp_path / "m")
    run = subprocess.run(
        ["bash", "-c", f'{sys.executable} -m nats.cli info {tmp_path / "m"} | true; '
                       'echo "${PIPESTATUS[0]}"'], capture_output=True, text=True)
    assert run.stdout == "141\n" and run.stderr == ""


@pytest.mark.parametrize(("args", "message"), [
    (["kernels", "--fractions", "2"], r"fractions = \[2.0\] must be numbers in \[0, 1\]"),
    (["kernels", "--tokens", "100", "--seq-lens", "2048"], r"seq_lens = \[2048\] must be "
                                                           r"integers in \[1, tokens = 100\]"),
    (["kernels", "--chunk-size", "48"], r"chunk_size = 48 must be one of"),
    (["decode", "--fractions", "1.5"], r"--fractions must lie in \[0, 1\], got \[1.5\]"),
])
def test_gpu_benchmarks_check_their_arguments_first(args, message, capsys) -> None:
    """On any machine, before the GPU check: a wrong argument is the first thing said."""
    from nats.cli import main

    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1
