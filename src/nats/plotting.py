"""Small Pillow drawing helpers shared by every analysis picture: fonts, ticks, axes with
labels, legends, and the plot types the report needs (lines, bars, histograms).

matplotlib is not a dependency; these few primitives are all the pictures need, and
keeping them in one place keeps the pictures consistent (same fonts, ticks, colours).
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from .atomic_write import atomic_write_bytes

Color = tuple[int, int, int]
GRID: Color = (235, 235, 235)
PALETTE: tuple[Color, ...] = ((230, 120, 20), (30, 90, 170), (60, 150, 60), (170, 40, 40),
                              (120, 70, 160), (100, 100, 100))
"""Series colours, in order (orange first: the model itself in every comparison)."""


def load_font(size: int = 13) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's bundled font at ``size`` pixels (a fixed-size bitmap font without FreeType)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType sizes
        return ImageFont.load_default()


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round ticks (steps of 1, 2, 2.5 or 5 times a power of ten) that
    cover ``lo .. hi``."""
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


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten around ``lo .. hi`` (with 2 and 5 between them over few decades)."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    last = max(last, first + 1)
    steps = (1,) if last - first > 3 else (1, 2, 5)
    ticks = [m * 10.0**e for e in range(first, last + 1) for m in steps]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo] or [ticks[0]]
    above = [t for t in ticks if t > hi] or [ticks[-1]]
    return [below[-1], *inside, above[0]] if inside else [below[-1], above[0]]


def format_tick(v: float) -> str:
    """Up to 4 significant digits; very large or small values in ``e`` notation."""
    a = abs(v)
    if a and (a >= 1e5 or a < 1e-3):
        return f"{v:.2g}"
    return f"{v:.4g}"


def stack(images: Sequence[Image.Image]) -> Image.Image:
    """``images`` one below the other on white, left-aligned, as wide as the widest."""
    out = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)),
                    "white")
    y = 0
    for image in images:
        out.paste(image, (0, y))
        y += image.height
    return out


def tick_labels(ticks: Sequence[float], fmt: Callable[[float], str]) -> list[str]:
    """``fmt`` of every tick; with :func:`format_tick`, as many significant digits as it takes
    to tell the ticks apart (a narrow range such as 3.4992 .. 3.5002 needs more than 4)."""
    labels = [fmt(t) for t in ticks]
    digits = 5
    while fmt is format_tick and len(set(labels)) < len(labels) and digits <= 12:
        labels = [f"{t:.{digits}g}" for t in ticks]
        digits += 1
    return labels


