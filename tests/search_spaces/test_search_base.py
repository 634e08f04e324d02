"""The README's main job searches a task on which a hybrid is needed (a CPU regression
test of docs/RESULTS.md, "The README's main job").

Three trials of the default search base (``mqar-search``: 8 key-value pairs in the first
of four 16-token chunks, noise filler after them), trained as the search trains them: the
all-NAtS-L model at the base's budget learns the recall and routes the pairs' chunk to
softmax; Gated DeltaNet alone does not learn it, nor does the same NAtS-L model with
every route forced to linear. Measured on seeds 0-2 (this test is seed
0): NAtS-L 0.966 / 1.000 / 0.911 (``experiments/branch_norm.py --norms scaled``, the
base's norm and 300 steps), its first layer sending the pairs' chunk to softmax every
time against 0.25 of the other chunks; Gated DeltaNet 0.032 / 0.092 / 0.037 (in 400
steps, before the CPU references' reordered sums; 0.033 on seed 0 in 300).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nats.search_spaces.builtin import search_base
from nats.trainers import train

# The experiments' helper module, for the forced routes of their ``:linear`` rows.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import common

pytestmark = pytest.mark.slow  # three 300-step training runs, about 3 CPU minutes


def _trained(layers: tuple[str, ...], out: Path, routes: str = "learned") -> dict[str, float]:
    torch.set_num_threads(1)  # as a search trial trains, one core each
    base = search_base("mqar-search")
    config = base.replace(model=base.model.replace(layer_types=layers), device="cpu",
                          out_dir=str(out))
    with common.routes_forced(routes):
        return train(config).eval_metrics


def _start(layers: tuple[str, ...], out: Path, routes: str = "learned") -> subprocess.Popen:
    """:func:`_trained` in a process of its own (this file run as a script), so that the
    runs share the machine's cores as a search's trials do; it writes ``out``.json."""
    with open(f"{out}.log", "w") as log:  # the child keeps its own handle
        return subprocess.Popen([sys.executable, __file__, ",".join(layers), str(out),
                                 routes], stdout=log, stderr=subprocess.STDOUT)


def _result(process: subprocess.Popen, out: Path) -> dict[str, float]:
    process.wait()
    assert process.returncode == 0, Path(f"{out}.log").read_text()[-3000:]
    return json.loads(Path(f"{out}.json").read_text())


def test_nats_learns_the_default_task_and_gated_deltanet_does_not(tmp_path: Path) -> None:
    runs = {"nats": (("nats", "nats"), "learned"), "gdn": (("linear", "linear"), "learned"),
            # The same NAtS-L model with every route forced to linear (0.080 / 0.038 on
            # seeds 0-1): what it learns, it learns by routing.
            "all_linear": (("nats", "nats"), "linear")}
    started = {name: _start(layers, tmp_path / name, routes)
               for name, (layers, routes) in runs.items()}
    nats, gdn, all_linear = (_result(p, tmp_path / name) for name, p in started.items())
    assert nats["eval/acc"] > 0.8, nats
    assert gdn["eval/acc"] < 0.3, gdn
    assert all_linear["eval/acc"] < 0.3 and all_linear["eval/route_frac"] == 0, all_linear
    # The hybrid learned where softmax matters: the pairs' chunk, in the first layer.
    assert nats["eval/route_informative/layer0"] > 2 * nats["eval/route_filler/layer0"], nats
    assert 0.3 < nats["eval/route_frac"] < 0.7, nats  # the budget (0.5) holds


if __name__ == "__main__":  # one run for _start: layer types, run folder, routes
    layer_types, folder, forced = sys.argv[1].split(","), Path(sys.argv[2]), sys.argv[3]
    metrics = _trained(tuple(layer_types), folder, forced)
    Path(f"{folder}.json").write_text(json.dumps(metrics))
