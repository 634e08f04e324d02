"""`nats bench model`: what a user feels of the hybrid, a whole model at a time.

A GPT-2-small-sized model (12 layers, width 768, the same MLP and embeddings throughout)
in several forms, measured in one run so that their ratios compare:

* ``transformer``: every layer softmax attention;
* ``all-linear``: every layer the linear operator (Gated DeltaNet by default);
* ``nats@f``: every layer NAtS-L with its routes forced to a softmax fraction ``f``
  (evenly spread chunks, :func:`nats.layers.routing.fraction_is_softmax`), the cost of a
  trained hybrid at that share without training one;
* ``layer-hybrid@s``: softmax every ``1/s``-th layer, the others linear: the layer-level
  hybrid at the same softmax share ``s``.

For each: training tokens/s (forward, backward, an AdamW step and the routing statistics'
commit, as the trainer's step; bf16 autocast on a GPU; with ``cuda_graph`` replayed from a
CUDA graph) and peak memory at each training length, prefill milliseconds (batch 1, no
gradients; with ``cuda_graph`` replayed too) at each prefill length, and decode
milliseconds per token against a prefilled cache at each context (replayed from a CUDA
graph on a GPU, as ``generate`` decodes). A measurement that runs out of memory is
recorded as such and the longer lengths of that form are skipped.
On a CPU the same command runs (the reference operators) to check itself, with small
shapes; its times say nothing about the kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nats.atomic_write import atomic_write_bytes, check_output_file
from nats.config import NatsConfig, whole_at_least
from nats.cuda_graph import GraphedPrefill, warm_then_capture
from nats.latency import median_ms
from nats.model import NatsForCausalLM
from nats.trainers.config import architecture_layers
from nats.trainers.distributed import resolve_device

from .decode_benchmark import time_decode

GRAPH_WARMUP_STEPS = 3
"""Eager steps before a training step is captured: the optimizer's state, every kernel's
compilation and autotuning, and the chunk maps cached per shape all exist by then."""


@dataclass(frozen=True)
class ModelBenchConfig:
    """What to build and what to time; validated on construction (one-line errors)."""

    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 6
    """Routing heads (= linear heads of ``head_dim``); softmax heads: ``2 * n_heads`` of
    ``head_dim / 2``."""
    head_dim: int = 128
    vocab_size: int = 32_000
    chunk_size: int = 64
    fractions: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0)
    layer_hybrid_shares: tuple[float, ...] = (0.25,)
    train_lens: tuple[int, ...] = (4096, 16_384)
    train_tokens: int = 16_384
    """Tokens per training step: the batch is ``train_tokens // length`` sequences. At
    65,536 every form of the 12-layer model ran out of memory on an 80 GB GPU (the float32
    logits over a 32k vocabulary and their gradient alone take ~17 GB)."""
    prefill_lens: tuple[int, ...] = (4096, 32_768, 131_072)
    decode_contexts: tuple[int, ...] = (8192, 32_768, 131_072)
    decode_steps: int = 128
    repeats: int = 5
    compile: bool = False
    """``torch.compile`` each model's training forward (as ``nats train --compile`` does);
    prefill and decode stay eager."""
    cuda_graph: bool = False
    """Replay each training step (forward, backward and the optimizer step, captured after
    warm-up steps) and each prefill (:class:`~nats.cuda_graph.GraphedPrefill`, captured
    in the warm-up) from a CUDA graph: what they cost without Python and launch overhead.
    Decode steps are always replayed on a GPU. GPU only."""
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "head_dim", "vocab_size", "chunk_size",
                     "train_tokens", "decode_steps", "repeats"):
            value = getattr(self, name)
            if not whole_at_least(value):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, "
                                 f"got {value!r}")
        for name in ("train_lens", "prefill_lens", "decode_contexts"):
            if any(not whole_at_least(v) for v in getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be integers >= 1")
        if not (self.train_lens or self.prefill_lens or self.decode_contexts):
            raise ValueError("--train-lens, --prefill-lens and --decode-contexts are all "
                             "empty: nothing to measure")
        for name in ("compile", "cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cuda_graph and self.compile:
            raise ValueError("--cuda-graph and --compile: give one (a compiled step replayed "
                             "from a graph is not measured or tested)")
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise ValueError(f"--cuda-graph replays CUDA graphs: it needs --device cuda, got "
                             f"{self.device!r}")
        if any(not 0 <= f <= 1 for f in self.fractions):
            raise ValueError(f"--fractions must lie in [0, 1], got {list(self.fractions)}")
        if any(not 0 < s <= 1 or round(1 / s) > self.n_layers
               for s in self.layer_hybrid_shares):
            raise ValueError(f"--layer-hybrid-shares must lie in [1/n_layers, 1] = "
                             f"[{1 / self.n_layers:.3g}, 1] (softmax in at least one layer; "
                             f"softmax every round(1/share)-th layer), got "
                             f"{list(self.layer_hybrid_shares)}")
        if self.n_heads * self.head_dim != self.d_model or self.head_dim % 2:
            raise ValueError(f"n_heads x head_dim must be d_model ({self.n_heads} x "
                             f"{self.head_dim} != {self.d_model}) with an even head_dim")
        if self.train_lens and max(self.train_lens) > self.train_tokens:
            # A longer length would train on a batch of no sequences.
            raise ValueError(f"--train-tokens {self.train_tokens} holds no sequence of "
                             f"{max(self.train_lens)} tokens")

    def model_config(self, layer_types: tuple[str, ...]) -> NatsConfig:
        return NatsConfig(vocab_size=self.vocab_size, d_model=self.d_model,
                          n_layers=self.n_layers, n_heads=self.n_heads,
                          softmax_heads_per_head=2, head_dim_k=self.head_dim,
                          head_dim_v=self.head_dim, chunk_size=self.chunk_size,
                          layer_types=layer_types)


CPU_CHECK: dict[str, Any] = dict(
    d_model=32, n_layers=2, n_heads=2, head_dim=16, vocab_size=64, chunk_size=16,
    layer_hybrid_shares=(0.5,), train_lens=(32,), train_tokens=64, prefill_lens=(128,),
    decode_contexts=(136,), decode_steps=20, repeats=1)
"""``--device cpu``'s defaults: a model small enough to check the command in seconds (the
GPU-sized one would take hours there; its numbers mean nothing either way)."""


def default_config(device: str, **changes: Any) -> ModelBenchConfig:
    """The defaults of ``device`` (the GPU-sized model on ``cuda``, :data:`CPU_CHECK`
    elsewhere), then ``changes`` (None keeps a default)."""
    base = {} if device.startswith("cuda") else dict(CPU_CHECK)
    base.update({k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()
                 if v is not None})
    return ModelBenchConfig(device=device, **base)


@dataclass(frozen=True)
class Variant:
    """One form of the model: its layer types and the forced softmax fraction of its
    NAtS-L layers (``None``: none to force)."""

    name: str
    layer_types: tuple[str, ...]
    fraction: float | None
    softmax_share: float
    """Share of the attention (layers x tokens) that is softmax."""


def variants(config: ModelBenchConfig) -> list[Variant]:
    n = config.n_layers
    out = [Variant("transformer", ("softmax",) * n, None, 1.0),
           Variant("all-linear", ("linear",) * n, None, 0.0)]
    out += [Variant(f"nats@{f:g}", ("nats",) * n, f, f) for f in config.fractions]
    for share in config.layer_hybrid_shares:
        types = architecture_layers("layer-hybrid", n, round(1 / share))
        out.append(Variant(f"layer-hybrid@{share:g}", types, None,
                           types.count("softmax") / n))
    return out


def variant_model(variant: Variant, config: ModelBenchConfig, device: torch.device,
                  ) -> NatsForCausalLM:
    """``variant``'s model from seed 0, in float32 on ``device``, its NAtS-L layers forced
    to its softmax fraction: the same weights in every measure and every tool."""
    torch.manual_seed(0)
    model = NatsForCausalLM(config.model_config(variant.layer_types)).to(device)
    model.set_route_override(variant.fraction)
    return model


def _autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on a GPU; on a CPU the reference operators run in float32."""
    return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" \
        else torch.autocast("cpu", enabled=False)


