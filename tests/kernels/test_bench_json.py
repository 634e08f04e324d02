"""``nats bench kernels`` writes standard JSON: a time it could not measure is null, not the
``NaN`` that strict JSON readers (``jq``, browsers, other languages) refuse."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nats.kernels import bench


def test_unmeasured_times_are_null(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "a GPU")
    rows = [bench.BenchRow(2048, 0.0, "fla_chunk_gdr (fwd only)", 1.5, math.nan),
            bench.BenchRow(2048, 0.25, "nats_mixed", 2.5, 9.1,
                           {"linear_fwd_ms": 1.9, "linear_fwd_bwd_ms": math.nan})]
    out = tmp_path / "kernels.json"
    bench._write_json(out, bench.BenchShape(), rows)

    def refuse(constant: str) -> None:
        pytest.fail(f"non-standard JSON constant {constant}")

    data = json.loads(out.read_text(), parse_constant=refuse)
    assert data["device"] == "a GPU"
    assert [(r["fwd_ms"], r["fwd_bwd_ms"]) for r in data["rows"]] == [(1.5, None), (2.5, 9.1)]
    assert data["rows"][1]["extra"] == {"linear_fwd_ms": 1.9, "linear_fwd_bwd_ms": None}
