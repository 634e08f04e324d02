"""The GPU gate script runs every GPU test module: a new module cannot be left out of it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_gate_lists_every_gpu_module() -> None:
    listed = set(re.findall(r"tests/\S+\.py", (ROOT / ".ci" / "gpu-gate").read_text()))
    marker = re.compile(r"^\s*(pytestmark = |@)pytest\.mark\.gpu\b|marks=pytest\.mark\.gpu\b",
                        re.MULTILINE)
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if marker.search(p.read_text())}
    assert marked and listed == marked
