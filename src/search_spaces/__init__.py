"""Search spaces over chunk sizes and layer mixes, and the search that runs them
(Ray Tune drives the trials, Optuna picks them): see docs/SEARCH.md."""

from .builtin import BUILTIN_SPACES, DEFAULT_SPACE, search_base
from .objectives import COSTS, OBJECTIVES, QUALITY, cost_metrics
from .spaces import DefineByRun, Dim, LayerMix, SearchSpace, SpaceError, load_space, space_from_dict

__all__ = [
    "BUILTIN_SPACES",
    "COSTS",
    "DEFAULT_SPACE",
    "OBJECTIVES",
    "QUALITY",
    "DefineByRun",
    "Dim",
    "LayerMix",
    "SearchSpace",
    "SpaceError",
    "cost_metrics",
    "load_space",
    "search_base",
    "space_from_dict",
]
