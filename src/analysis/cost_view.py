"""What an architecture costs against context length, beside the same model all-softmax and
all-linear: a table and a log-log picture of :func:`~nats.cost_model.compare_costs`.

The numbers are the cost model's (its module docstring has the formulas); this module only
lays them out, so that the report and the tests read the same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from PIL import Image

from nats.cost_model import ArchitectureCost
from nats.plotting import PALETTE, Series, format_si, format_tokens, line_plot, stack

VARIANTS = ("model", "all-softmax", "all-linear")
"""The curves of :func:`compare_costs`, in the order they are shown."""
LEGEND_WIDTH = 230
"""The same legend box in every panel, so that their plot areas line up."""


@dataclass(frozen=True)
class CostMetric:
    key: str
    """Attribute of :class:`ArchitectureCost`."""
    title: str
    unit: str
    log_y: bool
    """Log scale for what grows with the context; the state does not (linear, from 0)."""


COST_METRICS = (
    CostMetric("flops_per_token", "attention FLOPs per token", "FLOPs", True),
    CostMetric("kv_cache_bytes", "KV-cache bytes", "bytes", True),
    CostMetric("state_bytes", "recurrent-state bytes (constant in the context)", "bytes",
               False),
)
"""What the table and the picture show, per context length (batch 1)."""


def cost_rows(curves: Mapping[str, Sequence[ArchitectureCost]]) -> list[dict[str, float]]:
    """One row per context length: ``context`` and ``"{variant}/{metric}"`` for every
    variant of ``curves`` (``compare_costs``'s result) and every :data:`COST_METRICS`."""
    contexts = [c.context_len for c in curves["model"]]
    for name, curve in curves.items():
        if [c.context_len for c in curve] != contexts:
            raise ValueError(f"curve {name!r} is at other context lengths than 'model'")
    return [{"context": n, **{f"{name}/{m.key}": float(getattr(curve[i], m.key))
                              for name, curve in curves.items() for m in COST_METRICS}}
            for i, n in enumerate(contexts)]


def cost_figure(curves: Mapping[str, Sequence[ArchitectureCost]], title: str = "",
                width: int = 760) -> Image.Image:
    """The :data:`COST_METRICS` against context length (log x), one panel each, stacked and
    aligned; the model in orange, all-softmax and all-linear dashed."""
    panels = []
    for n, metric in enumerate(COST_METRICS):
        series = [Series(name, [(c.context_len, float(getattr(c, metric.key))) for c in curve],
                         PALETTE[k], dashed=name != "model")
                  for k, (name, curve) in enumerate(curves.items())]
        contexts = [c.context_len for c in curves["model"]]
        ticks = contexts[::2] if len(contexts) > 6 else contexts
        panels.append(line_plot(series, xlabel="context length (tokens)",
                                ylabel=metric.unit, log_x=True, log_y=metric.log_y,
                                xticks=ticks, xfmt=format_tokens, yfmt=format_si,
                                legend_width=LEGEND_WIDTH,
                                title=(f"{title}: " if title and n == 0 else "") + metric.title,
                                size=(width, 360)))
    return stack(panels)
