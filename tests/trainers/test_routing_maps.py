"""Routing maps against hand-drawn expectations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nats.trainers.routing_maps import LINEAR_RGB, SOFTMAX_RGB, routing_map, routing_map_image

from ..routes import routes_from_choices


def test_map_is_sequence_major_heads_by_chunks() -> None:
    routes = routes_from_choices([[[1, 0], [0, 0], [1, 1]],      # sequence 0: chunks x heads
                      [[0, 1], [1, 0], [0, 0]]])     # sequence 1
    expected = torch.tensor([[1, 0, 1],              # sequence 0, head 0: chunks 0..2
                             [0, 0, 1],              # sequence 0, head 1
                             [0, 1, 0],              # sequence 1, head 0
                             [1, 0, 0]], dtype=torch.bool)
    assert torch.equal(routing_map(routes), expected)


def test_image_upscales_each_cell_by_nearest_neighbour() -> None:
    routes = routes_from_choices([[[1, 0]], [[0, 1]]])  # one chunk, 2 sequences x 2 heads
    image = routing_map_image(routes, min_size=3)
    assert image.dtype == np.uint8 and image.shape == (12, 3, 3)
    cells = [image[3 * c: 3 * c + 3].reshape(-1, 3) for c in range(4)]
    for cell, colour in zip(cells, [SOFTMAX_RGB, LINEAR_RGB, LINEAR_RGB, SOFTMAX_RGB],
                            strict=True):
        assert (cell == np.array(colour)).all()


def test_long_maps_stop_growing_at_max_size() -> None:
    routes = routes_from_choices([[[1]] * 300])  # 300 chunks, one head: a 1 x 300 grid
    assert routing_map_image(routes, min_size=256, max_size=2048).shape == (6, 1800, 3)
    assert routing_map_image(routes, min_size=256, max_size=100).shape == (1, 300, 3)


def test_rejects_non_route_tensors() -> None:
    with pytest.raises(ValueError, match=r"\[B, N, H, 2\]"):
        routing_map(torch.zeros(2, 3, 4))
