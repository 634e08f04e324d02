"""Analysis of what a search found: routing maps of the chunks' routes, and the measured
softmax fraction of each layer."""

from .routing_maps import routing_map, routing_map_image
from .softmax_fraction import LayerFraction, measure_softmax_fraction

__all__ = ["LayerFraction", "measure_softmax_fraction", "routing_map", "routing_map_image"]
