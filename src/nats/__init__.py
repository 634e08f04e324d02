"""NAtS-L: neural architecture search for token-level hybrid attention.

``NatsConfig`` describes a model, ``NatsForCausalLM`` builds it; the operators live in
``nats.kernels``, training in ``nats.trainers``, searches in ``nats.search_spaces`` and
routing analysis in ``nats.analysis``.
"""

from .cache import HybridCache
from .config import LAYER_TYPES, SAMPLERS, ConfigError, NatsConfig
from .generation import generate
from .layers.nats_attention import LayerRouting, NatsAttention
from .model import CausalLMOutput, NatsForCausalLM

__all__ = [
    "LAYER_TYPES",
    "SAMPLERS",
    "CausalLMOutput",
    "ConfigError",
    "HybridCache",
    "LayerRouting",
    "NatsAttention",
    "NatsConfig",
    "NatsForCausalLM",
    "generate",
]
__version__ = "0.1.0"
