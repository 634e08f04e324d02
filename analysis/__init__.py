"""Analysis of what a search found: routing maps of the chunks' routes, the measured
softmax fraction of each layer, and what an architecture costs given those fractions."""

from .cost_model import (
    ArchitectureCost,
    LayerCost,
    architecture_cost,
    compare_costs,
    cost_curve,
    fractions_from_measurement,
)
from .routing_maps import routing_map, routing_map_image
from .softmax_fraction import LayerFraction, measure_softmax_fraction

__all__ = ["ArchitectureCost", "LayerCost", "LayerFraction", "architecture_cost", "compare_costs",
           "cost_curve", "fractions_from_measurement", "measure_softmax_fraction", "routing_map",
           "routing_map_image"]