def format_si(v: float) -> str:
    """``1.5K``, ``64M``, ``2G``: decimal SI prefixes, for counts of bytes and FLOPs."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= factor:
            return f"{v / factor:.3g}{prefix}"
    return f"{v:.3g}"


def format_tokens(n: float) -> str:
    """Context lengths as ``1K``, ``64K``, ``1M`` (powers of 1024, as contexts are given)."""
    for factor, prefix in ((2**20, "M"), (2**10, "K")):
        if n >= factor and n % factor == 0:
            return f"{int(n // factor)}{prefix}"
    return f"{n:g}"


def vertical_text(img: Image.Image, text: str, center: tuple[float, float],
                  font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
                  fill: Color = (0, 0, 0)) -> None:
    """``text`` turned 90 degrees (reading upwards), centred at ``center``."""
    box = ImageDraw.Draw(img).textbbox((0, 0), text, font=font)
    label = Image.new("RGB", (box[2] - box[0] + 4, box[3] - box[1] + 6), "white")
    ImageDraw.Draw(label).text((2 - box[0], 1 - box[1]), text, fill=fill, font=font)
    label = label.rotate(90, expand=True)
    img.paste(label, (int(center[0] - label.width / 2), int(center[1] - label.height / 2)))


@dataclass(frozen=True)
class LegendItem:
    label: str
    color: Color
    marker: str = "box"
    """``"box"`` (filled square), ``"line"``, ``"dashed"``, ``"dot"``, ``"hollow"`` (a
    white dot ringed in the colour) or ``"ring"``."""


def legend_size(items: Sequence[LegendItem], font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
                ) -> tuple[int, int]:
    """Width and height :func:`draw_legend` takes for ``items`` (one row each)."""
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    width = max((draw.textlength(i.label, font=font) for i in items), default=0)
    return int(width) + 40, 20 * len(items) + 8


def draw_legend(img: Image.Image, items: Sequence[LegendItem], corner: tuple[float, float],
                font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: int = 0) -> None:
    """A framed legend (at least ``width`` wide) with its top-left corner at ``corner``: a
    marker and a label a row."""
    draw = ImageDraw.Draw(img)
    x, y = corner
    w, h = legend_size(items, font)
    w = max(w, width)
    draw.rectangle([x, y, x + w, y + h], fill="white", outline=(120, 120, 120))
    for n, item in enumerate(items):
        cy = y + 14 + 20 * n
        if item.marker == "line":
            draw.line([x + 8, cy, x + 28, cy], fill=item.color, width=3)
        elif item.marker == "dashed":
            _dashed_line(draw, (x + 6, cy), (x + 30, cy), item.color, 3, dash=4.0)
        elif item.marker == "dot":
            draw.ellipse([x + 13, cy - 5, x + 23, cy + 5], fill=item.color, outline="black")
        elif item.marker == "hollow":
            draw.ellipse([x + 13, cy - 5, x + 23, cy + 5], fill="white", outline=item.color,
                         width=2)
        elif item.marker == "ring":
            draw.ellipse([x + 11, cy - 7, x + 25, cy + 7], outline=item.color, width=3)
        else:
            draw.rectangle([x + 11, cy - 6, x + 23, cy + 6], fill=item.color, outline="black")
        draw.text((x + 34, cy), item.label, fill="black", font=font, anchor="lm")


def quiet_corner(box: tuple[float, float, float, float], size: tuple[int, int],
                 points: Sequence[tuple[float, float]], pad: int = 6) -> tuple[float, float]:
    """Top-left pixel of a ``size`` legend in the corner of ``box`` that covers the fewest
    of ``points`` (pixels), top right first on ties, so that a legend hides little data."""
    left, top, right, bottom = box
    w, h = size
    corners = [(right - w - pad, top + pad), (left + pad, top + pad),
               (right - w - pad, bottom - h - pad), (left + pad, bottom - h - pad)]

    def covered(c: tuple[float, float]) -> int:
        return sum(c[0] - 8 <= u <= c[0] + w + 8 and c[1] - 8 <= v <= c[1] + h + 8
                   for u, v in points)

    return min(corners, key=covered)


@dataclass(frozen=True)
class Axes:
    """A plot area ``box`` (left, top, right, bottom pixels) whose edges are the first and
    last ticks; maps data to pixels and draws the frame, grid, ticks and labels."""

    box: tuple[float, float, float, float]
    xticks: Sequence[float]
    yticks: Sequence[float]
    log_x: bool = False
    log_y: bool = False

    def _scale(self, v: float, ticks: Sequence[float], log: bool) -> float:
        f = math.log10 if log else float
        lo, hi = f(ticks[0]), f(ticks[-1])
        return (f(v) - lo) / ((hi - lo) or 1.0)

    def px(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        return (left + self._scale(x, self.xticks, self.log_x) * (right - left),
                bottom - self._scale(y, self.yticks, self.log_y) * (bottom - top))

    def draw(self, img: Image.Image, xlabel: str, ylabel: str, title: str = "", *,
             xfmt: Callable[[float], str] = format_tick,
             yfmt: Callable[[float], str] = format_tick,
             font: ImageFont.ImageFont | ImageFont.FreeTypeFont | None = None) -> None:
        """Frame, light grid at every tick, tick labels, axis labels (y turned) and title."""
        font = font or load_font()
        draw = ImageDraw.Draw(img)
        left, top, right, bottom = self.box
        xlabels, ylabels = tick_labels(self.xticks, xfmt), tick_labels(self.yticks, yfmt)
        for t, label in zip(self.xticks, xlabels, strict=True):
            u, _ = self.px(t, self.yticks[0])
            draw.line([u, top, u, bottom], fill=GRID)
            draw.line([u, bottom, u, bottom + 5], fill="black")
            draw.text((u, bottom + 8), label, fill="black", font=font, anchor="mt")
        for t, label in zip(self.yticks, ylabels, strict=True):
            _, v = self.px(self.xticks[0], t)
            draw.line([left, v, right, v], fill=GRID)
            draw.line([left - 5, v, left, v], fill="black")
            draw.text((left - 8, v), label, fill="black", font=font, anchor="rm")
        draw.rectangle([left, top, right, bottom], outline="black")
        draw.text(((left + right) / 2, bottom + 34), xlabel, fill="black", font=font,
                  anchor="mt")
        widest = max((draw.textlength(label, font=font) for label in ylabels), default=0)
        vertical_text(img, ylabel, (left - widest - 24, (top + bottom) / 2), font)
        if title:
            draw.text(((left + right) / 2, top - 12), title, fill="black", font=font,
                      anchor="mb")


def axis_ticks(values: Sequence[float], log: bool, zero: bool = False) -> list[float]:
    """Ticks that cover ``values``: powers of ten on a log axis, round steps otherwise
    (from 0 when ``zero``)."""
    values = list(values) or [0.0, 1.0]
    lo, hi = min(values), max(values)
    if log:
        return log_ticks(lo, hi)
    return nice_ticks(min(lo, 0.0) if zero else lo, hi)


@dataclass(frozen=True)
class Series:
    """One line of a :func:`line_plot`: points ``(x, y)`` joined in order."""

    label: str
    points: Sequence[tuple[float, float]]
    color: Color
    dashed: bool = False


def _dashed_line(draw: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float],
                 color: Color, width: int, dash: float = 8.0) -> None:
    length = math.dist(a, b)
    steps = max(1, int(length // dash))
    for k in range(0, steps, 2):
        s, e = k / steps, min(1.0, (k + 1) / steps)
        draw.line([a[0] + s * (b[0] - a[0]), a[1] + s * (b[1] - a[1]),
                   a[0] + e * (b[0] - a[0]), a[1] + e * (b[1] - a[1])], fill=color, width=width)


def line_plot(series: Sequence[Series], *, xlabel: str, ylabel: str, title: str = "",
              log_x: bool = False, log_y: bool = False,
              xticks: Sequence[float] | None = None,
              xfmt: Callable[[float], str] = format_tick,
              yfmt: Callable[[float], str] = format_tick,
              size: tuple[int, int] = (720, 420), legend_width: int = 0) -> Image.Image:
    """Lines with dots at their points, a legend right of the plot area (at least
    ``legend_width`` wide, so that stacked plots can line up).

    On a log axis, points that are not positive cannot be drawn: they are left out and the
    series' legend entry says so (e.g. an all-softmax model holds no recurrent state)."""
    font = load_font()
    shown = [[p for p in s.points if (not log_x or p[0] > 0) and (not log_y or p[1] > 0)]
             for s in series]
    items = [LegendItem(s.label + ("" if len(p) == len(s.points) else " (0: not drawn)"),
                        s.color, "dashed" if s.dashed else "line")
             for s, p in zip(series, shown, strict=True)]
    legend_w = max(legend_size(items, font)[0], legend_width)
    width, height = size
    width = max(width, 420 + legend_w)
    img = Image.new("RGB", (width, height), "white")
    xs = [x for pts in shown for x, _ in pts]
    ys = [y for pts in shown for _, y in pts]
    if not ys:
        ys = [1.0, 10.0] if log_y else [0.0, 1.0]
    axes = Axes((100, 40 if title else 20, width - legend_w - 30, height - 60),
                list(xticks) if xticks is not None else axis_ticks(xs, log_x),
                axis_ticks(ys, log_y, zero=not log_y), log_x, log_y)
    axes.draw(img, xlabel, ylabel, title, xfmt=xfmt, yfmt=yfmt, font=font)
    draw = ImageDraw.Draw(img)
    for s, pts in zip(series, shown, strict=True):
        coords = [axes.px(x, y) for x, y in pts]
        for a, b in itertools.pairwise(coords):
            if s.dashed:
                _dashed_line(draw, a, b, s.color, 2)
            else:
                draw.line([a, b], fill=s.color, width=2)
        for u, v in coords:
            draw.ellipse([u - 3, v - 3, u + 3, v + 3], fill=s.color)
    draw_legend(img, items, (width - legend_w - 15, axes.box[1]), font, legend_w)
    return img


