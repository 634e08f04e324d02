"""A search's results: the table of all trials, the Pareto front, the plot and the export.

Rows come from the trials' ``search_trial.json`` files, so a running search can be shown
too. The front is taken over the trials that finished all their steps (a trial stopped
early by ASHA or the time budget is listed, but its quality is not comparable).
"""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.atomic_write import atomic_write_bytes
from nats.model import read_json_object
from nats.search_spaces.pareto import pareto_front, plot_front

from .objectives import finite
from .search import TRIAL_FILE, SearchSettings
from .spaces import MODEL_PARAMS

RESULTS_CSV, FRONT_JSON, FRONT_PNG, EXPORT_DIR = ("results.csv", "pareto.json", "pareto.png",
                                                  "export")
ERRORS_JSON = "errors.json"
"""Trial id -> one-line error of the trials that failed after their retries."""


@dataclass
class SearchResults:
    settings: SearchSettings
    rows: list[dict[str, Any]]
    """One per trial, in start order: ``trial_id``, ``status``, ``step``, the model fields
    a search changes, ``param/*`` (Optuna's parameters), ``eval/*`` and ``cost/*``."""
    front: list[int]
    """Indices into ``rows`` of the Pareto front, by increasing cost (or quality order)."""
    keys: list[str]
    modes: list[str]


def _row(record: dict[str, Any], error: str | None) -> dict[str, Any]:
    model = record.get("model", {})
    status = record.get("status", "running")
    if error is not None:
        status = "error"
    row: dict[str, Any] = {"trial_id": record["trial_id"], "status": status,
                           "step": record.get("step", 0), "steps": record.get("steps"),
                           "node": record.get("node"), "gpus": record.get("gpus"),
                           "wall_s": _wall_s(record)}
    for name in MODEL_PARAMS:  # every model field a space may search, for the table
        row[name] = model.get(name)
    row["layer_types"] = "-".join(model.get("layer_types", []))
    for key, value in sorted(record.get("params", {}).items()):
        row[f"param/{key}"] = value
    row.update(record.get("metrics", {}))
    if "duplicate_of" in record:  # trained once, as that trial: not a point of its own
        row["duplicate_of"] = record["duplicate_of"]
    if error is not None:
        row["error"] = error
    return row


def _wall_s(record: dict[str, Any]) -> float | None:
    """Seconds from the trial's (latest) start to its end; None while it runs."""
    if "ended_at" not in record or "started_at" not in record:
        return None
    return round(record["ended_at"] - record["started_at"], 1)


def save_errors(out: str | Path, errors: dict[str, str]) -> None:
    """Add the failures of a search's run to ``errors.json``: Tune's result grid, which
    holds them, is gone once the command ends, and ``show`` or ``analyze`` must still
    say which trials failed and why."""
    if errors:
        saved = {**load_errors(out), **errors}
        atomic_write_bytes(Path(out) / ERRORS_JSON,
                           json.dumps(saved, indent=1, sort_keys=True).encode())


def load_errors(out: str | Path) -> dict[str, str]:
    """Trial id -> error of every failure :func:`save_errors` recorded ({} if none)."""
    path = Path(out) / ERRORS_JSON
    if not path.is_file():
        return {}
    data = read_json_object(path)
    return {str(k): str(v) for k, v in data.items()}


def collect(out: str | Path, errors: dict[str, str] | None = None,
            finished: bool = False) -> SearchResults:
    """Read every trial of the search in ``out``. ``finished``: the search is over, so a
    trial still marked running was stopped (ASHA, time budget). ``errors`` (this run's
    failures) and those recorded before (:func:`load_errors`) mark their trials failed,
    a recorded one unless the trial has finished since (retried on ``--resume``)."""
    out = Path(out)
    settings = SearchSettings.load(out)
    errors = dict(errors or {})
    recorded = load_errors(out)
    records = []
    for path in sorted((out / "trials").glob(f"*/{TRIAL_FILE}")):
        try:
            record = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # being written by a running trial (writes are atomic: rare)
        if not isinstance(record, dict) or not isinstance(record.get("trial_id"), str):
            print(f"nats: warning: skipping {path}: not a trial record (no trial_id)",
                  file=sys.stderr)
            continue
        records.append(record)
    records.sort(key=lambda r: r["trial_id"])
    rows = []
    for r in records:
        before = recorded.pop(r["trial_id"], None)
        rows.append(_row(r, errors.pop(r["trial_id"], None)
                         or (before if r.get("status") != "done" else None)))
    errors = {**recorded, **errors}
    rows += [{"trial_id": t, "status": "error", "error": e} for t, e in sorted(errors.items())]
    if finished:
        for row in rows:
            if row["status"] in ("running", "interrupted"):
                row["status"] = "stopped"
    keys, modes = settings.keys_and_modes
    done = [i for i, r in enumerate(rows)
            if r["status"] == "done" and all(finite(r.get(k)) for k in keys)]
    front = [done[j] for j in pareto_front([[rows[i][k] for k in keys] for i in done], modes)]
    cost_key = settings.cost_key[0]
    front.sort(key=lambda i: (rows[i].get(cost_key, 0.0), rows[i]["trial_id"]))
    return SearchResults(settings, rows, front, keys, modes)


