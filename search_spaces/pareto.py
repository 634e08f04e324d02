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
    more than a factor of 20 (costs often span orders of magnitude)."""
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
    axes = Axes((90, 40 if title else 20, width - 45, height - 60),
                log_ticks(min(xs), max(xs)) if log_x else nice_ticks(min(xs), max(xs)),
                nice_ticks(min(ys), max(ys)), log_x=log_x)
    axes.draw(img, xlabel, ylabel, title, font=font)
    draw = ImageDraw.Draw(img)
    on_front = set(front)
    line = [axes.px(*points[i]) for i in sorted(front, key=lambda i: points[i])]
    if len(line) > 1:
        draw.line(line, fill=FRONT_COLOR, width=2)
    texts: dict[tuple[float, float], list[str]] = {}  # equal points share one label
    for i, p in enumerate(points):
        u, v = axes.px(*p)
        color = FRONT_COLOR if i in on_front else OTHER_COLOR
        draw.ellipse([u - 5, v - 5, u + 5, v + 5], fill=color, outline="black")
        if labels is not None and i in on_front and labels[i]:
            texts.setdefault((u, v), []).append(labels[i])
    for (u, v), names in texts.items():
        draw.text((u + 7, v - 7), ", ".join(names), fill="black", font=font, anchor="lb")
    if marked is not None:
        u, v = axes.px(*points[marked])
        draw.ellipse([u - 10, v - 10, u + 10, v + 10], outline=MARKED_COLOR, width=3)
    items = [LegendItem("trial", OTHER_COLOR, "dot"), LegendItem("Pareto front", FRONT_COLOR,
                                                                 "dot")]
    if marked is not None:
        items.append(LegendItem("chosen", MARKED_COLOR, "ring"))
    corner = quiet_corner(axes.box, legend_size(items, font), [axes.px(*p) for p in points])
    draw_legend(img, items, corner, font)
    return save_png(img, path)
