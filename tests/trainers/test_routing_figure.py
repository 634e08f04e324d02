"""The annotated routing map against hand-placed cells, and the shared cell painter."""

from __future__ import annotations

import numpy as np
import pytest

from nats.trainers.routing_maps import (
    GRID_LEFT,
    GRID_TOP,
    LINEAR_RGB,
    PLAIN_RGB,
    ROW_GAP,
    ROW_HEIGHT,
    SOFTMAX_RGB,
    paint_cells,
    routing_figure,
)

from ..routes import routes_from_choices


def test_cells_sit_where_the_layout_puts_them() -> None:
    # Layer 0: 2 heads x 3 chunks; layer 1: plain softmax; layer 2: 1 head.
    layer0 = routes_from_choices([[[1, 0], [0, 0], [1, 1]],
                      [[0, 0], [0, 0], [0, 0]]])   # sequence 1 is not drawn
    layer2 = routes_from_choices([[[0], [1], [0]], [[1], [1], [1]]])
    img = np.asarray(routing_figure([layer0, None, layer2], ["nats", "softmax", "nats"],
                                    chunk_size=4, seq_len=12, sequence=0, cell_width=10))
    expected = {0: [[1, 0, 1], [0, 0, 1]], 2: [[0, 1, 0]]}   # rows = heads, columns = chunks
    y = GRID_TOP
    for layer, heads in ((0, 2), (1, 1), (2, 1)):
        for h in range(heads):
            for c in range(3):
                pixel = img[y + h * ROW_HEIGHT + ROW_HEIGHT // 2, GRID_LEFT + c * 10 + 5]
                if layer == 1:
                    colour = PLAIN_RGB["softmax"]
                else:
                    colour = SOFTMAX_RGB if expected[layer][h][c] else LINEAR_RGB
                assert tuple(pixel) == colour, (layer, h, c)
        y += heads * ROW_HEIGHT + ROW_GAP


def test_fraction_bars_follow_this_input() -> None:
    # Layer 0: head 0 softmax on chunk 0 only, head 1 never: 4 of 2 x 10 tokens (0.2).
    routes = routes_from_choices([[[1, 0], [0, 0], [0, 0]]])
    fig = routing_figure([routes], ["nats"], chunk_size=4, seq_len=10, cell_width=10)
    text_free = np.asarray(fig)[GRID_TOP + ROW_HEIGHT]  # the bar's row: middle of the layer
    bar = np.where((text_free == SOFTMAX_RGB).all(-1))[0]
    bar = bar[bar > GRID_LEFT + 3 * 10]  # right of the grid
    from nats.trainers.routing_maps import BAR_WIDTH

    assert len(bar) == pytest.approx(0.2 * BAR_WIDTH, abs=2)


def test_paint_cells_is_nearest_neighbour() -> None:
    grid = np.array([[True, False]])
    out = paint_cells(grid, cell_w=3, cell_h=2)
    assert out.shape == (2, 6, 3)
    assert (out[:, :3] == SOFTMAX_RGB).all() and (out[:, 3:] == LINEAR_RGB).all()


def test_layer_count_must_match() -> None:
    with pytest.raises(ValueError, match="layer types"):
        routing_figure([None], ["softmax", "linear"], chunk_size=4, seq_len=8)
