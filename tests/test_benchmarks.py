"""The developer benchmarks in ``benchmarks/`` stay importable, and importing one runs
nothing: they need a GPU to run, so without this nothing would notice one rotting when the
code it drives changes (a renamed function, a removed constant)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _load(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(path.parent))  # as `python benchmarks/x.py` would
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_scripts_are_found() -> None:
    assert {"bench_gated_delta_rule", "profile_mixed_operator"} <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_script_imports_without_running(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # a value no script sets, so a change shows
    try:
        module = _load(path, monkeypatch)
        changed = torch.get_num_threads() != threads + 1
    finally:
        torch.set_num_threads(threads)
    assert not changed, "importing it changed torch's settings"
    assert module.__doc__ and "python benchmarks/" in module.__doc__, "say how to run it"
    guards = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
              if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"]
    assert guards, "its work runs under `if __name__ == '__main__':`"


@pytest.mark.parametrize("path", [p for p in SCRIPTS if "DRY_RUN" in p.read_text()],
                         ids=lambda p: p.stem)
def test_dry_run_shapes_are_valid(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DRY_RUN=1`` (the scripts' check under the CPU interpreter) builds its small shape
    at import: a shape the benchmark's own checks refuse would fail only there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DRY_RUN", "1")
    module = _load(path, monkeypatch)
    assert getattr(module, "DEVICE", "cpu") == "cpu"


def test_rounding_emulator_uses_the_gpu_tests_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """emulate_gdr_rounding.py may not import tests/, so it makes the GPU test's inputs
    itself; they must stay those of tests/kernels/inputs.py."""
    emulate = _load(ROOT / "benchmarks" / "emulate_gdr_rounding.py", monkeypatch)
    spec = importlib.util.spec_from_file_location("kernel_test_inputs",
                                                  ROOT / "tests" / "kernels" / "inputs.py")
    inputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inputs)
    x, routes = emulate.make(T=256, H=2, K=16, seed=7, chunk=64)
    want = inputs.gdr_inputs(1, 256, 2, 16, 16, dtype=torch.float32, seed=7)
    assert x.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(x[name], tensor), name
    assert torch.equal(routes, inputs.routes_with_softmax_fraction(1, 4, 2, 0.25))