def training_step(model: NatsForCausalLM, ids: torch.Tensor, lr: float = 1e-4,
                  compile: bool = False, cuda_graph: bool = False,
                  ) -> Callable[[], torch.Tensor]:
    """A function that runs one training step on ``ids`` (forward, backward, AdamW, the
    routing statistics' commit, as the trainer's step) and returns its loss.

    With ``cuda_graph`` the step is captured after :data:`GRAPH_WARMUP_STEPS` eager steps
    (which train the model too) and each call replays it; the loss returned is then the
    graph's own tensor, refilled by every replay.
    """
    device = ids.device
    # Capturable: the step counts and the update stay on the GPU, so a graph can replay it.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, capturable=cuda_graph)
    autocast = _autocast(device)
    model.train()
    forward = torch.compile(model) if compile else model

    def step() -> torch.Tensor:
        with autocast:  # entered per step: a graph records the casts of the weights too
            loss = forward(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        model.update_routing_statistics()
        return loss.detach()

    def eager_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        return step()

    if not cuda_graph:
        return eager_step

    def warm_up() -> None:
        for _ in range(GRAPH_WARMUP_STEPS):
            eager_step()
        # The capture makes the gradients in the graph's memory, which replays overwrite.
        optimizer.zero_grad(set_to_none=True)

    _, graph, loss = warm_then_capture(warm_up, step, device)

    def replay() -> torch.Tensor:
        graph.replay()
        return loss

    return replay


def train_step_row(model: NatsForCausalLM, config: ModelBenchConfig, length: int,
                   device: torch.device) -> dict[str, Any]:
    """Tokens/s of a training step (:func:`training_step`) at ``length`` and its peak
    memory."""
    batch = config.train_tokens // length
    ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = training_step(model, ids, compile=config.compile, cuda_graph=config.cuda_graph)
    ms = median_ms(step, device, warmup=1, repeats=config.repeats)
    row = {"tokens_per_s": batch * length / (ms / 1e3), "ms": ms, "batch": batch,
           "cuda_graph": config.cuda_graph}
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def prefill_call(model: NatsForCausalLM, ids: torch.Tensor, cuda_graph: bool = False,
                 ) -> Callable[[], object]:
    """A function that prefills ``ids`` (no gradient, bf16 autocast on a GPU; the cache
    built), replayed from a CUDA graph after its first call with ``cuda_graph``."""
    model.eval()
    prefill = GraphedPrefill(model) if cuda_graph else model.prefill
    autocast = _autocast(ids.device)

    def call() -> object:
        with torch.no_grad(), autocast:
            return prefill(ids)

    return call


def prefill_row(model: NatsForCausalLM, config: ModelBenchConfig, length: int,
                device: torch.device) -> dict[str, Any]:
    """Median ms of a batch-1 prefill of ``length`` tokens (:func:`prefill_call`) and the
    softmax fraction the forced routes made of it."""
    ids = torch.randint(0, config.vocab_size, (1, length), device=device)
    prefill = prefill_call(model, ids, config.cuda_graph)
    row: dict[str, Any] = {"ms": median_ms(prefill, device, warmup=1, repeats=config.repeats),
                           "cuda_graph": config.cuda_graph}
    with torch.no_grad(), _autocast(device):
        fractions = [f.mean().item() for f in model(ids).attn_frac if f is not None]
    if fractions:  # what the forced routes made of this length (token-weighted)
        row["softmax_fraction"] = sum(fractions) / len(fractions)
    return row


def decode_row(model: NatsForCausalLM, config: ModelBenchConfig, context: int,
               device: torch.device) -> dict[str, Any]:
    """Mean ms per token over ``decode_steps`` steps after ``context`` prefilled tokens
    (:func:`~nats.evaluation.decode_benchmark.time_decode`, graphed on a GPU)."""
    model.eval()
    ms, kv = time_decode(model, context, config.decode_steps, device,
                         graphed=device.type == "cuda")
    return {"ms_per_token": ms, "kv_bytes": kv}


MEASURES = (("train", "train_lens", train_step_row), ("prefill", "prefill_lens", prefill_row),
            ("decode", "decode_contexts", decode_row))


def run_model_benchmark(config: ModelBenchConfig, out_json: Path | None,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant, every measurement; the JSON is rewritten after each row, so a run
    cut short keeps what it measured."""
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("nats bench model --device cuda needs a CUDA GPU (--device cpu "
                         "checks the command with small shapes)")
    device = resolve_device(config.device)
    if out_json is not None:
        check_output_file(out_json)  # before measuring
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": dataclasses.asdict(config), "rows": []}
    for variant in variants(config):
        model = variant_model(variant, config, device)
        params = sum(p.numel() for p in model.parameters())
        for measure, lengths_field, fn in MEASURES:
            # Training runs in float32 weights under autocast; inference in bf16.
            target = model.float() if measure == "train" else model.to(dtype)
            for length in getattr(config, lengths_field):
                row = {"variant": variant.name, "softmax_share": variant.softmax_share,
                       "measure": measure, "length": length, "parameters": params}
                try:
                    row.update(fn(target, config, length, device))
                except torch.cuda.OutOfMemoryError:  # a finding at this length
                    row["oom"] = True
                report["rows"].append(row)
                log(_line(row))
                if out_json is not None:
                    atomic_write_bytes(out_json, (json.dumps(report, indent=2) + "\n").encode())
                if row.get("oom"):
                    torch.cuda.empty_cache()
                    break  # longer lengths of this measure would not fit either
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _line(row: dict[str, Any]) -> str:
    head = f"{row['variant']:>18} {row['measure']:>7} {row['length']:>7}:"
    if row.get("oom"):
        return f"{head} out of memory"
    if row["measure"] == "train":
        peak = f", peak {row['peak_bytes'] / 2**30:.1f} GiB" if "peak_bytes" in row else ""
        return f"{head} {row['tokens_per_s']:12,.0f} tokens/s{peak}"
    if row["measure"] == "prefill":
        return f"{head} {row['ms']:10.2f} ms"
    return f"{head} {row['ms_per_token']:8.3f} ms/token, KV {row['kv_bytes'] / 2**20:.1f} MiB"


def _figures(report: dict[str, Any], first_column: str):
    """Each row's figure by (variant, measure, length), the (measure, length) columns in
    order, and a Markdown table's header over them after ``first_column``."""
    value = {"train": "tokens_per_s", "prefill": "ms", "decode": "ms_per_token"}
    rows = [r for r in report["rows"] if not r.get("oom")]
    got = {(r["variant"], r["measure"], r["length"]): r[value[r["measure"]]] for r in rows}
    order = [m for m, _, _ in MEASURES]
    columns = sorted({(r["measure"], r["length"]) for r in report["rows"]},
                     key=lambda k: (order.index(k[0]), k[1]))
    units = {"train": "tokens/s", "prefill": "ms", "decode": "ms/token"}
    header = [f"| {first_column} | " + " | ".join(f"{m} {n:,} ({units[m]})" for m, n in columns)
              + " |", "|---" * (len(columns) + 1) + "|"]
    return got, columns, header


def ratio_table(report: dict[str, Any]) -> str:
    """Markdown: per measure and length, each variant's figure and its ratio to the
    transformer's (tokens/s: higher is better; prefill and decode ms: lower is better)."""
    got, columns, lines = _figures(report, "variant")
    for name in dict.fromkeys(r["variant"] for r in report["rows"]):
        cells = []
        for measure, length in columns:
            v = got.get((name, measure, length))
            base = got.get(("transformer", measure, length))
            cells.append("oom" if v is None else f"{v:.4g}" if not base
                         else f"{v:.4g} ({v / base:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hybrid_ratio_table(report: dict[str, Any]) -> str:
    """Markdown: each NAtS-L variant's figure as ratios to the all-linear model's and to
    the layer hybrid's of the same softmax share (``-`` where the run has none or either
    ran out of memory), per measure and length: whether the token-level hybrid costs what
    its share of softmax does."""
    got, columns, lines = _figures(report, "x all-linear / x layer hybrid")
    shares = {r["variant"]: r["softmax_share"] for r in report["rows"]}
    for name, share in shares.items():
        if not name.startswith("nats@"):
            continue
        hybrid = next((n for n, s in shares.items()
                       if n.startswith("layer-hybrid@") and math.isclose(s, share)), None)
        cells = []
        for measure, length in columns:
            v = got.get((name, measure, length))
            ratios = [got.get((other, measure, length)) for other in ("all-linear", hybrid)]
            cells.append(" / ".join("-" if v is None or not base else f"{v / base:.2f}x"
                                    for base in ratios))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
