"""Search spaces: what a search may change in a base :class:`TrainConfig`, declared in YAML.

A space is a mapping, checked on load (a bad key or value raises :class:`SpaceError`, a
``ValueError`` with one line naming the key and what it may be)::

    name: my-space                     # optional; the file name otherwise
    description: chunk size and layer mix
    params:
      chunk_size: [16, 32, 64]         # a list: one of these values
      n_layers: [2, 3, 4]              # depth (the per-layer choices follow it)
      layers: {choices: [nats, gdn, softmax]}        # every layer picks its type ...
      # layers: {every: [1, 2], kind: nats, other: [gdn, softmax]}   # ... or a pattern
      softmax_heads_per_head: [1, 2, 4]
      linear_op: [gated_deltanet, gated_linear_attention]   # the linear operator
      softmax_target: [0.125, 0.25, 0.5]  # NAtS-L layers' softmax budget (null: none)
      branch_norm: [both, linear, scaled]  # how NAtS-L layers scale their branch outputs
      softmax_qkv: [shared, own]       # the softmax branch's q/k/v: shared or its own
      scorer_pool: [mean, max]         # what the scorer reads of a chunk: mean, max, mean_max
      softmax_gain_init: [null, 0.05]  # no learned softmax gain, or one started at 0.05
      budget_anneal: [0.0, 0.3]        # the budget's target falls from 1 over this share
      reg_lambda: {low: 0.001, high: 0.3, log: true}  # a range: float, or int if both are
      lr: {low: 0.001, high: 0.01, log: true}
      d_model: 64                      # a single value: fixed for every trial

Sampling is define-by-run (:meth:`SearchSpace.sample`): it asks an ``optuna.Trial`` for
each dimension in order, so a per-layer choice ``layer{i}`` only exists for ``i <
n_layers`` (a conditional dimension), and returns the trial's :class:`TrainConfig`.
Replaying a trial's parameters through ``optuna.trial.FixedTrial`` gives the same config,
which is how a Tune trial rebuilds it from the parameters Optuna chose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.config import (
    BRANCH_NORMS,
    LAYER_TYPES,
    SCORER_POOLS,
    SOFTMAX_QKVS,
    ConfigError,
    canonical_layer_type,
    whole_at_least,
)
from nats.kernels.linear_ops import LINEAR_OP_SPECS
from nats.kernels.reference.chunks import CHUNK_SIZES
from nats.trainers import TrainConfig


class SpaceError(ValueError):
    """A search space is malformed; the message is one line naming the key."""


MODEL_PARAMS = ("chunk_size", "n_layers", "d_model", "n_heads", "softmax_heads_per_head",
                "linear_op", "reg_lambda", "softmax_target", "branch_norm", "softmax_gain_init",
                "softmax_qkv", "scorer_pool")
"""``params`` keys that set a ``NatsConfig`` field."""
TRAIN_PARAMS = ("lr", "weight_decay", "warmup_steps", "batch_size", "steps", "budget_anneal")
"""``params`` keys that set a ``TrainConfig`` field."""
PARAMS = (*MODEL_PARAMS, "layers", *TRAIN_PARAMS)
TOP_KEYS = ("name", "description", "params")
LAYER_KEYS_CHOICES = ("choices",)
LAYER_KEYS_PATTERN = ("every", "kind", "other")
INT_PARAMS = ("n_layers", "d_model", "n_heads", "softmax_heads_per_head", "warmup_steps",
              "batch_size", "steps")
"""Positive integers (``warmup_steps`` may be 0)."""
FLOAT_PARAMS = ("reg_lambda", "lr", "weight_decay", "softmax_target", "softmax_gain_init",
                "budget_anneal")
NULLABLE_PARAMS = ("softmax_target", "softmax_gain_init")
"""Keys whose list of choices may hold ``null`` (the field's "none": no budget, only
``reg_lambda`` pricing softmax; no gain)."""
ROUTING_PARAMS = ("chunk_size", "reg_lambda", "softmax_target", "branch_norm",
                  "softmax_gain_init", "softmax_qkv", "scorer_pool", "budget_anneal")
"""Keys that only NAtS-L layers read: a trial without one is not asked for them (Optuna
would otherwise credit them with differences they cannot cause, and a trial differing
only in them would train the same model again). ``budget_anneal`` is asked only under a
budget (``softmax_target`` not null), the only place the trainer reads it."""
CHOICE_PARAMS = {"chunk_size": ("chunk sizes", CHUNK_SIZES),
                 "linear_op": ("operators", LINEAR_OP_SPECS.keys()),
                 "branch_norm": ("branch norms", BRANCH_NORMS),
                 "softmax_qkv": ("softmax q/k/v sources", SOFTMAX_QKVS),
                 "scorer_pool": ("scorer pools", SCORER_POOLS)}
"""Keys whose values come from a set: a list of them, never a range (the operators: those
registered when the space is checked)."""


@dataclass(frozen=True)
class Dim:
    """One dimension: ``choices`` (categorical; one choice means fixed) or a range."""

    name: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False

    def suggest(self, trial: Any) -> Any:
        if self.choices is not None:
            if len(self.choices) == 1:
                return self.choices[0]
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)

    def describe(self) -> str:
        if self.choices is not None:  # null as the YAML spells it
            return " | ".join("null" if c is None else str(c) for c in self.choices)
        return f"{self.low} .. {self.high}{' (log)' if self.log else ''}"


@dataclass(frozen=True)
class LayerMix:
    """How layer types are chosen: per layer from ``choices``, or every ``every``-th layer
    is ``kind`` and the others one type from ``other``."""

    choices: tuple[str, ...] = ()
    every: Dim | None = None
    kind: str = "nats"
    other: Dim | None = None

    def suggest(self, trial: Any, n_layers: int) -> tuple[str, ...]:
        if self.every is None:
            dim = Dim("", tuple(self.choices))
            return tuple(Dim(f"layer{i}", dim.choices).suggest(trial) for i in range(n_layers))
        every = self.every.suggest(trial)
        other = self.other.suggest(trial) if self.other is not None else "linear"
        return tuple(self.kind if (i + 1) % every == 0 else other for i in range(n_layers))

    def describe(self) -> str:
        if self.every is None:
            return f"each layer: {' | '.join(self.choices)}"
        other = self.other.describe() if self.other is not None else "linear"
        return f"every ({self.every.describe()})-th layer {self.kind}, the others {other}"


@dataclass(frozen=True)
class SearchSpace:
    """A validated space; ``sample(trial, base)`` is the define-by-run function."""

    name: str
    description: str = ""
    dims: tuple[Dim, ...] = ()
    layers: LayerMix | None = None
    source: dict[str, Any] = field(default_factory=dict)
    """The mapping the space was loaded from (written beside a search's results)."""

    def dim(self, name: str) -> Dim | None:
        return next((d for d in self.dims if d.name == name), None)

    def sample(self, trial: Any, base: TrainConfig) -> TrainConfig:
        """The trial's config: ``base`` with every dimension suggested by ``trial``, the
        layer types first: :data:`ROUTING_PARAMS` are suggested only for a model with a
        NAtS-L layer (a conditional space; the others keep ``base``'s values)."""
        model_changes: dict[str, Any] = {}
        train_changes: dict[str, Any] = {}
        depth = self.dim("n_layers")
        n_layers = depth.suggest(trial) if depth is not None else base.model.n_layers
        model_changes["n_layers"] = n_layers
        types = base.model.layer_types
        if self.layers is not None:
            types = self.layers.suggest(trial, n_layers)
        elif n_layers != base.model.n_layers:
            # Depth without a layer mix: repeat the base's pattern, cut or extended.
            types = tuple(types[i % len(types)] for i in range(n_layers))
        model_changes["layer_types"] = types
        # The budget's annealing last: whether it is asked depends on the budget drawn.
        for dim in sorted(self.dims, key=lambda d: d.name == "budget_anneal"):
            target = model_changes.get("softmax_target", base.model.softmax_target)
            if dim.name == "n_layers" or not _asked(dim.name, types, target):
                continue
            value = dim.suggest(trial)
            (model_changes if dim.name in MODEL_PARAMS else train_changes)[dim.name] = value
        return base.replace(model=base.model.replace(**model_changes), **train_changes)

    def baseline_points(self, base: TrainConfig) -> list[dict[str, Any]]:
        """The uniform stacks this space can draw, as Optuna parameters: every layer
        softmax, every layer Gated DeltaNet, and every layer NAtS-L with the base's own
        routing settings. Trained first, they measure what a mix must beat; the NAtS-L one
        is the method as the base configures it, which the sampler might otherwise never
        draw in a short search (a per-layer mix at a fixed depth only; parameters not
        named are sampled). The NAtS-L stack is left out when a routing parameter of the
        space cannot take the base's value."""
        mix = self.layers
        if mix is None or mix.every is not None or self.dim("n_layers") is not None:
            return []
        n = base.model.n_layers
        points: list[dict[str, Any]] = [
            {f"layer{i}": kind for i in range(n)} for pure in ("softmax", "linear")
            for kind in mix.choices if canonical_layer_type(kind, warn=False) == pure]
        routing = [d for d in self.dims if d.name in ROUTING_PARAMS
                   and _asked(d.name, ("nats",), base.model.softmax_target)]
        if "nats" in mix.choices and all(_admits(d, _base_value(base, d.name))
                                         for d in routing):
            asked = [d.name for d in routing if d.choices is None or len(d.choices) > 1]
            points.append({**{f"layer{i}": "nats" for i in range(n)},
                           **{name: _base_value(base, name) for name in asked}})
        return points

    def describe(self) -> list[str]:
        lines = [f"{d.name}: {d.describe()}" for d in self.dims]
        if self.layers is not None:
            lines.append(f"layers: {self.layers.describe()}")
        return lines


@dataclass(frozen=True)
class DefineByRun:
    """``OptunaSearch``'s define-by-run function: suggests every dimension of ``space`` for
    ``base`` and returns nothing, so a Tune trial receives exactly the suggested parameters
    (rebuild its config with ``space.sample(optuna.trial.FixedTrial(params), base)``)."""

    space: SearchSpace
    base: TrainConfig

    def __call__(self, trial: Any) -> None:
        self.space.sample(trial, self.base)


def _asked(name: str, layer_types: tuple[str, ...], softmax_target: float | None) -> bool:
    """Whether a model of these layers and budget reads ``params`` key ``name``: the
    :data:`ROUTING_PARAMS` only with a NAtS-L layer, ``budget_anneal`` only under a budget."""
    if name in ROUTING_PARAMS and "nats" not in layer_types:
        return False
    return name != "budget_anneal" or softmax_target is not None


def _base_value(base: TrainConfig, name: str) -> Any:
    """What ``base`` sets for ``params`` key ``name`` (a train or a model field)."""
    return getattr(base, name) if name in TRAIN_PARAMS else getattr(base.model, name)


def _admits(dim: Dim, value: Any) -> bool:
    """Whether ``dim`` can suggest ``value`` (``None`` only from a list that holds it)."""
    if dim.choices is not None:
        return value in dim.choices
    if value is None:
        return False
    return float(dim.low) <= value <= float(dim.high)


def _err(where: str, key: str, value: Any, allowed: str) -> SpaceError:
    return SpaceError(f"{where}: {key} = {value!r} is invalid: must be {allowed}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _choices(key: str) -> tuple[str, tuple[Any, ...]]:
    """What the values of choice key ``key`` are called, and those allowed now."""
    what, allowed = CHOICE_PARAMS[key]
    return what, tuple(allowed)


def _check_value(where: str, key: str, value: Any, bound: bool = False) -> None:
    """One value of ``params.<key>`` (``bound``: of a range, where ``null`` is no value);
    raises naming the key and what it may be."""
    nullable = key in NULLABLE_PARAMS and not bound
    if value is None and nullable:
        return
    if key in CHOICE_PARAMS:
        what, allowed = _choices(key)
        if isinstance(value, bool) or value not in allowed:
            raise _err(where, f"params.{key}", value, f"{what} from {allowed}")
    elif key in INT_PARAMS:
        least = 0 if key == "warmup_steps" else 1
        if not whole_at_least(value, least):
            raise _err(where, f"params.{key}", value, f"integers >= {least}")
    elif key == "softmax_target":
        if not _number(value) or not 0 < value < 1:
            raise _err(where, f"params.{key}", value,
                       f"numbers in (0, 1){' or null' if nullable else ''}")
    elif key == "budget_anneal":
        if not _number(value) or not 0 <= value <= 1:
            raise _err(where, f"params.{key}", value, "numbers in [0, 1]")
    elif key in FLOAT_PARAMS:
        least_ok = (lambda v: v >= 0) if key in ("reg_lambda", "weight_decay") else (
            lambda v: v > 0)
        if not _number(value) or not least_ok(value):
            least = ">= 0" if key in ("reg_lambda", "weight_decay") else "> 0"
            raise _err(where, f"params.{key}", value,
                       f"finite numbers {least}{' or null' if nullable else ''}")


def _dim(where: str, key: str, spec: Any) -> Dim:
    if isinstance(spec, list):
        if not spec:
            raise _err(where, f"params.{key}", spec, "a non-empty list of choices")
        for v in spec:
            _check_value(where, key, v)
        if len(set(spec)) != len(spec):
            raise _err(where, f"params.{key}", spec, "a list without repeated choices")
        return Dim(key, tuple(spec))
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"low", "high", "log"})
        if unknown or "low" not in spec or "high" not in spec:
            raise _err(where, f"params.{key}", dict(spec),
                       "a range {low: X, high: Y, log: true|false}")
        low, high, log = spec["low"], spec["high"], spec.get("log", False)
        if key in CHOICE_PARAMS:
            what, allowed = _choices(key)
            raise _err(where, f"params.{key}", dict(spec),
                       f"a list of {what} from {allowed}, not a range")
        for v in (low, high):
            _check_value(where, key, v, bound=True)
        if not low < high:
            raise _err(where, f"params.{key}", dict(spec), "a range with low < high")
        if not isinstance(log, bool):
            raise _err(where, f"params.{key}.log", log, "true or false")
        if log and low <= 0:
            raise _err(where, f"params.{key}.low", low, "> 0 for a log range")
        integer = key in INT_PARAMS
        return Dim(key, None, low, high, log, integer)
    _check_value(where, key, spec)
    return Dim(key, (spec,))