def bar_chart(labels: Sequence[str], values: Sequence[float], *, xlabel: str, title: str = "",
              color: Color = PALETTE[1], width: int = 720,
              vfmt: Callable[[float], str] = lambda v: f"{v:.3f}") -> Image.Image:
    """Horizontal bars, one row per label (top to bottom as given), value printed at the end
    of each bar; the value axis starts at 0."""
    font = load_font()
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_w = int(max((probe.textlength(s, font=font) for s in labels), default=0)) + 20
    row = 26
    height = 110 + row * max(1, len(labels)) + (20 if title else 0)
    img = Image.new("RGB", (width, height), "white")
    top = 40 if title else 20
    axes = Axes((label_w + 10, top, width - 70, height - 70), [0.0, 1.0], [0.0, 1.0])
    ticks = nice_ticks(0.0, 1.15 * max([*values, 0.0]) or 1.0)  # room for the value labels
    axes = Axes(axes.box, ticks, [0.0, float(max(1, len(labels)))])
    axes.draw(img, xlabel, "", title, xfmt=format_tick, yfmt=lambda _: "", font=font)
    draw = ImageDraw.Draw(img)
    for n, (label, value) in enumerate(zip(labels, values, strict=True)):
        _, v0 = axes.px(0, len(labels) - n)
        _, v1 = axes.px(0, len(labels) - n - 1)
        u0, _ = axes.px(0, 0)
        u1, _ = axes.px(max(value, 0.0), 0)
        draw.rectangle([u0, v0 + 4, max(u1, u0 + 1), v1 - 4], fill=color, outline="black")
        draw.text((u0 - 8, (v0 + v1) / 2), label, fill="black", font=font, anchor="rm")
        draw.text((u1 + 5, (v0 + v1) / 2), vfmt(value), fill="black", font=font, anchor="lm")
    return img


