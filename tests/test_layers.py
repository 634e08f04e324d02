"""The import layers of docs/ARCHITECTURE.md hold: no module imports a higher layer or a
sibling, nothing imports ``experiments`` or ``benchmarks``, and no two modules import each
other in a cycle.

Read from the source with ``ast`` (import-linter's graph builder cannot follow the
``package-dir`` mapping that puts ``nats.kernels`` in ``src/kernels/``), so an import inside a
function counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
FOLDERS = {"kernels": "nats.kernels", "nats": "nats", "trainers": "nats.trainers",
           "search_spaces": "nats.search_spaces", "analysis": "nats.analysis",
           "evaluation": "nats.evaluation"}
"""Folder under src/ -> the package it installs as (pyproject's package-dir)."""
LAYERS = (("nats.kernels",), ("nats",), ("nats.trainers",), ("nats.search_spaces",),
          ("nats.analysis", "nats.evaluation"), ("nats.cli",))
"""Lowest first; packages in one layer are siblings that must not import each other. A
module belongs to the longest package named here that holds it."""
SCRIPTS = {"experiments": "experiment scripts", "benchmarks": "developer benchmarks"}
"""Folders of scripts, not libraries: nothing in the package imports them."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC)
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in (SRC / folder).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, only for type checking)`` of every import in ``path``
    of a package module (or of a script folder), resolved to the longest known module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                   and ast.unparse(guard.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in guard.body for node in ast.walk(stmt)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            resolved = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                             if ".".join(parts[:n]) in known), None)
            if resolved is not None and resolved != name:
                out.append((resolved, node.lineno, id(node) in typing_only))
            elif parts[0] in SCRIPTS:
                out.append((parts[0], node.lineno, id(node) in typing_only))
    return out


def _layer(module: str) -> tuple[int, str]:
    """``(layer index, package)`` of ``module``."""
    best = max((p for layer in LAYERS for p in layer
                if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer), best


MODULES = _modules()
EDGES = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_the_package_is_found() -> None:
    for name in ("nats.kernels.ops", "nats.model", "nats.trainers.loop", "nats.cli",
                 "nats.search_spaces.search", "nats.analysis.report", "nats.evaluation.harness"):
        assert name in MODULES
    # Relative, absolute and typing-only imports are all seen.
    assert ("nats.model", True) in {(t, typing) for t, _, typing in EDGES["nats.cuda_graph"]}
    assert ("nats.cache", False) in {(t, typing) for t, _, typing in EDGES["nats.cuda_graph"]}
    assert "nats.kernels.ops" in {t for t, _, _ in EDGES["nats.config"]}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_upward_or_sideways(module: str) -> None:
    here, package = _layer(module)
    bad = []
    for target, line, _ in EDGES[module]:
        if target in SCRIPTS:
            bad.append(f"line {line}: {target} ({SCRIPTS[target]}, not a library)")
            continue
        there, other = _layer(target)
        if there > here or (there == here and other != package):
            bad.append(f"line {line}: {target} ({other} may not be imported from {package})")
    assert not bad, f"{module} ({MODULES[module].relative_to(ROOT)}): " + "; ".join(bad)


def test_no_import_cycles() -> None:
    """Module-level and deferred imports alike; ``TYPE_CHECKING`` imports run never."""
    graph = {m: {t for t, _, typing in EDGES[m] if not typing and t not in SCRIPTS}
             for m in MODULES}
    # A package's own __init__ re-exporting its modules is not a cycle to fix.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and t in MODULES)}
    cycles, state = [], dict.fromkeys(graph, 0)

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state[t] == 1:
                cycles.append(" -> ".join([*stack[stack.index(t):], t]))
            elif state[t] == 0:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m, [m])
    assert not cycles, cycles


def test_the_repository_root_holds_no_package() -> None:
    """A Python started in the root has it on ``sys.path``, so a package there shadows an
    installed one of its name: a top-level ``kernels/`` hid Hugging Face's ``kernels``,
    which transformers imports. The library's folders live under ``src/``."""
    found = sorted(p.name for p in ROOT.iterdir()
                   if (p / "__init__.py").is_file() or p.suffix == ".py")
    assert not found, found
