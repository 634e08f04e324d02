"""Official NAtS-L checkpoints (automl/NeuralAttentionSearchLinear) to ours, and back.

The official model (``NeuralAttentionSearchLinearAttnGDNForCausalLM``, model type
``neural_attention_search_linear_attn_gdn``; its 340M and 760M configs) is a stack of
fla Gated DeltaNet layers (``gdn_layers``) and NAtS-L layers. Every tensor has a place
here: most are renamed, q/k/v projections and their short convolutions are concatenated
into one projection and one convolution, the MLP's gate and up projections into one, and
the NAtS-L layer's gated output norm, which has one weight per branch, needs
``NatsConfig.branch_gamma``. What the official config can switch and this layer cannot
compute is refused by name (:data:`UNSUPPORTED`), not converted approximately.

The route decisions need no mapping: both scorers emit ``(head, option)`` logits with
option 0 = softmax, and both merge weights ``(softmax head, branch)`` with branch 0 =
linear. The router is trained the official way after conversion
(``NatsConfig.official_recipe``). Back to the official layout, a model converts only if
its forward is one the official layer computes: no budget, no normalised scorer input, a
SiLU output gate, both branches normalised, no softmax gain, one q/k/v projection,
plain Gated DeltaNet layers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors.torch import load_file

from .config import ConfigError, NatsConfig, positive_finite, whole_at_least
from .model import NatsForCausalLM, read_json_object, write_model_files

MODEL_TYPE = "neural_attention_search_linear_attn_gdn"
ARCHITECTURE = "NeuralAttentionSearchLinearAttnGDNForCausalLM"

UNSUPPORTED: dict[str, tuple[Any, Any, str]] = {
    "attn_with_short_conv": (True, False, "the softmax heads read q, k and v after the short "
                             "convolution here (False takes them before it)"),
    "attn_qk_norm": (True, False, "the softmax heads RMS-normalise q and k here"),
    "decay_for_non_gdn_blocks": (True, False, "softmax chunks decay the linear state here"),
    "ops_for_incomplete_chunks": ("all", "all", "a query's own chunk goes through both "
                                  "branches here"),
    "incomplete_block_start_with_ht": (True, True, "the own chunk's linear pass starts from "
                                       "the carried state here"),
    "nats_block_agg_type": ("mean", "mean", "the scorer reads the chunk mean here"),
    "n_ops": (2, 2, "a route chooses between softmax and Gated DeltaNet here"),
    "use_gate": (True, True, "use_gate=False has a differently shaped output norm"),
    "use_short_conv": (True, True, "q, k and v always pass the short convolution here"),
    "conv_bias": (False, False, "the short convolution has no bias here"),
    "allow_neg_eigval": (False, False, "beta is sigmoid(b_proj x) here, never scaled by 2"),
    "hidden_act": ("swish", "swish", "the MLP is SwiGLU here"),
    "attn_max_position_embeddings": (None, None, "rotary positions are not capped here"),
    "outputs_are_wighted": (True, True, "the branches are merged with learned weights here"),
}
"""Official config keys whose other values this layer does not compute: key -> (the one
value that converts, the official config class's default, what this layer does instead).
The defaults differ for the first three; the released 340M / 760M configs use the values
that convert."""

MAX_BLOCK = 64
"""The longest official routing block whose forward this layer computes."""
WHY_BLOCK = ("the official kernels walk longer blocks in 64-token pieces and read the "
             "linear state at a block index where they saved one per piece; see "
             "docs/NATSL.md, 'Official checkpoints'")

SAMPLERS = {"argmax": "argmax", "gumble": "gumbel"}
"""Official ``nats_sample_strategy`` (their spelling) -> ``NatsConfig.sampler``."""


def _fail(key: str, value: Any, allowed: str) -> NoReturn:
    raise ConfigError(f"official config {key} = {value!r} cannot be converted: {allowed}")


def _int(config: Mapping[str, Any], key: str, default: int, least: int = 1) -> int:
    """An integer field of an official config (absent or null: its class's default)."""
    value = config.get(key)
    if value is None:
        return default
    if not whole_at_least(value, least):
        _fail(key, value, f"an integer >= {least}")
    return value


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    """A positive number field of an official config (absent or null: the default)."""
    value = config.get(key)
    if value is None:
        return default
    if not positive_finite(value):
        _fail(key, value, "a finite number > 0")
    return float(value)


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        _fail(key, value, "true or false")
    return value


def mlp_width(config: Mapping[str, Any]) -> int:
    """The official MLP's hidden width: ``intermediate_size``, else fla's ``GatedMLP`` rule
    (2/3 of ``hidden_ratio`` times the width, rounded up to a multiple of 256)."""
    if config.get("intermediate_size") is not None:
        return _int(config, "intermediate_size", 0)
    width = int(_int(config, "hidden_size", 2048) * _number(config, "hidden_ratio", 4.0)
                * 2 / 3)
    return 256 * ((width + 255) // 256)


def config_from_official(config: Mapping[str, Any], vocab_size: int | None = None) -> NatsConfig:
    """Our config for an official model config (a ``config.json`` as a dict).

    ``vocab_size`` overrides the config's (the released configs omit it; the checkpoint's
    embedding has it). Raises :class:`ConfigError` naming the first key that does not
    convert.
    """
    if config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        _fail("model_type", config.get("model_type"), f"only {MODEL_TYPE!r} models convert")
    for key, (wanted, default, why) in UNSUPPORTED.items():
        value = config.get(key, default)
        if value != wanted:
            _fail(key, value, f"only {wanted!r} converts ({why})")
    heads = _int(config, "num_heads", 6)
    for key in ("num_nats_head", "num_v_heads"):
        if config.get(key) not in (None, heads):
            _fail(key, config[key], f"only null or num_heads={heads} converts (one routing "
                  "head per linear head here)")
    attn_heads = _int(config, "num_attn_heads", 12)
    if attn_heads % heads:
        _fail("num_attn_heads", attn_heads, f"a multiple of num_heads={heads} converts")
    head_dim = _int(config, "head_dim", 256)
    # The official layer's value width is int(head_dim * expand_v): a ratio written with
    # float rounding (120 / 88) means the whole number it is within rounding of.
    head_dim_v = head_dim * _number(config, "expand_v", 2.0)
    if not math.isclose(head_dim_v, round(head_dim_v), rel_tol=1e-9):
        _fail("expand_v", config.get("expand_v"), "head_dim * expand_v must be whole")
    head_dim_v = round(head_dim_v)
    sampler = config.get("nats_sample_strategy", "argmax")
    if sampler not in SAMPLERS:
        _fail("nats_sample_strategy", sampler, f"one of {tuple(SAMPLERS)}")
    n_layers = _int(config, "num_hidden_layers", 21)
    gdn_list = config.get("gdn_layers") or []
    if not isinstance(gdn_list, list) or not all(whole_at_least(i, 0) for i in gdn_list):
        _fail("gdn_layers", gdn_list, "a list of layer indices")
    gdn = set(gdn_list)
    if not gdn <= set(range(n_layers)):
        _fail("gdn_layers", sorted(gdn), f"indices below num_hidden_layers={n_layers}")
    block = _int(config, "nats_block_size", 64)
    if block > MAX_BLOCK:
        _fail("nats_block_size", block, f"at most {MAX_BLOCK} converts ({WHY_BLOCK})")
    hidden = _int(config, "hidden_size", 2048)
    width = mlp_width(config)
    if width % 8:
        _fail("intermediate_size", width, "a multiple of 8 (the MLP width here)")
    ratio = width / hidden
    while 8 * math.ceil(ratio * hidden / 8) > width:  # float rounding up past the width
        ratio = math.nextafter(ratio, 0.0)
    recipe = NatsConfig().official_recipe()
    cfg = recipe.replace(
        vocab_size=vocab_size if vocab_size is not None else _int(config, "vocab_size", 32000),
        d_model=hidden, n_layers=n_layers, n_heads=heads,
        softmax_heads_per_head=attn_heads // heads, head_dim_k=head_dim,
        head_dim_v=head_dim_v, chunk_size=block,
        layer_types=tuple("linear" if i in gdn else "nats" for i in range(n_layers)),
        sampler=SAMPLERS[sampler],
        route_grad="both" if _flag(config, "compute_dnats_for_invalid_blocks_attn", False)
        else "selected",
        branch_gamma=True, mlp_ratio=ratio, norm_eps=_number(config, "norm_eps", 1e-6),
        conv_size=_int(config, "conv_size", 4),
        rope=_flag(config, "attn_apply_pos_encoding", True),
        rope_theta=_number(config, "attn_rope_theta", 10000.0),
        tie_embeddings=_flag(config, "tie_word_embeddings", False),
        initializer_range=_number(config, "initializer_range", 0.02))
    return cfg


def config_to_official(cfg: NatsConfig) -> dict[str, Any]:
    """The official ``config.json`` of a model whose forward the official layer computes;
    raises :class:`ConfigError` naming the first field that does not convert."""
    wanted = {"scorer_norm": (False, "the official scorer reads the raw chunk mean"),
              "softmax_target": (None, "the official scorer has no threshold a budget sets"),
              "output_gate": ("silu", "the official layer always has the SiLU gate"),
              "branch_norm": ("both", "the official merge normalises both branches"),
              "softmax_gain_init": (None, "the official merge has no softmax gain"),
              "linear_op": ("gated_deltanet", "the official layers are Gated DeltaNet"),
              "softmax_qkv": ("shared", "the official branches share one q/k/v projection"),
              "scorer_pool": ("mean", "the official scorer reads the chunk mean")}
    for name, (value, why) in wanted.items():
        if getattr(cfg, name) != value:
            raise ConfigError(f"NatsConfig.{name} = {getattr(cfg, name)!r} cannot be converted "
                              f"to the official layout: only {value!r} ({why})")
    if cfg.chunk_size > MAX_BLOCK:
        raise ConfigError(f"NatsConfig.chunk_size = {cfg.chunk_size} cannot be converted to "
                          f"the official layout: at most {MAX_BLOCK} ({WHY_BLOCK})")
    if "softmax" in cfg.layer_types:
        raise ConfigError(f"NatsConfig.layer_types = {list(cfg.layer_types)} cannot be "
                          "converted to the official layout: it has no softmax layer")
    if int(cfg.head_dim_k * (cfg.head_dim_v / cfg.head_dim_k)) != cfg.head_dim_v:
        raise ConfigError(f"NatsConfig.head_dim_v = {cfg.head_dim_v} cannot be converted to "
                          f"the official layout: the official layer reads its width as "
                          f"int(head_dim * expand_v), which gives "
                          f"{int(cfg.head_dim_k * (cfg.head_dim_v / cfg.head_dim_k))} for "
                          f"head_dim_k = {cfg.head_dim_k}")
    return {
        "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "attn_mode": "chunk",
        "hidden_size": cfg.d_model, "expand_v": cfg.head_dim_v / cfg.head_dim_k,
        "head_dim": cfg.head_dim_k, "num_heads": cfg.n_heads,
        "num_attn_heads": cfg.n_heads * cfg.softmax_heads_per_head, "num_v_heads": None,
        "n_ops": 2, "num_nats_head": cfg.n_heads, "nats_block_size": cfg.chunk_size,
        "nats_block_agg_type": "mean",
        "nats_sample_strategy": {v: k for k, v in SAMPLERS.items()}[cfg.sampler],
        "ops_for_incomplete_chunks": "all", "use_gate": True, "use_short_conv": True,
        "conv_size": cfg.conv_size, "conv_bias": False, "allow_neg_eigval": False,
        "hidden_act": "swish", "intermediate_size": cfg.mlp_hidden, "hidden_ratio": 4,
        "attn_qk_norm": True, "attn_with_short_conv": True, "decay_for_non_gdn_blocks": True,
        "incomplete_block_start_with_ht": True,
        "compute_dnats_for_invalid_blocks_attn": cfg.route_grad == "both",
        "compute_dnats_for_invalid_blocks_linear_att": cfg.route_grad == "both",
        "attn_apply_pos_encoding": cfg.rope, "attn_rope_theta": cfg.rope_theta,
        "attn_max_position_embeddings": None, "num_hidden_layers": cfg.n_layers,
        "norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.initializer_range, "vocab_size": cfg.vocab_size,
        "gdn_layers": list(cfg.layers_of("linear"))}


# Per layer: official name -> ours, or a tuple of official names concatenated along dim 0.
_LAYER_COMMON: dict[str, str | tuple[str, ...]] = {
    "mixer_norm.weight": "attn_norm.weight", "mlp_norm.weight": "mlp_norm.weight",
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": "mlp.down_proj.weight",
    "mixer.qkv.proj.weight": ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"),
    "mixer.qkv.conv.weight": ("attn.q_conv1d.weight", "attn.k_conv1d.weight",
                              "attn.v_conv1d.weight"),
    "mixer.gates.a_proj.weight": "attn.a_proj.weight",
    "mixer.gates.b_proj.weight": "attn.b_proj.weight",
    "mixer.gates.A_log": "attn.A_log", "mixer.gates.dt_bias": "attn.dt_bias",
    "mixer.out.gate.weight": "attn.g_proj.weight", "mixer.out.out.weight": "attn.o_proj.weight",
}
_LAYER_KIND: dict[str, dict[str, str | tuple[str, ...]]] = {
    "linear": {"mixer.out.gamma": "attn.o_norm.weight"},
    "nats": {"mixer.out.gamma": "attn.o_norm.weight1",
             "mixer.softmax_gamma": "attn.o_norm.weight2",
             "mixer.q_norm.weight": "attn.q_norm.weight",
             "mixer.k_norm.weight": "attn.k_norm.weight",
             "mixer.scorer.proj.weight": "attn.nats_layer.weight",
             "mixer.mix.weight": "attn.nats_out_weights_layer.weight"},
}


def _names(cfg: NatsConfig) -> dict[str, str | tuple[str, ...]]:
    """Every tensor of our model -> its official name(s)."""
    names: dict[str, str | tuple[str, ...]] = {
        "embed.weight": "model.embeddings.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i, kind in enumerate(cfg.layer_types):
        for ours, theirs in {**_LAYER_COMMON, **_LAYER_KIND[kind]}.items():
            prefix = f"model.layers.{i}."
            names[f"blocks.{i}.{ours}"] = (tuple(prefix + t for t in theirs)
                                           if isinstance(theirs, tuple) else prefix + theirs)
    return names


def state_from_official(state: Mapping[str, torch.Tensor],
                        cfg: NatsConfig) -> dict[str, torch.Tensor]:
    """Our state dict from an official one (keys with or without the ``model.`` prefix of
    the base model); every official tensor must be used, and none may be missing."""
    state = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v
             for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, where a file stores it twice
    out, used = {}, set()
    for ours, theirs in _names(cfg).items():
        parts = theirs if isinstance(theirs, tuple) else (theirs,)
        missing = [p for p in parts if p not in state]
        if missing:
            raise ValueError(f"the official weights lack {missing[0]} (for {ours})")
        out[ours] = torch.cat([state[p] for p in parts]) if len(parts) > 1 else state[parts[0]]
        used.update(parts)
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"the official weights hold {len(unused)} tensor(s) this conversion "
                         f"has no place for, e.g. {unused[0]}")
    return out


def state_to_official(state: Mapping[str, torch.Tensor],
                      cfg: NatsConfig) -> dict[str, torch.Tensor]:
    """The official state dict of our ``state`` (``config_to_official(cfg)`` must hold).
    A shared merge weight (``branch_gamma=False``) becomes both official branch weights."""
    config_to_official(cfg)
    state = dict(state)
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _names(cfg).items():
        if ours.endswith("softmax_gamma") and ours not in state:
            state[ours] = state[ours.replace("softmax_gamma", "out.gamma")].clone()
        tensor = state[ours]
        if isinstance(theirs, tuple):
            sizes = _split_sizes(ours, cfg)
            for name, part in zip(theirs, tensor.split(sizes), strict=True):
                out[name] = part.contiguous()
        else:
            out[theirs] = tensor.contiguous()
    return out


def _split_sizes(ours: str, cfg: NatsConfig) -> list[int]:
    """Row counts of the official tensors concatenated into ``ours``."""
    if ours.endswith("mlp.gate_up.weight"):
        return [cfg.mlp_hidden] * 2
    key, value = cfg.n_heads * cfg.head_dim_k, cfg.n_heads * cfg.head_dim_v
    return [key, key, value]


def load_official(folder: str | os.PathLike) -> tuple[NatsConfig, dict[str, torch.Tensor]]:
    """Our config and state dict from an official model folder: ``config.json`` and
    ``model.safetensors`` or its shards (``model.safetensors.index.json``). Pickled
    weights (``pytorch_model.bin``) are refused: loading them could run code."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not an official NAtS-L model folder: no "
                                "config.json")
    config = read_json_object(config_file)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no weight_map object (tensor name -> file name)")
        shards = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ValueError(f"{folder} holds pickled weights only; they are not loaded (a pickle "
                         "can run code). Save them as safetensors with the official code "
                         "(model.save_pretrained(..., safe_serialization=True)) first")
    else:
        raise FileNotFoundError(f"{folder} holds no model.safetensors")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state.update(load_file(str(folder / shard)))
        except Exception as e:  # safetensors' own error types for a damaged file
            raise ValueError(f"{folder / shard} cannot be read ({e})") from None
    embed = state.get("model.embeddings.weight", state.get("embeddings.weight"))
    if embed is None:
        raise ValueError(f"{folder} holds no model.embeddings.weight: not an official NAtS-L "
                         "checkpoint")
    cfg = config_from_official(config, vocab_size=embed.shape[0])
    return cfg, state_from_official(state, cfg)


def model_from_official(folder: str | os.PathLike) -> NatsForCausalLM:
    """Our model holding an official checkpoint's weights (in their dtype)."""
    cfg, state = load_official(folder)
    return NatsForCausalLM.from_state(cfg, state, f"{folder} (converted)")


def save_official(model: NatsForCausalLM, folder: str | os.PathLike) -> None:
    """Write ``model`` as an official model folder (``config.json``, ``model.safetensors``)
    that the official code's ``AutoModelForCausalLM.from_pretrained`` reads."""
    state = state_to_official(model.state_dict(), model.config)  # no lm_head where tied
    folder = Path(folder)
    stale_index = folder / "model.safetensors.index.json"
    if stale_index.is_file():  # an earlier sharded save: its index would win over the file
        weight_map = read_json_object(stale_index).get("weight_map")
        for shard in set(weight_map.values()) if isinstance(weight_map, dict) else ():
            if isinstance(shard, str) and "/" not in shard:
                (folder / shard).unlink(missing_ok=True)
        stale_index.unlink()
    write_model_files(folder, config_to_official(model.config), state)