def histogram(edges: Sequence[float], counts: Sequence[int], *, xlabel: str, ylabel: str,
              title: str = "", color: Color = PALETTE[0],
              size: tuple[int, int] = (520, 320)) -> Image.Image:
    """Vertical bars: bin ``i`` spans ``edges[i] .. edges[i + 1]`` and is ``counts[i]`` high."""
    if len(edges) != len(counts) + 1:
        raise ValueError(f"{len(counts)} bins need {len(counts) + 1} edges, got {len(edges)}")
    font = load_font()
    width, height = size
    img = Image.new("RGB", size, "white")
    xt = nice_ticks(edges[0], edges[-1])
    axes = Axes((90, 40 if title else 20, width - 25, height - 60), xt,
                nice_ticks(0.0, max([*counts, 1])))
    axes.draw(img, xlabel, ylabel, title, yfmt=format_si, font=font)
    draw = ImageDraw.Draw(img)
    for lo, hi, n in zip(edges, edges[1:], counts, strict=False):
        (u0, v0), (u1, v1) = axes.px(lo, n), axes.px(hi, 0)
        if n:
            draw.rectangle([u0, v0, u1, v1], fill=color, outline="black")
    return img


def save_png(img: Image.Image, path: str | Path) -> Path:
    """Write ``img`` as a PNG at ``path`` atomically: a reader (or a killed writer) never
    leaves a half-written picture."""
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)