def _layer_types(where: str, key: str, values: Any) -> tuple[str, ...]:
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, list) or not values or any(not _is_layer_type(v) for v in values):
        raise _err(where, key, values, f"a non-empty list from {LAYER_TYPES}")
    if len({canonical_layer_type(v, warn=False) for v in values}) != len(values):
        raise _err(where, key, values, "a list without repeated layer types")
    # Kept as written: a search folder's saved space must give its study the same choices.
    return tuple(values)


def _is_layer_type(value: Any) -> bool:
    """A current layer type or an old spelling of one (``LAYER_TYPE_ALIASES``)."""
    return isinstance(value, str) and canonical_layer_type(value, warn=False) in LAYER_TYPES


def _layers(where: str, spec: Any) -> LayerMix:
    allowed = ("{choices: [types]} or {every: [k, ...], kind: TYPE, other: [types]} with "
               f"types from {LAYER_TYPES}")
    if not isinstance(spec, Mapping):
        raise _err(where, "params.layers", spec, allowed)
    keys = set(spec)
    if keys <= set(LAYER_KEYS_CHOICES) and keys:
        return LayerMix(choices=_layer_types(where, "params.layers.choices", spec["choices"]))
    if "every" in keys and keys <= set(LAYER_KEYS_PATTERN):
        every = spec["every"]
        every_list = every if isinstance(every, list) else [every]
        if not every_list or any(not whole_at_least(k)
                                 for k in every_list):
            raise _err(where, "params.layers.every", every, "integers >= 1 (or a list of them)")
        kind = spec.get("kind", "nats")
        if not _is_layer_type(kind):
            raise _err(where, "params.layers.kind", kind, f"one of {LAYER_TYPES}")
        other = _layer_types(where, "params.layers.other", spec.get("other", ["linear"]))
        return LayerMix(every=Dim("every", tuple(every_list)), kind=kind,
                        other=Dim("other_layers", other))
    raise _err(where, "params.layers", dict(spec), allowed)


