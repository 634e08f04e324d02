"""`NatsConfig`: the one typed, validated description of a model.

Every field is checked at construction so that a bad value fails at once with a
message naming the field and what it may be, long before a shape error deep inside
a forward pass.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, NoReturn

from nats.kernels.linear_ops import LINEAR_OP_SPECS
from nats.kernels.reference.chunks import CHUNK_SIZES, ROUTE_GRADS

LAYER_TYPES = ("nats", "linear", "softmax")
"""A "linear" layer is the plain linear-attention layer; its operator is ``linear_op``."""
LAYER_TYPE_ALIASES = {"gdn": "linear"}
"""Old spellings a config may still use (deprecated): "gdn" named the plain linear layer
while Gated DeltaNet was its only operator. Configs turn them into the current name."""
LINEAR_OPS = tuple(LINEAR_OP_SPECS)
"""The built-in operators of the linear branch of NAtS-L layers and of plain linear layers;
``linear_op`` accepts any registered one (``nats.kernels.linear_ops``)."""
SAMPLERS = ("argmax", "gumbel")
OUTPUT_GATES = ("silu", "none")
"""``silu``: the output is multiplied by ``SiLU(W_g x)`` (fla, the official NAtS-L layer);
``none``: no output gate (Zoology's MQAR recipe for Gated DeltaNet)."""
BRANCH_NORMS = ("both", "linear", "scaled", "none")
"""Which branch outputs a NAtS-L layer RMS-normalises before merging them: ``both`` (the
official layer), ``linear`` (only the linear branch, as Gated DeltaNet normalises its own
output; the softmax output keeps its magnitude, as a transformer's does), ``scaled`` (the
linear branch per token; the softmax branch divided by its running RMS per head, one
number per head: its per-token magnitude is kept, at the linear branch's scale), ``none``."""
SOFTMAX_QKVS = ("shared", "own")
"""Where a NAtS-L layer's softmax heads read q, k and v: the projection the linear branch
reads (``shared``, the official layer), or one of their own (``own``)."""
SCORER_POOLS = ("mean", "max", "mean_max")
"""How the scorer summarises a chunk: the mean of the layer's normalised input over it (the
official layer), its maximum per feature, or both side by side (twice the scorer's
input). A mean weighs a few informative tokens by their count, so a needle cut by a chunk
boundary is a fragment in each chunk; a maximum sees one token as well as ten."""
SCORER_INITS = ("normal", "zero")
"""``normal``: the scorer's weight drawn like every other (the official layer); ``zero``:
every chunk starts undecided, so no early content-blind preference is baked in."""
BUDGET_SCOPES = ("layer", "model")
"""What ``softmax_target`` holds to: each NAtS-L layer's softmax fraction, or their mean."""
LAYER_LISTS = {"softmax_layers": "softmax", "linear_layers": "linear", "hybrid_layers": "nats"}
"""Keys of the layer-index lists that ``to_dict`` derives from ``layer_types``, so that a
reader that knows no NAtS-L finds the softmax layers as a plain list of indices."""
HF_KEYS: dict[str, Any] = {"model_type": "nats", "architectures": ["NatsHFForCausalLM"]}
"""What ``NatsForCausalLM.save_pretrained`` adds to ``config.json`` so that ``transformers``'
Auto classes find the model (``nats.hf``); ``from_dict`` checks the type and drops both."""


def canonical_layer_type(kind: Any, warn: bool = True) -> Any:
    """``kind`` under its current name (``LAYER_TYPE_ALIASES``; with ``warn`` a
    DeprecationWarning says so); anything else unchanged, for the caller's check to refuse."""
    if isinstance(kind, str) and kind in LAYER_TYPE_ALIASES:
        if warn:
            warnings.warn(f"layer type {kind!r} is deprecated: use "
                          f"{LAYER_TYPE_ALIASES[kind]!r}", DeprecationWarning, stacklevel=3)
        return LAYER_TYPE_ALIASES[kind]
    return kind


class ConfigError(ValueError):
    """A configuration value is outside what the field allows."""


@dataclass(frozen=True)
class NatsConfig:
    """Architecture of a NAtS-L language model (or of its plain baselines).

    ``n_heads`` routing heads each own one linear head of width ``head_dim_k`` /
    ``head_dim_v`` and ``softmax_heads_per_head`` softmax heads that split those
    channels (NATSL.md). ``layer_types`` gives each layer's mixer; ``linear_op`` the
    linear-attention operator of every NAtS-L linear branch and every "linear" layer.
    """

    vocab_size: int = 256
    """Tokens of the embedding and the output head."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Layers (``layer_types`` has one entry per layer)."""
    n_heads: int = 2
    """Routing heads per NAtS-L layer: each owns one linear head."""
    softmax_heads_per_head: int = 2
    """Softmax heads per routing head; they split its channels."""
    head_dim_k: int = 64
    """Key (and query) width of a linear head."""
    head_dim_v: int = 64
    """Value width of a linear head."""
    chunk_size: int = 32
    """Tokens per routing chunk (``CHUNK_SIZES``)."""
    layer_types: tuple[str, ...] = ("nats", "nats")
    """Each layer's mixer: ``nats``, ``linear`` (the operator ``linear_op``) or ``softmax``."""
    sampler: str = "argmax"
    """How logits become routes in training: ``argmax`` or hard ``gumbel``."""
    gumbel_tau: float = 1.0
    """Temperature of the ``gumbel`` sampler."""
    reg_lambda: float = 0.0
    """Weight of the routing cost term (the softmax share) in the loss."""
    route_grad: str = "both"
    """Route gradient of the straight-through estimator: ``both`` (each chunk compares the
    two options, so a chunk sent to linear can learn that softmax would have helped; the
    softmax backward then scores every earlier chunk, about the cost of full attention's
    backward) or ``selected`` (the official layer's: only the chosen option's, and routes
    only ratchet one way; with it, concentrated recall was not learned, docs/RESULTS.md)."""
    scorer_norm: bool = True
    """Centre and scale the pooled chunk input per feature by running statistics over
    chunks before the scorer, so its logits compare chunks rather than move with what they
    all share (see ``ChunkScorer``)."""
    scorer_pool: str = "max"
    """The scorer's input per chunk: ``mean``, ``max`` or ``mean_max`` (``SCORER_POOLS``).
    A mean weighs a few informative tokens by their count: with it a routed model sent only
    the larger part of a needle cut by a chunk boundary to softmax, and at GPU scale one
    seed of three failed concentrated recall that the max learned on all three; the LM is
    level (docs/RESULTS.md, "The max pool at GPU scale"). The official layer's is the mean."""
    scorer_init: str = "zero"
    """``zero``: every chunk starts undecided; ``normal``: drawn like every weight."""
    scorer_detach: bool = True
    """The scorer reads the layer's input without sending gradients back into it: the route
    gradient trains the scorer alone. Sent back (the official layer's way), the
    straight-through route gradient also reshapes the residual stream: a 2-layer model
    learned concentrated MQAR (accuracy over 0.5) in 1 of 5 seeds instead of 4 of 5
    (docs/RESULTS.md, CPU)."""
    softmax_target: float | None = 0.25
    """A budget: the share of routable chunks (all but a sequence's last, whose route no
    query sees) to send to softmax, on average over the training data (a content-based
    router sends more where more chunks matter). The scorer's scores are standardised and a
    per-layer bias, moved by the trainer toward the target, sets the threshold, so the
    scorer only ranks chunks (``BudgetedScores``). ``None``: no budget, routes are free
    (then ``reg_lambda`` is the only price of softmax)."""
    budget_scope: str = "layer"
    """What ``softmax_target`` holds: each NAtS-L layer's share (``layer``) or their mean
    (``model``)."""
    output_gate: str = "none"
    """``none`` or ``silu`` (the output multiplied by ``SiLU(W_g x)``, as fla and the
    official layer)."""
    branch_norm: str = "both"
    """Which branch outputs the merge RMS-normalises: ``both`` (the official layer),
    ``linear``, ``scaled`` or ``none`` (``BRANCH_NORMS``). A per-token norm of the softmax
    output (``both``) makes a head that found nothing as loud as one that found the needle;
    none (``linear``) leaves the softmax output far below the normalised linear one at
    initialisation, and recall of a few chunks is then not learned; ``scaled`` keeps the
    magnitude at a matched scale (docs/RESULTS.md)."""
    softmax_gain_init: float | None = None
    """A learned gain per softmax head on its output in the merge, started at this value;
    ``None``: no gain. With ``branch_norm="scaled"`` a small start (0.05) puts the softmax
    branch as far below the linear one as ``linear`` does at initialisation, while the
    gain, one parameter a head, can grow as fast as the optimizer moves it
    (docs/RESULTS.md)."""
    softmax_qkv: str = "shared"
    """Where the NAtS-L softmax branch's q, k and v come from: ``shared`` with the linear
    branch (one projection, the official layer's) or its ``own`` projection and short
    convolution (``SOFTMAX_QKVS``). Shared, the linear branch's gradient also trains the
    softmax branch's inputs and held it on the needle's plateau; own, a routed model
    retrieved the needle on 4 of 6 seeds instead of 0, but small-scale recall, which the
    softmax branch's gradient into the shared inputs teaches, was learned on none of 5
    instead of 3 (docs/RESULTS.md). Own costs ``d_model * (2 head_dim_k + head_dim_v) *
    n_heads`` more weights a layer."""
    branch_gamma: bool = False
    """A separate per-channel weight for each branch in the merge (``w_LA N(o_LA) gamma +
    w_SM N(o_SM) gamma_SM``) instead of one after the sum: the official layer's gated
    norm (``FusedMultiInputRMSNormGated``), so that its checkpoints convert exactly
    (``nats.official``). No Triton kernel: the merge runs the PyTorch reference."""
    mlp_ratio: float = 4.0
    """Hidden width of the MLP as a multiple of ``d_model``."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    conv_size: int = 4
    """Kernel of the causal short convolution on q, k and v."""
    rope: bool = False
    """Rotary embedding on the softmax heads' q and k."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding."""
    tie_embeddings: bool = True
    """The output head shares the embedding's weight."""
    initializer_range: float = 0.02
    """Standard deviation of the initial weights."""
    backend: str = "auto"
    """Operator implementation: ``auto`` (Triton on CUDA, else the PyTorch reference),
    ``triton`` or ``reference``."""
    linear_op: str = "gated_deltanet"
    """The linear-attention operator of NAtS-L linear branches and ``linear`` layers
    (``LINEAR_OPS``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.layer_types, (list, tuple)):
            _fail("layer_types", self.layer_types,
                  f"a list of n_layers={self.n_layers} entries from {LAYER_TYPES}")
        object.__setattr__(self, "layer_types",
                           tuple(canonical_layer_type(k) for k in self.layer_types))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "softmax_heads_per_head",
                     "head_dim_k", "head_dim_v", "conv_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, value, "a positive integer")
        for name in ("gumbel_tau", "mlp_ratio", "norm_eps", "rope_theta", "initializer_range"):
            if not positive_finite(getattr(self, name)):
                _fail(name, getattr(self, name), "a positive finite number")
        gain = self.softmax_gain_init
        if gain is not None and not positive_finite(gain):
            _fail("softmax_gain_init", gain, "null (no gain) or a positive finite number")
        if not nonnegative_finite(self.reg_lambda):
            _fail("reg_lambda", self.reg_lambda, "a finite number >= 0")
        for name in ("rope", "tie_embeddings", "scorer_norm", "scorer_detach", "branch_gamma"):
            if not isinstance(getattr(self, name), bool):  # "false" would switch it on
                _fail(name, getattr(self, name), "true or false")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) \
                or self.chunk_size not in CHUNK_SIZES:
            _fail("chunk_size", self.chunk_size, f"one of {CHUNK_SIZES}")
        for name, allowed in (("sampler", SAMPLERS), ("route_grad", ROUTE_GRADS),
                              ("scorer_init", SCORER_INITS), ("budget_scope", BUDGET_SCOPES),
                              ("output_gate", OUTPUT_GATES), ("branch_norm", BRANCH_NORMS),
                              ("softmax_qkv", SOFTMAX_QKVS), ("scorer_pool", SCORER_POOLS)):
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), f"one of {allowed}")
        target = self.softmax_target
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 < target < 1):
            _fail("softmax_target", target, "null (no budget) or a number in (0, 1)")
        if not isinstance(self.linear_op, str) or self.linear_op not in LINEAR_OP_SPECS:
            _fail("linear_op", self.linear_op, f"one of {tuple(LINEAR_OP_SPECS)}")
        from nats.kernels.ops import BACKENDS

        if self.backend not in BACKENDS:
            _fail("backend", self.backend, f"one of {BACKENDS}")
        if len(self.layer_types) != self.n_layers:
            _fail("layer_types", list(self.layer_types),
                  f"a list of n_layers={self.n_layers} entries from {LAYER_TYPES}")
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                _fail("layer_types", list(self.layer_types), f"entries from {LAYER_TYPES}")
        r = self.softmax_heads_per_head
        for name in ("head_dim_k", "head_dim_v"):
            if getattr(self, name) % r:
                _fail(name, getattr(self, name),
                      f"a multiple of softmax_heads_per_head={r} (softmax heads split it)")
        if self.rope and (self.head_dim_k // r) % 2:
            _fail("rope", self.rope, "False when the softmax head width head_dim_k / "
                  "softmax_heads_per_head is odd (rotary pairs channels)")

    @property
    def softmax_head_dim_k(self) -> int:
        return self.head_dim_k // self.softmax_heads_per_head

    @property
    def softmax_head_dim_v(self) -> int:
        return self.head_dim_v // self.softmax_heads_per_head

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU width, rounded up to a multiple of 8."""
        return 8 * math.ceil(self.mlp_ratio * self.d_model / 8)

    @property
    def linear_op_name(self) -> str:
        """The linear operator as a reader knows it, e.g. "Gated DeltaNet"."""
        return LINEAR_OP_SPECS[self.linear_op].title

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of type ``kind`` ("nats", "linear" or "softmax")."""
        kind = canonical_layer_type(kind)
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    def to_dict(self) -> dict[str, Any]:
        """The fields, plus the layer lists other codebases read (see ``LAYER_LISTS``)."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d.update({key: list(self.layers_of(kind)) for key, kind in LAYER_LISTS.items()})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NatsConfig:
        """Build from a JSON-like dict; unknown keys are an error, not silently dropped.

        The derived layer lists may be present (``to_dict`` writes them) or absent (older
        files), but where present they must agree with ``layer_types``; so may the keys
        ``transformers`` reads (``HF_KEYS``), of model type "nats". Recipe fields
        missing from older files take the official layer's values, which those models had,
        and fields whose default has changed since their ``FORMER_DEFAULTS``.
        """
        model_type = d.get("model_type", HF_KEYS["model_type"])
        if model_type != HF_KEYS["model_type"]:
            _fail("model_type", model_type, f"{HF_KEYS['model_type']!r} (this config.json "
                  "describes another kind of model)")
        fields = {k: v for k, v in d.items() if k not in LAYER_LISTS and k not in HF_KEYS}
        reject_unknown_fields(cls, fields)
        # A complete dump (``to_dict`` writes every field) without the recipe fields was
        # written before they existed: its model was trained, and shaped (the output gate
        # has weights), the official way; one without a later field, with that field's
        # value of the time. A hand-written partial file takes the defaults.
        if set(fields) >= DUMP_FIELDS:
            if not set(OFFICIAL_RECIPE) & set(fields):
                fields = {**OFFICIAL_RECIPE, **fields}
            fields = {**FORMER_DEFAULTS, **fields}
        config = cls(**fields)
        for key, kind in LAYER_LISTS.items():
            expected = list(config.layers_of(kind))
            if key in d and not (isinstance(d[key], (list, tuple)) and list(d[key]) == expected):
                _fail(key, d[key], f"{expected}, the indices of {kind!r} in layer_types "
                      f"{list(config.layer_types)}")
        return config

    def replace(self, **changes: Any) -> NatsConfig:
        return dataclasses.replace(self, **changes)

    def official_recipe(self) -> NatsConfig:
        """This architecture trained as the official NAtS-L layer is (``OFFICIAL_RECIPE``)."""
        return self.replace(**OFFICIAL_RECIPE)


OFFICIAL_RECIPE: dict[str, Any] = {
    "route_grad": "selected", "scorer_norm": False, "scorer_init": "normal",
    "scorer_detach": False, "softmax_target": None, "output_gate": "silu", "branch_norm": "both",
    "softmax_gain_init": None, "softmax_qkv": "shared", "scorer_pool": "mean"}
"""The router and output settings of the official NAtS-L code (automl/
NeuralAttentionSearchLinear, 340M config): only the chosen option's route gradient, a
raw pooled input that the route gradient flows back into, the scorer drawn like every
weight, no budget, a SiLU output gate, both branch outputs RMS-normalised, no softmax
gain and one q/k/v projection for both branches.
The defaults differ where docs/RESULTS.md measured that they train better."""

DUMP_FIELDS = frozenset({"sampler", "gumbel_tau", "reg_lambda", "norm_eps",
                         "initializer_range", "tie_embeddings"})
"""Fields that every ``to_dict`` dump has held, and hand-written configs seldom do."""

FORMER_DEFAULTS: dict[str, Any] = {"scorer_pool": "mean"}
"""Fields whose default changed after they were added, at the value every model saved
before the field existed had: a complete dump without one was trained that way."""


def reject_unknown_fields(cls: type, data: dict[str, Any]) -> None:
    """A saved or hand-written config with a misspelt key fails instead of being ignored."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")


def fail(owner: str, name: str, value: Any, allowed: str) -> NoReturn:
    """Raise the one error message shape of every config: field, value, what is allowed."""
    raise ConfigError(f"{owner}.{name} = {value!r} is invalid: must be {allowed}")


def whole_at_least(value: Any, least: int = 1) -> bool:
    """An ``int`` (not a bool, which JSON ``true`` would be) >= ``least``: the check of
    every count a config or command takes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def positive_finite(value: Any) -> bool:
    """A number (not a bool, which JSON ``true`` would be) in (0, inf)."""
    return nonnegative_finite(value) and value > 0


def nonnegative_finite(value: Any) -> bool:
    """A number (not a bool, which JSON ``true`` would be) in [0, inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value >= 0


def _fail(name: str, value: Any, allowed: str) -> NoReturn:
    fail("NatsConfig", name, value, allowed)
