"""Pareto fronts of search results: the non-dominated filter and a PNG plot.

A point dominates another when it is at least as good in every objective and strictly
better in one ("good" per objective: ``"min"`` or ``"max"``). Equal points do not dominate
each other, so duplicates on the front are all kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from nats.plotting import (
    Axes,
    LegendItem,
    draw_legend,
    legend_size,
    load_font,
    log_ticks,
    nice_ticks,
    quiet_corner,
    save_png,
)

MODES = ("min", "max")
FRONT_COLOR, OTHER_COLOR, MARKED_COLOR = (230, 120, 20), (150, 150, 150), (200, 0, 0)
VIEW_MARGIN = 1.0
"""The plot shows the front's span widened by this many spans on each side (and no more
than the data): a point further out is drawn hollow on the border, so that one outlier
does not squash the front onto an axis."""


def _check(points: Sequence[Sequence[float]], modes: Sequence[str]) -> None:
    if any(m not in MODES for m in modes):
        raise ValueError(f"modes {list(modes)} must each be one of {MODES}")
    for p in points:
        if len(p) != len(modes):
            raise ValueError(f"point {list(p)} has {len(p)} values for {len(modes)} objectives")
        if any(not isinstance(v, (int, float)) or math.isnan(v) for v in p):
            raise ValueError(f"point {list(p)} holds a value that is not a number")


def dominates(a: Sequence[float], b: Sequence[float], modes: Sequence[str]) -> bool:
    """Whether ``a`` is no worse than ``b`` in every objective and better in one."""
    signs = [1.0 if m == "min" else -1.0 for m in modes]
    no_worse = all(s * x <= s * y for s, x, y in zip(signs, a, b, strict=True))
    better = any(s * x < s * y for s, x, y in zip(signs, a, b, strict=True))
    return no_worse and better


def pareto_front(points: Sequence[Sequence[float]], modes: Sequence[str]) -> list[int]:
    """Indices (ascending) of the points no other point dominates.

    Sorts by the objectives (each turned into "smaller is better") and sweeps, keeping a
    point unless an earlier kept point dominates it: ``O(n k)`` in the front size ``k``.
    """
    _check(points, modes)
    signs = [1.0 if m == "min" else -1.0 for m in modes]
    keyed = sorted(range(len(points)),
                   key=lambda i: tuple(s * v for s, v in zip(signs, points[i], strict=True)))
    front: list[int] = []
    for i in keyed:
        # A dominator sorts before the point it dominates (lexicographically no worse).
        if not any(dominates(points[j], points[i], modes) for j in front):
            front.append(i)
    return sorted(front)


def plot_front(points: Sequence[tuple[float, float]], front: Sequence[int], path: str | Path,
               *, xlabel: str, ylabel: str, title: str = "",
               labels: Sequence[str] | None = None, size: tuple[int, int] = (720, 480),
               log_x: bool | None = None, marked: int | None = None) -> Path:
    """Scatter ``points`` ``(x, y)`` (grey) with the ``front`` indices highlighted and joined
    (orange, labelled with ``labels[i]``), axes ticked and labelled, a legend; written as a
    PNG. ``marked``: the index of a chosen point, ringed in red ("chosen" in the legend).

    ``log_x``: a logarithmic x axis; by default when every x is positive and they span
    more than a factor of 20 (costs often span orders of magnitude). Front points are
    drawn over the others; points beyond :data:`VIEW_MARGIN` are clamped to the border.
    """
    from PIL import Image, ImageDraw

    font = load_font()
    width, height = size
    img = Image.new("RGB", size, "white")
    xs = [p[0] for p in points] or [0.0]
    ys = [p[1] for p in points] or [0.0]
    if log_x is None:
        log_x = min(xs) > 0 and max(xs) > 20 * min(xs)
    if log_x and min(xs) <= 0:
        raise ValueError("a logarithmic x axis needs positive x values")
    if marked is not None and not 0 <= marked < len(points):
        raise ValueError(f"marked point {marked} is not one of the {len(points)} points")
    shown = list(front) if front else list(range(len(points)))
    if marked is not None:
        shown.append(marked)
    x_lo, x_hi = view_range(xs, [xs[i] for i in shown] if points else xs, log_x)
    y_lo, y_hi = view_range(ys, [ys[i] for i in shown] if points else ys, False)
    axes = Axes((90, 40 if title else 20, width - 45, height - 60),
                log_ticks(x_lo, x_hi) if log_x else nice_ticks(x_lo, x_hi),
                nice_ticks(y_lo, y_hi), log_x=log_x)
    axes.draw(img, xlabel, ylabel, title, font=font)
    draw = ImageDraw.Draw(img)
    on_front = set(front)

    def at(i: int) -> tuple[tuple[float, float], bool]:
        """Pixel of point ``i``, clamped into the view, and whether it was clamped."""
        x, y = points[i]
        cx, cy = min(max(x, x_lo), x_hi), min(max(y, y_lo), y_hi)
        return axes.px(cx, cy), (cx, cy) != (x, y)

    line = [at(i)[0] for i in sorted(front, key=lambda i: points[i])]
    if len(line) > 1:
        draw.line(line, fill=FRONT_COLOR, width=2)
    texts: dict[tuple[float, float], list[str]] = {}  # equal points share one label
    # Dominated points first, so that none hides a front point.
    for i in sorted(range(len(points)), key=lambda i: i in on_front):
        (u, v), clamped = at(i)
        color = FRONT_COLOR if i in on_front else OTHER_COLOR
        draw.ellipse([u - 5, v - 5, u + 5, v + 5], fill="white" if clamped else color,
                     outline=color if clamped else "black", width=2 if clamped else 1)
        if labels is not None and i in on_front and labels[i]:
            texts.setdefault((u, v), []).append(labels[i])
    for (u, v), names in texts.items():
        draw.text((u + 7, v - 7), ", ".join(names), fill="black", font=font, anchor="lb")
    if marked is not None:
        u, v = at(marked)[0]
        draw.ellipse([u - 10, v - 10, u + 10, v + 10], outline=MARKED_COLOR, width=3)
    items = [LegendItem("trial", OTHER_COLOR, "dot"), LegendItem("Pareto front", FRONT_COLOR,
                                                                 "dot")]
    if marked is not None:
        items.append(LegendItem("chosen", MARKED_COLOR, "ring"))
    if any(at(i)[1] for i in range(len(points))):
        items.append(LegendItem("beyond the axes (on the edge)", OTHER_COLOR, "hollow"))
    corner = quiet_corner(axes.box, legend_size(items, font),
                          [at(i)[0] for i in range(len(points))])
    draw_legend(img, items, corner, font)
    return save_png(img, path)


def view_range(values: Sequence[float], focus: Sequence[float], log: bool) -> tuple[float, float]:
    """The axis range: ``focus``'s span widened by :data:`VIEW_MARGIN` spans each side
    (in log space for a log axis), cut to the range of ``values``."""
    lo, hi = min(values), max(values)
    f_lo, f_hi = min(focus), max(focus)
    if log:
        a, b = math.log(f_lo), math.log(f_hi)
        span = (b - a) or 1.0
        return max(lo, math.exp(a - VIEW_MARGIN * span)), min(hi, math.exp(b + VIEW_MARGIN * span))
    span = (f_hi - f_lo) or (abs(f_hi) or 1.0)
    return max(lo, f_lo - VIEW_MARGIN * span), min(hi, f_hi + VIEW_MARGIN * span)
