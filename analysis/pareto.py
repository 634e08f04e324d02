"""Pareto fronts of search results: the non-dominated filter and a PNG plot.

A point dominates another when it is at least as good in every objective and strictly
better in one ("good" per objective: ``"min"`` or ``"max"``). Equal points do not dominate
each other, so duplicates on the front are all kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

MODES = ("min", "max")


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


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten around ``lo .. hi`` (with 2 and 5 between them over few decades)."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    last = max(last, first + 1)
    steps = (1,) if last - first > 3 else (1, 2, 5)
    ticks = [m * 10.0**e for e in range(first, last + 1) for m in steps]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo] or [ticks[0]]
    above = [t for t in ticks if t > hi] or [ticks[-1]]
    return [below[-1], *inside, above[0]] if inside else [below[-1], above[0]]


def _fmt(v: float) -> str:
    a = abs(v)
    if a and (a >= 1e5 or a < 1e-3):
        return f"{v:.2g}"
    return f"{v:.4g}"


def plot_front(points: Sequence[tuple[float, float]], front: Sequence[int], path: str | Path,
               *, xlabel: str, ylabel: str, title: str = "",
               labels: Sequence[str] | None = None, size: tuple[int, int] = (720, 480),
               log_x: bool | None = None) -> Path:
    """Scatter ``points`` ``(x, y)`` (grey) with the ``front`` indices highlighted and joined
    (orange, labelled with ``labels[i]``), axes ticked and labelled; written as a PNG.

    ``log_x``: a logarithmic x axis; by default when every x is positive and they span
    more than a factor of 20 (costs often span orders of magnitude)."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=13)
    except TypeError:  # Pillow without FreeType sizes
        font = ImageFont.load_default()
    width, height = size
    left, right, top, bottom = 90, 45, 40 if title else 20, 60
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    xs = [p[0] for p in points] or [0.0]
    ys = [p[1] for p in points] or [0.0]
    if log_x is None:
        log_x = min(xs) > 0 and max(xs) > 20 * min(xs)
    if log_x and min(xs) <= 0:
        raise ValueError("a logarithmic x axis needs positive x values")
    fx = math.log10 if log_x else float
    xt = _log_ticks(min(xs), max(xs)) if log_x else _nice_ticks(min(xs), max(xs))
    yt = _nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = fx(xt[0]), fx(xt[-1]), yt[0], yt[-1]

    def px(x: float, y: float) -> tuple[float, float]:
        u = left + (fx(x) - x0) / (x1 - x0) * (width - left - right)
        v = height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)
        return u, v

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for t in xt:
        u, _ = px(t, y0)
        draw.line([u, height - bottom, u, height - bottom + 5], fill="black")
        draw.line([u, top, u, height - bottom], fill=(235, 235, 235))
        draw.text((u, height - bottom + 8), _fmt(t), fill="black", font=font, anchor="mt")
    for t in yt:
        _, v = px(x0, t)
        draw.line([left - 5, v, left, v], fill="black")
        draw.line([left, v, width - right, v], fill=(235, 235, 235))
        draw.text((left - 8, v), _fmt(t), fill="black", font=font, anchor="rm")
    draw.text(((left + width - right) / 2, height - 18), xlabel, fill="black", font=font,
              anchor="mm")
    box = draw.textbbox((0, 0), ylabel, font=font)
    label = Image.new("RGB", (box[2] - box[0] + 4, box[3] - box[1] + 6), "white")
    ImageDraw.Draw(label).text((2, 1), ylabel, fill="black", font=font)
    label = label.rotate(90, expand=True)
    img.paste(label, (8, int((top + height - bottom) / 2 - label.height / 2)))
    if title:
        draw.text((width / 2, 18), title, fill="black", font=font, anchor="mm")
    on_front = sorted(front, key=lambda i: points[i])
    line = [px(*points[i]) for i in on_front]
    if len(line) > 1:
        draw.line(line, fill=(230, 120, 20), width=2)
    for i, p in enumerate(points):
        u, v = px(*p)
        color = (230, 120, 20) if i in set(front) else (150, 150, 150)
        draw.ellipse([u - 5, v - 5, u + 5, v + 5], fill=color, outline="black")
        if labels is not None and i in set(front):
            draw.text((u + 7, v - 7), labels[i], fill="black", font=font, anchor="lb")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
    return path