def write(results: SearchResults, out: str | Path) -> list[Path]:
    """``results.csv`` (all trials), ``pareto.json`` and ``pareto.png``."""
    out = Path(out)
    columns: list[str] = []
    for row in results.rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(results.rows)
    atomic_write_bytes(out / RESULTS_CSV, buf.getvalue().encode())
    s = results.settings
    front_doc = {"objectives": [{"metric": k, "mode": m}
                                for k, m in zip(results.keys, results.modes, strict=True)],
                 "context": s.context,
                 "trials": [results.rows[i] for i in results.front]}
    atomic_write_bytes(out / FRONT_JSON, json.dumps(front_doc, indent=2).encode())
    (qk, _), (ck, _) = s.quality_key, s.cost_key
    plotted = [i for i, r in enumerate(results.rows) if finite(r.get(qk)) and finite(r.get(ck))]
    points = [(results.rows[i][ck], results.rows[i][qk]) for i in plotted]
    front = [plotted.index(i) for i in results.front if i in plotted]
    labels = [""] * len(plotted)
    for n, i in enumerate(results.front, 1):
        if i in plotted:
            labels[plotted.index(i)] = f"#{n}"
    png = plot_front(points, front, out / FRONT_PNG,
                     xlabel=_cost_label(ck, s),
                     ylabel=f"{qk} ({'lower' if s.quality_key[1] == 'min' else 'higher'} "
                            "is better)",
                     title=f"{len(plotted)} trials, Pareto front in orange", labels=labels)
    return [out / RESULTS_CSV, out / FRONT_JSON, png]


def _cost_label(key: str, settings: Any) -> str:
    if key == "cost/latency_ms":
        return f"{key}: forward over {settings.latency_len} tokens (ms)"
    return f"{key} at {settings.context} tokens ({'FLOPs' if 'flops' in key else 'bytes'})"


KNEE = 0.1
"""The default pick's tolerance: the cheapest front trial whose quality is within this
share of the front's quality range of the best."""


def pick(results: SearchResults, choice: str | int | None = None) -> int:
    """The row to export: ``#N`` of the printed front (1-based) or a trial id; by default
    the knee of the front: the cheapest trial whose quality is within ``KNEE`` of the
    front's quality range of the best (so a trial that costs a fraction of the best one for
    nearly its quality is taken over it; with one objective, the best)."""
    if not results.front:
        raise ValueError("no trial finished with both objectives measured: nothing to pick")
    if choice is None:
        key, mode = results.settings.quality_key
        sign = 1.0 if mode == "min" else -1.0
        cost = results.settings.cost_key[0]
        # A front by cost alone may hold trials without a finite quality: never the knee
        # unless no trial has one.
        scores = {i: sign * results.rows[i][key] for i in results.front
                  if finite(results.rows[i].get(key))}
        if not scores:
            return min(results.front, key=lambda i: results.rows[i].get(cost, 0.0))
        best, worst = min(scores.values()), max(scores.values())
        near = [i for i in scores if scores[i] <= best + KNEE * (worst - best)]
        return min(near, key=lambda i: (results.rows[i].get(cost, 0.0), scores[i]))
    text = str(choice).lstrip("#")
    if text.isdigit():
        n = int(text)
        if not 1 <= n <= len(results.front):
            raise ValueError(f"--pick {choice}: the front has entries 1..{len(results.front)}")
        return results.front[n - 1]
    for i, row in enumerate(results.rows):
        if row["trial_id"] == text:
            if row["status"] != "done":
                raise ValueError(f"--pick {choice}: trial {text} is {row['status']}, not done")
            return i
    raise ValueError(f"--pick {choice}: neither a front entry 1..{len(results.front)} nor a "
                     "trial id of this search")


def export_pick(results: SearchResults, out: str | Path, index: int) -> Any:
    """Export trial ``rows[index]`` with :func:`nats.trainers.export.export_architecture` into
    ``out/export`` (replacing an earlier export)."""
    from nats.trainers.export import export_architecture

    out = Path(out)
    trial_dir = out / "trials" / results.rows[index]["trial_id"]
    return export_architecture(trial_dir, out / EXPORT_DIR, force=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


TABLE_COLUMNS = ("trial_id", "status", "step", "chunk_size", "layer_types", "reg_lambda")


def table(results: SearchResults, rows: list[int] | None = None,
          numbered: bool = False) -> str:
    """A plain-text table of ``rows`` (default: all) with the objectives and fractions."""
    s = results.settings
    keys = [s.quality_key[0], s.cost_key[0], "eval/attn_frac"]
    extra = [d.name if d.name in MODEL_PARAMS else f"param/{d.name}"
             for d in s.search_space().dims if d.name not in TABLE_COLUMNS]
    columns = [*(("#",) if numbered else ()), *TABLE_COLUMNS, *extra, *keys]
    indices = range(len(results.rows)) if rows is None else rows
    body = [[str(n) if c == "#" else _fmt(results.rows[i].get(c)) for c in columns]
            for n, i in enumerate(indices, 1)]
    widths = [max(len(c), *(len(r[j]) for r in body)) if body else len(c)
              for j, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(line.rstrip() for line in lines)