def space_from_dict(data: Any, where: str = "space", default_name: str = "custom") -> SearchSpace:
    """Validate a space mapping (as read from YAML) and build the :class:`SearchSpace`."""
    if not isinstance(data, Mapping):
        raise SpaceError(f"{where}: must be a mapping with keys {list(TOP_KEYS)}, "
                         f"got {type(data).__name__}")
    unknown = sorted(str(k) for k in set(data) - set(TOP_KEYS))
    if unknown:
        raise SpaceError(f"{where}: unknown key(s) {unknown}: allowed keys are {list(TOP_KEYS)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise _err(where, "name", name, "a non-empty string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _err(where, "description", description, "a string")
    params = data.get("params")
    if not isinstance(params, Mapping) or not params:
        raise _err(where, "params", params, f"a non-empty mapping with keys from {list(PARAMS)}")
    unknown = sorted(str(k) for k in set(params) - set(PARAMS))
    if unknown:
        raise SpaceError(f"{where}: unknown params key(s) {unknown}: allowed keys are "
                         f"{list(PARAMS)}")
    dims = tuple(_dim(where, key, params[key]) for key in PARAMS
                 if key in params and key != "layers")
    layers = _layers(where, params["layers"]) if "layers" in params else None
    return SearchSpace(name=name, description=description, dims=dims, layers=layers,
                       source={k: data[k] for k in TOP_KEYS if k in data})


def load_space(name_or_path: str | Path) -> SearchSpace:
    """A built-in space by name (see :data:`BUILTIN_SPACES`) or a YAML/JSON file."""
    from .builtin import BUILTIN_SPACES

    key = str(name_or_path)
    if key in BUILTIN_SPACES:
        return space_from_dict(BUILTIN_SPACES[key], where=f"space {key!r}", default_name=key)
    path = Path(key)
    if not path.is_file():
        raise SpaceError(f"--space {key!r} is neither a built-in space ("
                         f"{', '.join(BUILTIN_SPACES)}) nor a file")
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = " ".join(str(e).split())
        raise SpaceError(f"space file {path}: not valid YAML ({first})") from None
    return space_from_dict(data, where=f"space file {path}", default_name=path.stem)


def check_space_fits(space: SearchSpace, base: TrainConfig, samples: int = 32,
                     seed: int = 0) -> None:
    """Sample the space against ``base`` and fail early if a sample is not a valid config
    (e.g. a softmax head count that does not divide the head width)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(samples):
        trial = study.ask()
        try:
            space.sample(trial, base)
        except ConfigError as e:
            raise SpaceError(f"space {space.name!r} does not fit the base config: trial "
                             f"{trial.params} gives {e}") from None
        study.tell(trial, 0.0)
