"""Routing maps: which chunks each head sent to softmax attention, as numbers and as pixels.

A map has one column per chunk (position runs left to right) and one row per (sequence,
routing head), sequence-major, so a glance shows where in the sequence and in which heads
the search keeps softmax. :func:`routing_map_image` is the bare grid (TensorBoard's images);
:func:`routing_figure` draws one input through every layer, with axes, a legend and each
layer's softmax fraction. Both paint their cells with :func:`paint_cells`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from nats.kernels import SOFTMAX
from nats.plotting import (
    Axes,
    LegendItem,
    draw_legend,
    legend_size,
    load_font,
    nice_ticks,
    vertical_text,
)
from nats.softmax_fraction import softmax_token_counts

SOFTMAX_RGB = (255, 170, 30)
"""Colour of a chunk routed to softmax attention (kept in the KV cache)."""
LINEAR_RGB = (30, 60, 140)
"""Colour of a chunk routed to linear attention (written into the state)."""
PLAIN_RGB = {"softmax": (250, 215, 160), "linear": (160, 175, 210)}
"""Rows of layers without routes: a plain softmax or linear layer (pale colours)."""
GRID_LEFT, GRID_TOP, ROW_HEIGHT, ROW_GAP, BAR_WIDTH = 130, 24, 22, 10, 90
"""Layout of :func:`routing_figure` in pixels: the grid's top-left corner (without a
title), one routing head's row, the gap between layers, a fraction bar's length at 1.0."""
TITLE_HEIGHT = 22
"""How far a title moves the grid down."""


def routing_map(routes: torch.Tensor) -> torch.Tensor:
    """``[B*H, N]`` boolean map, True where a chunk went to softmax, from ``[B, N, H, 2]``."""
    if routes.dim() != 4 or routes.shape[-1] != 2:
        raise ValueError(f"routes must have shape [B, N, H, 2], got {list(routes.shape)}")
    sm = routes[..., SOFTMAX].detach() > 0.5  # [B, N, H]
    return sm.permute(0, 2, 1).reshape(-1, routes.shape[1]).cpu()


def routing_map_image(routes: torch.Tensor, min_size: int = 256,
                      max_size: int = 2048) -> np.ndarray:
    """RGB ``uint8`` image ``[height, width, 3]`` of :func:`routing_map`.

    Each cell is upscaled by the same whole factor (nearest neighbour, no blur) until the
    image's shorter side reaches ``min_size`` pixels, because TensorBoard shows raw pixels;
    the factor stops growing where the longer side would pass ``max_size``.
    """
    grid = routing_map(routes).numpy()
    scale = max(1, min(-(-min_size // min(grid.shape)), max_size // max(grid.shape)))
    return paint_cells(grid, scale, scale)


def paint_cells(grid: np.ndarray, cell_w: int, cell_h: int) -> np.ndarray:
    """RGB ``uint8`` pixels of a boolean ``[rows, chunks]`` grid (True: softmax), each cell
    ``cell_h`` x ``cell_w`` pixels of one colour (nearest neighbour)."""
    image = np.where(grid[..., None], np.array(SOFTMAX_RGB, np.uint8),
                     np.array(LINEAR_RGB, np.uint8))
    return image.repeat(cell_h, axis=0).repeat(cell_w, axis=1)


def routing_figure(routes: Sequence[torch.Tensor | None], layer_types: Sequence[str],
                   chunk_size: int, seq_len: int, sequence: int = 0, title: str = "",
                   width: int = 960, cell_width: int | None = None) -> Image.Image:
    """One input through every layer: chunks along x (ticked in token positions), each
    layer's routing heads along y (layer 0 at the top), softmax/linear in two colours, a
    legend, and a bar per layer of the softmax fraction of this input (token-weighted).

    ``routes[i]``: layer ``i``'s ``[B, N, H, 2]`` routes (``None``: a plain layer, drawn as
    one pale row of its kind); ``sequence`` picks the row ``b`` to draw. A chunk is
    ``cell_width`` pixels wide (default: what fits ``width``, 1 to 40)."""
    if len(routes) != len(layer_types):
        raise ValueError(f"{len(routes)} layers of routes for {len(layer_types)} layer types")
    grids: list[np.ndarray | None] = []
    fractions: list[float] = []
    for r, kind in zip(routes, layer_types, strict=True):
        if r is None:
            grids.append(None)
            fractions.append(1.0 if kind == "softmax" else 0.0)
            continue
        one = r[sequence: sequence + 1]
        grids.append(routing_map(one).numpy())
        counts = softmax_token_counts(one, seq_len, chunk_size)
        fractions.append(float(counts.sum()) / (seq_len * counts.numel()))
    n_chunks = next((g.shape[1] for g in grids if g is not None), -(-seq_len // chunk_size))
    font = load_font()
    left, gap, row_h, bar_len = GRID_LEFT, ROW_GAP, ROW_HEIGHT, BAR_WIDTH
    bar_w = bar_len + 40
    cell_w = cell_width or max(1, min(40, (width - left - bar_w - 70) // n_chunks))
    grid_w = cell_w * n_chunks
    heights = [row_h * (1 if g is None else g.shape[0]) for g in grids]
    top = GRID_TOP + (TITLE_HEIGHT if title else 0)
    grid_h = sum(heights) + gap * (len(grids) - 1)
    items = [LegendItem("softmax: chunk kept in the KV cache", SOFTMAX_RGB),
             LegendItem("linear: chunk written into the state", LINEAR_RGB)]
    items += [LegendItem(f"plain {'softmax' if k == 'softmax' else 'linear'} layer "
                         "(no routes)", PLAIN_RGB[k])
              for k in ("softmax", "linear") if k in layer_types]
    legend_w, legend_h = legend_size(items, font)
    img_w = max(left + grid_w + bar_w + 60, legend_w + 40)
    img = Image.new("RGB", (img_w, top + grid_h + 70 + legend_h + 10), "white")
    draw = ImageDraw.Draw(img)
    if title:
        draw.text((img_w / 2, 14), title, fill="black", font=font, anchor="mt")
    y = top
    bar_x = left + grid_w + 40
    draw.text((bar_x + bar_w / 2 - 20, top - 6), "softmax fraction", fill="black", font=font,
              anchor="mb")
    for i, (grid, kind, height, f) in enumerate(zip(grids, layer_types, heights, fractions,
                                                    strict=True)):
        if grid is None:
            draw.rectangle([left, y, left + grid_w - 1, y + height - 1], fill=PLAIN_RGB[kind])
            note = f"plain {kind} layer: no routes"
            if draw.textlength(note, font=font) < grid_w - 8:
                draw.text((left + grid_w / 2, y + height / 2), note, fill="black", font=font,
                          anchor="mm")
        else:
            img.paste(Image.fromarray(paint_cells(grid, cell_w, row_h)), (left, y))
            if cell_w >= 6:  # separate the chunks where cells are wide enough to see them
                for c in range(1, n_chunks):
                    draw.line([left + c * cell_w, y, left + c * cell_w, y + height - 1],
                              fill="white")
            for h in range(grid.shape[0]):
                draw.text((left - 6, y + row_h * h + row_h / 2), f"head {h}", fill="black",
                          font=font, anchor="rm")
        draw.text((left - 62, y + height / 2), f"layer {i}", fill="black", font=font,
                  anchor="rm")
        mid = y + height / 2
        draw.rectangle([bar_x, mid - 7, bar_x + bar_len, mid + 7], outline=(120, 120, 120))
        if f > 0:
            draw.rectangle([bar_x, mid - 7, bar_x + bar_len * f, mid + 7], fill=SOFTMAX_RGB,
                           outline="black")
        draw.text((bar_x + bar_len + 6, mid), f"{f:.2f}", fill="black", font=font,
                  anchor="lm")
        y += height + gap
    # x axis in token positions: chunk c starts at token c * chunk_size.
    tokens = n_chunks * chunk_size
    ticks = [t for t in nice_ticks(0, tokens) if t <= tokens]
    axes = Axes((left, top, left + grid_w, top + grid_h), [0, tokens], [0, 1])
    for t in ticks:
        u, _ = axes.px(t, 0)
        draw.line([u, top + grid_h, u, top + grid_h + 5], fill="black")
        draw.text((u, top + grid_h + 8), f"{t:g}", fill="black", font=font, anchor="mt")
    draw.text((left + grid_w / 2, top + grid_h + 28),
              f"token position ({n_chunks} chunks of {chunk_size} tokens)", fill="black",
              font=font, anchor="mt")
    vertical_text(img, "layer / routing head", (14, top + grid_h / 2), font)
    draw_legend(img, items, (left, top + grid_h + 52), font)
    return img
