"""Evaluation of trained models on task slices (``nats eval``): recall, retrieval and bits
per byte, with the softmax fraction, speed, memory and cost of each slice."""

from .harness import COST_CONTEXTS, length_label, prefill_seconds, run_eval
from .slices import slice_configs, slice_name

__all__ = ["COST_CONTEXTS", "length_label", "prefill_seconds", "run_eval", "slice_configs",
           "slice_name"]
