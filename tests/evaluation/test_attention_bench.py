"""`nats bench attention` at tiny sizes on the CPU: what it times is what it claims, and
the JSON and plot it writes agree with the configuration."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from nats.config import LINEAR_OPS
from nats.evaluation.attention_bench import (
    AttentionBenchConfig,
    _Inputs,
    default_config,
    naive_softmax_attention,
    operator,
    recurrent,
)

TINY = ["--device", "cpu", "--seq-lens", "16", "40", "--decode-contexts", "8", "32",
        "--batch", "2", "--heads", "2", "--head-dim", "8", "--chunk-size", "16", "--runs", "2",
        "--recurrent-runs", "1", "--recurrent-max-len", "16", "--warmup", "0"]


def test_naive_softmax_is_causal_softmax_attention():
    q, k, v = (torch.randn(2, 3, 37, 8, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(naive_softmax_attention(q, k, v), expected, atol=1e-12)


@pytest.mark.parametrize("linear_op", LINEAR_OPS)
def test_recurrent_form_computes_the_chunked_operator(linear_op):
    cfg = default_config("cpu", batch=2, heads=2, head_dim=8, chunk_size=16, dtype="float32")
    op = operator(cfg, linear_op)
    args = _Inputs(cfg, 37, torch.device("cpu")).linear(op)
    chunked, _ = op.parallel(*args)
    assert torch.allclose(recurrent(op, *args), chunked, atol=1e-4, rtol=1e-4)


def test_cli_writes_consistent_json_and_plot(tmp_path):
    out = tmp_path / "attention.json"
    # A fresh interpreter: the benchmark must not pull in the search or data stacks.
    code = ("import sys; from nats.cli import main; rc = main(sys.argv[1:]); "
            "heavy = {'ray', 'optuna', 'datasets'} & {m.split('.')[0] for m in sys.modules}; "
            "assert not heavy, heavy; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, "bench", "attention", *TINY, "--out",
                          str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    data = json.loads(out.read_text(), parse_constant=no_constants)  # standard JSON only
    cfg = data["config"]
    assert (cfg["seq_lens"], cfg["decode_contexts"], cfg["batch"]) == ([16, 40], [8, 32], 2)
    methods = ["softmax_naive", "softmax_sdpa",
               *(f"{op}_{form}" for op in LINEAR_OPS for form in ("chunked", "recurrent"))]
    forward = {(r["method"], r["length"]): r for r in data["forward"]}
    assert len(forward) == len(data["forward"]) == 2 * len(methods)
    for (method, length), row in forward.items():
        assert method in methods and length in (16, 40)
        if method.endswith("_recurrent") and length == 40:
            assert row["status"].startswith("skipped: longer than recurrent_max_len=16")
            assert row["mean_ms"] is None and row["std_ms"] is None
            continue
        assert row["status"] == "ok"
        assert row["runs"] == (1 if method.endswith("_recurrent") else 2)
        assert row["mean_ms"] > 0 and row["std_ms"] >= 0 and row["peak_mib"] is None
    decode = {(r["method"], r["length"]): r for r in data["decode"]}
    assert set(decode) == {(m, n) for m in ("softmax_sdpa", *LINEAR_OPS) for n in (8, 32)}
    for (method, context), row in decode.items():
        assert row["status"] == "ok" and row["mean_ms"] > 0
        # KV cache: k and v of B x H x L x D, float32; a state: B x H x Dk x (Dv or Dv + 1).
        columns = 9 if method == "linear_attention" else 8
        held = (2 * (2 * 2 * context * 8) * 4 if method == "softmax_sdpa"
                else 2 * 2 * 8 * columns * 4)
        assert math.isclose(row["held_mib"] * 2**20, held)
    with Image.open(out.with_suffix(".png")) as img:
        assert img.format == "PNG" and img.width >= 900 and img.height > 1000
    assert f"wrote {out}" in run.stdout


def test_bad_values_are_one_line_errors():
    run = subprocess.run([sys.executable, "-m", "nats.cli", "bench", "attention", "--device",
                          "cpu", "--runs", "0"], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip() == "nats: error: runs = 0 must be a positive integer"
    for option, value, message in (("--chunk-size", "0", "chunk_size = 0 must be a positive"),
                                   ("--chunk-size", "48", "chunk_size = 48 must be one of"),
                                   ("--out", "a.png", "--out a.png: the JSON file"),
                                   ("--out", ".", "--out . is a folder: give a file name"),
                                   ("--device", "bogus", "device 'bogus' is invalid")):
        run = subprocess.run([sys.executable, "-m", "nats.cli", "bench", "attention",
                              "--device", "cpu", option, value], capture_output=True, text=True)
        assert run.returncode == 2 and run.stderr.startswith(f"nats: error: {message}")
    with pytest.raises(ValueError, match="ops"):
        AttentionBenchConfig(device="cpu", seq_lens=(8,), runs=1, recurrent_runs=1,
                             recurrent_max_len=0, decode_contexts=(8,), ops=("mamba",))
