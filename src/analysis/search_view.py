"""What a search found: the Pareto front with the chosen trial marked, which parameters
mattered (Optuna's importances), and the front as a table.

Everything is read from the search folder: the trials' records (through
:func:`nats.search_spaces.results.collect`) and the Optuna study the search kept.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from nats.plotting import bar_chart, stack
from nats.search_spaces.pareto import plot_front


@dataclass(frozen=True)
class SearchView:
    out: Path
    results: Any
    """:class:`nats.search_spaces.results.SearchResults`."""
    chosen: int | None
    """Row of the trial the search exports by default (the knee of the front)."""
    importances: dict[str, dict[str, float]] = field(default_factory=dict)
    """Objective key -> parameter -> importance (they sum to 1 per objective)."""
    importance_note: str = ""
    """Why importances are missing, when they are."""

    @property
    def front_rows(self) -> list[dict[str, Any]]:
        return [self.results.rows[i] for i in self.results.front]


def param_importances(study: Any, keys: list[str], modes: list[str]) -> dict[str, dict[str,
                                                                                   float]]:
    """Per objective, Optuna's parameter importances (its default evaluator) over the
    completed trials; a maximised objective is negated, as the evaluator ranks what makes
    a target low."""
    import optuna

    out = {}
    for k, (key, mode) in enumerate(zip(keys, modes, strict=True)):
        sign = 1.0 if mode == "min" else -1.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = optuna.importance.get_param_importances(
                study, target=lambda t, k=k, sign=sign: sign * t.values[k])
        out[key] = {name: float(v) for name, v in got.items()}
    return out


def load_search_view(out: str | Path) -> SearchView:
    """Read the search in ``out``: its results, default pick and the study's importances."""
    from nats.search_spaces.results import collect, pick
    from nats.search_spaces.search import load_study

    out = Path(out)
    results = collect(out, finished=(out / "results.csv").exists())
    chosen = pick(results) if results.front else None
    importances: dict[str, dict[str, float]] = {}
    note = ""
    try:
        study = load_study(out)
        complete = [t for t in study.trials if t.state.name == "COMPLETE"]
        if len(complete) < 2:
            note = f"the study has {len(complete)} completed trial(s); importances need 2"
        else:
            importances = param_importances(study, results.keys, results.modes)
    except FileNotFoundError as e:
        note = str(e)
    except (RuntimeError, ValueError) as e:  # e.g. every trial had the same parameters
        note = f"Optuna could not rank the parameters: {' '.join(str(e).split())}"
    except Exception as e:  # a database storage: SQLAlchemy, drivers, an empty study
        note = (f"the study could not be read ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}); importances not available")
    return SearchView(out, results, chosen, importances, note)


def front_figure(view: SearchView, path: str | Path) -> Path:
    """Quality against cost of every finished trial, the front joined and numbered as in
    :func:`front_table`, the chosen trial ringed; written as a PNG."""
    r = view.results
    (qk, qmode), (ck, _) = r.settings.quality_key, r.settings.cost_key
    from nats.search_spaces.objectives import finite

    plotted = [i for i, row in enumerate(r.rows) if finite(row.get(qk)) and finite(row.get(ck))]
    points = [(r.rows[i][ck], r.rows[i][qk]) for i in plotted]
    labels = ["" for _ in plotted]
    for n, i in enumerate(r.front, 1):
        if i in plotted:
            labels[plotted.index(i)] = f"#{n}"
    return plot_front(
        points, [plotted.index(i) for i in r.front if i in plotted], path,
        xlabel=f"{ck} at {r.settings.context} tokens",
        ylabel=f"{qk} ({'lower' if qmode == 'min' else 'higher'} is better)",
        title=f"{len(plotted)} trials; Pareto front in orange, chosen trial ringed",
        labels=labels, marked=plotted.index(view.chosen) if view.chosen in plotted else None)


def importance_figure(view: SearchView) -> Image.Image | None:
    """One bar chart per objective, parameters from most to least important, stacked."""
    charts = [bar_chart(list(imp), list(imp.values()), xlabel="importance (sums to 1)",
                        title=f"parameter importance for {key}")
              for key, imp in view.importances.items() if imp]
    if not charts:
        return None
    return stack(charts)


def front_table(view: SearchView) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the front (numbered as in the picture; ``*`` marks the chosen
    trial): the trial, its architecture, the searched parameters and both objectives."""
    r = view.results
    keys = [*r.keys, "eval/attn_frac"]
    shown = ("chunk_size", "layer_types")
    params = sorted({k for row in view.front_rows for k in row
                     if k.startswith("param/") and k.removeprefix("param/") not in shown})
    columns = ["#", "trial_id", *shown, *params, *keys]
    body = []
    for n, i in enumerate(r.front, 1):
        row = r.rows[i]
        cells = [f"{n}{' *' if i == view.chosen else ''}"]
        cells += [_cell(row.get(c)) for c in columns[1:]]
        body.append(cells)
    return columns, body


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
