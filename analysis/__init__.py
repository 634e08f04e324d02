"""Analysis of what a search found; for now, routing maps of the chunks' routes."""

from .routing_maps import routing_map, routing_map_image

__all__ = ["routing_map", "routing_map_image"]
