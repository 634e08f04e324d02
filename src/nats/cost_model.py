"""What an architecture costs at a context length, given each layer's softmax fraction.

The model counts the token mixers only (docs/NATSL.md), the part of the cost that the
routes change. Not counted: the q/k/v/gate/output projections, short convolutions, norms,
the scorer, the branch merge and the MLP; they cost the same whatever the routes are.

Notation for one layer: ``L`` tokens of context, chunk ``C``, ``H = n_heads`` routing
heads, ``r = softmax_heads_per_head``, linear head widths ``dk = head_dim_k`` and
``dv = head_dim_v`` (a softmax head has ``dk/r`` and ``dv/r``), ``f`` the softmax
fraction. Chunks ``c = 0 .. N-1``, ``N = ceil(L/C)``, hold ``n_c`` tokens (``C`` each,
the last what is left) and start at token ``cC``.

FLOPs are those of the matrix products, 2 per multiply-add (1 per plain multiply),
summed over the whole sequence of ``L`` tokens and divided by ``L`` (per token, averaged
over the positions). Softmax's exp, max and normalisation (``O(1)`` per (query, key)
pair and head, against ``2 (dk + dv) / r`` for the products) and the ``O(dk + dv)``
vector work of the delta rule are left out.

**Softmax part.** A (query, key) pair costs ``q.k`` (``dk/r`` multiply-adds) and ``p v``
(``dv/r``) in each of the ``r`` softmax heads of a routing head::

    FLOPs per pair = H * r * 2 * (dk/r + dv/r) = 2 * H * (dk + dv)

A NAtS-L query at ``i`` in chunk ``c`` sees keys ``cC .. i`` of its own chunk and the
keys of the earlier chunks routed to softmax. ``f`` is taken as the chance that any
earlier chunk is softmax (routes independent of position; a head's cost is linear in
its fraction, so the mean fraction over heads gives the exact total), so::

    pairs = sum_c n_c (n_c + 1) / 2  +  f * sum_c n_c * cC
    (L = N C:  L (C + 1) / 2  +  f * L (L - C) / 2;   f = 1:  L (L + 1) / 2)

A "softmax" layer (``H r`` heads of ``dk/r``, ``dv/r``, full causal) has ``L (L + 1) / 2``
pairs: NAtS-L at ``f = 1`` costs the same softmax FLOPs, at ``f = 0`` only its chunks.

**Linear part** (the config's ``linear_op``, recurrent form, per head and token; Gated
DeltaNet shown, state ``dk x dv``)::

    decay  S <- a S                  dk dv multiplies        dk dv FLOPs
    read   p = S^T k                 dk dv multiply-adds   2 dk dv
    write  S <- S + k (b (v - p))^T  dk dv multiply-adds   2 dk dv
    output o = S^T q                 dk dv multiply-adds   2 dk dv
                                                           -------
                                                           7 dk dv

The other operators drop steps (each spec's ``flops_per_state_entry``,
:mod:`nats.kernels.linear_ops`): DeltaNet has no
decay (6), gated linear attention no delta read (5: decay, write ``k v^T``, output),
linear attention neither (4), but its state has ``dv + 1`` columns (the normaliser
``z`` is written and read like a value column). The ELU+1 feature map and the final
division are ``O(dk + dv)`` vector work, left out like the gates.

A NAtS-L layer runs this for every token whatever the routes (the own chunk always
runs the operator); each finished softmax chunk also restores the snapshot decayed by
the chunk's gates, one multiply per state entry for operators with a decay gate (an
operator without one restores the snapshot as it is: no FLOPs). Of the ``floor(L/C)``
chunks that finish within ``L`` tokens, ``f floor(L/C)`` are softmax; with ``E`` state
entries per head (``dk dv``, or ``dk (dv + 1)``) and ``F`` the operator's FLOPs per entry::

    linear FLOPs per token = H * (F E + [decay] * f * floor(L/C) * E / L)

A "linear" layer (the plain linear layer): ``F H E`` per token, no restores. (The chunked
training kernels order the same computation differently; the count is of the
token-by-token form that decoding runs.)

**KV cache at context L** (src/nats/cache.py holds exactly this): the keys and values of
the finished softmax chunks plus the open chunk's ``L mod C`` tokens, whatever its
route, ``H r (dk/r + dv/r) = H (dk + dv)`` values a token::

    kv bytes = (f * C * floor(L/C) + L mod C) * H * (dk + dv) * dtype_bytes

This is the cache right after token ``L``, not a bound: decoding on, the open chunk
holds up to ``C - 1`` more tokens before it is filed (or dropped). For ``L`` a multiple of
``C`` (every default context) the open chunk is empty, so ``f = 1`` is exactly a softmax
layer's ``L H (dk + dv) dtype_bytes`` and ``f = 0`` holds no keys at all.

**Recurrent state**: ``H E state_dtype_bytes`` for a "linear" layer; twice that for
NAtS-L, which keeps the state and its snapshot at the current chunk's start (NATSL.md,
"Inference cache"). Not counted: the short-convolution window, the scorer's running
pool and the chunk's summed gates (``O(d_model)`` a layer, independent of ``L``).

**Baselines**: :func:`all_softmax` and :func:`all_linear` turn *every* layer into a plain
"softmax" or "linear" layer of the same channel budget (the Transformer and Gated DeltaNet
a hybrid is compared with), not NAtS-L layers at ``f = 1`` / ``0``, which still pay for
both branches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nats.config import NatsConfig
from nats.layers.linear_ops import LinearOperator

from .softmax_fraction import LayerFraction

DEFAULT_CONTEXTS = tuple(2**p for p in range(10, 21))
"""1024, 2048, ..., 1_048_576 tokens."""

IMPLIED_FRACTION = {"softmax": 1.0, "linear": 0.0}


@dataclass(frozen=True)
class LayerCost:
    """Mixer cost of one layer at ``context_len`` tokens (formulas: module docstring)."""

    layer: int
    kind: str
    """``"nats"``, ``"softmax"`` or ``"linear"``."""
    softmax_fraction: float
    """The fraction used: the measured one, 1.0 for "softmax", 0.0 for "linear"."""
    context_len: int
    softmax_flops_per_token: float
    """Softmax attention FLOPs of a length-``context_len`` sequence, divided by its length."""
    linear_flops_per_token: float
    """Linear operator FLOPs (with snapshot restores), divided by the length."""
    kv_cache_bytes: float
    """Expected bytes of keys and values cached after ``context_len`` tokens (batch 1)."""
    state_bytes: int
    """Bytes of recurrent state (NAtS-L: state and snapshot), batch 1."""

    @property
    def flops_per_token(self) -> float:
        return self.softmax_flops_per_token + self.linear_flops_per_token

    @property
    def cache_bytes(self) -> float:
        """Everything decoding keeps for this mixer: KV cache plus recurrent state."""
        return self.kv_cache_bytes + self.state_bytes


@dataclass(frozen=True)
class ArchitectureCost:
    """Per-layer costs and their totals at one context length."""

    context_len: int
    layers: tuple[LayerCost, ...]

    @property
    def softmax_flops_per_token(self) -> float:
        return sum(c.softmax_flops_per_token for c in self.layers)

    @property
    def linear_flops_per_token(self) -> float:
        return sum(c.linear_flops_per_token for c in self.layers)

    @property
    def flops_per_token(self) -> float:
        return sum(c.flops_per_token for c in self.layers)

    @property
    def kv_cache_bytes(self) -> float:
        return sum(c.kv_cache_bytes for c in self.layers)

    @property
    def state_bytes(self) -> int:
        return sum(c.state_bytes for c in self.layers)

    @property
    def cache_bytes(self) -> float:
        return self.kv_cache_bytes + self.state_bytes

    def to_dict(self) -> dict[str, Any]:
        """Totals and per-layer rows, JSON-ready."""
        fields = ("softmax_flops_per_token", "linear_flops_per_token", "flops_per_token",
                  "kv_cache_bytes", "state_bytes", "cache_bytes")
        layer_fields = ("layer", "kind", "softmax_fraction", *fields)
        return {"context_len": self.context_len, **{k: getattr(self, k) for k in fields},
                "layers": [{k: getattr(c, k) for k in layer_fields} for c in self.layers]}


def architecture_cost(config: NatsConfig, softmax_fractions: Sequence[float | None],
                      context_len: int, dtype_bytes: int = 2, state_dtype_bytes: int = 4,
                      ) -> ArchitectureCost:
    """Cost of ``config``'s mixers at ``context_len`` tokens (batch 1).

    ``softmax_fractions[i]``: layer ``i``'s measured softmax fraction
    (:mod:`nats.softmax_fraction`, mean over routing heads) for "nats" layers; ``None``
    (or the implied 1.0 / 0.0) for "softmax" / "linear" layers. KV entries take
    ``dtype_bytes``, the state ``state_dtype_bytes`` (float32 in the cache).
    """
    fractions = _check(config, softmax_fractions, context_len, dtype_bytes, state_dtype_bytes)
    return ArchitectureCost(context_len, tuple(
        _layer_cost(config, i, kind, f, context_len, dtype_bytes, state_dtype_bytes)
        for i, (kind, f) in enumerate(zip(config.layer_types, fractions, strict=True))))


def cost_curve(config: NatsConfig, softmax_fractions: Sequence[float | None],
               contexts: Sequence[int] = DEFAULT_CONTEXTS, dtype_bytes: int = 2,
               state_dtype_bytes: int = 4) -> tuple[ArchitectureCost, ...]:
    """:func:`architecture_cost` at each of ``contexts``."""
    return tuple(architecture_cost(config, softmax_fractions, n, dtype_bytes, state_dtype_bytes)
                 for n in contexts)


def all_softmax(config: NatsConfig) -> NatsConfig:
    """The same model with every layer plain causal softmax attention (``H r`` heads)."""
    return config.replace(layer_types=("softmax",) * config.n_layers)


def all_linear(config: NatsConfig) -> NatsConfig:
    """The same model with every layer a plain linear layer (``H`` heads of its
    ``linear_op``, Gated DeltaNet by default)."""
    return config.replace(layer_types=("linear",) * config.n_layers)


def compare_costs(config: NatsConfig, softmax_fractions: Sequence[float | None],
                  contexts: Sequence[int] = DEFAULT_CONTEXTS, dtype_bytes: int = 2,
                  state_dtype_bytes: int = 4) -> dict[str, tuple[ArchitectureCost, ...]]:
    """Cost curves of the model (``"model"``) and its baselines (``"all-softmax"``,
    ``"all-linear"``: :func:`all_softmax`, :func:`all_linear`)."""
    none = (None,) * config.n_layers
    args = (contexts, dtype_bytes, state_dtype_bytes)
    return {"model": cost_curve(config, softmax_fractions, *args),
            "all-softmax": cost_curve(all_softmax(config), none, *args),
            "all-linear": cost_curve(all_linear(config), none, *args)}


def fractions_from_measurement(config: NatsConfig, measured: Mapping[int, LayerFraction | float],
                               ) -> tuple[float | None, ...]:
    """``softmax_fractions`` from :func:`measure_softmax_fraction`'s result (or plain floats
    keyed by layer): the overall fraction of every "nats" layer, ``None`` elsewhere."""
    nats = set(config.layers_of("nats"))
    if set(measured) != nats:
        raise ValueError(f"measured layers {sorted(measured)} are not the NAtS-L layers "
                         f"{sorted(nats)} of the config")
    return tuple((m.overall if isinstance(m, LayerFraction) else float(m))
                 if (m := measured.get(i)) is not None else None
                 for i in range(config.n_layers))


def _layer_cost(cfg: NatsConfig, layer: int, kind: str, f: float, seq_len: int,
                dtype_bytes: int, state_dtype_bytes: int) -> LayerCost:
    h, dk, dv, c = cfg.n_heads, cfg.head_dim_k, cfg.head_dim_v, cfg.chunk_size
    op = LinearOperator.from_config(cfg)
    state_entries = h * dk * op.state_width
    per_entry = op.spec.flops_per_state_entry
    restore = float(op.spec.decays)  # FLOPs per state entry of a softmax chunk's snapshot restore
    flops_per_pair = 2 * h * (dk + dv)           # H r heads x 2 (dk/r + dv/r)
    kv_per_token = h * (dk + dv) * dtype_bytes   # H r heads x (dk/r + dv/r) values
    finished = seq_len // c
    if kind == "softmax":
        pairs, linear, kv_tokens, states = seq_len * (seq_len + 1) / 2, 0.0, float(seq_len), 0
    elif kind == "linear":
        pairs, kv_tokens, states = 0.0, 0.0, 1
        linear = per_entry * state_entries * seq_len
    else:
        sizes = [c] * finished + ([seq_len % c] if seq_len % c else [])
        own = sum(n * (n + 1) // 2 for n in sizes)
        earlier = sum(n * i * c for i, n in enumerate(sizes))
        pairs = own + f * earlier
        linear = (per_entry * seq_len + restore * f * finished) * state_entries
        kv_tokens, states = f * c * finished + seq_len % c, 2
    return LayerCost(layer=layer, kind=kind, softmax_fraction=f, context_len=seq_len,
                     softmax_flops_per_token=flops_per_pair * pairs / seq_len,
                     linear_flops_per_token=linear / seq_len,
                     kv_cache_bytes=kv_tokens * kv_per_token,
                     state_bytes=states * state_entries * state_dtype_bytes)


def _check(config: NatsConfig, fractions: Sequence[float | None], context_len: int,
           dtype_bytes: int, state_dtype_bytes: int) -> tuple[float, ...]:
    for name, value in (("context_len", context_len), ("dtype_bytes", dtype_bytes),
                        ("state_dtype_bytes", state_dtype_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} = {value!r} must be a positive integer")
    if len(fractions) != config.n_layers:
        raise ValueError(f"{len(fractions)} softmax fractions for {config.n_layers} layers "
                         f"{list(config.layer_types)}")
    out = []
    for i, (kind, f) in enumerate(zip(config.layer_types, fractions, strict=True)):
        if kind == "nats":
            if not isinstance(f, (int, float)) or isinstance(f, bool) or math.isnan(f) \
                    or not 0 <= f <= 1:
                raise ValueError(f"softmax_fractions[{i}] = {f!r}: layer {i} is NAtS-L and "
                                 f"needs its measured fraction in [0, 1]")
            out.append(float(f))
        elif f is None or f == IMPLIED_FRACTION[kind]:
            out.append(IMPLIED_FRACTION[kind])
        else:
            raise ValueError(f"softmax_fractions[{i}] = {f!r}: layer {i} is {kind!r}, whose "
                             f"fraction is None (or {IMPLIED_FRACTION[kind]})")
    return tuple(out)
