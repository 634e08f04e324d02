"""The developer benchmarks in ``benchmarks/`` stay importable, and importing one runs
nothing: they need a GPU to run, so without this nothing would notice one rotting when the
code it drives changes (a renamed function, a removed constant)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_the_scripts_are_found() -> None:
    assert {"bench_gated_delta_rule", "profile_mixed_operator"} <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_script_imports_without_running(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(path.parent))  # as `python benchmarks/x.py` would
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert module.__doc__ and "python benchmarks/" in module.__doc__, "say how to run it"
