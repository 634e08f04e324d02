"""`nats bench decode`: milliseconds per generated token against a long hybrid cache.

One layer at the kernel benchmark's width, prefilled with ``context`` tokens, then timed
for ``steps`` single-token decode steps (synchronised wall clock), both launched eagerly from
Python and replayed from a CUDA graph (:class:`nats.cuda_graph.GraphedDecoder`, what
``generate`` uses on a GPU). A plain softmax layer with a full KV cache is measured
beside NAtS-L layers forced to several softmax fractions, so both the time and the cache
size can be compared in one run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nats.atomic_write import atomic_write_bytes
from nats.cache import HybridCache
from nats.config import NatsConfig, whole_at_least
from nats.cuda_graph import GraphedDecoder
from nats.model import NatsForCausalLM


def decode_config(**changes) -> NatsConfig:
    """16 routing heads, linear heads of 128, r = 2 softmax heads of 64: the shape of the
    kernel benchmarks."""
    base = NatsConfig(vocab_size=256, d_model=2048, n_layers=1, n_heads=16,
                      softmax_heads_per_head=2, head_dim_k=128, head_dim_v=128, chunk_size=64,
                      layer_types=("nats",))
    return base.replace(**changes)


def time_decode(model: NatsForCausalLM, context: int, steps: int, device: torch.device,
                graphed: bool) -> tuple[float, int]:
    """Mean milliseconds per decode step after warm-up, and the cache's KV bytes.

    The steps cross chunk ends (``steps`` > the chunk size), so closing chunks and any
    graph capture they cause are part of the mean. The warm-up closes one chunk: the first
    close in a process compiles the routes kernel for one chunk, once, as a first step
    compiles the step's kernels. ``graphed`` (a GPU only) replays the steps from a CUDA
    graph, as ``generate`` does there.
    """
    step, cache = warm_decoder(model, context, device, graphed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) * 1e3 / steps, cache.kv_bytes()


def warm_decoder(model: NatsForCausalLM, context: int, device: torch.device, graphed: bool,
                 ) -> tuple[Callable[[], torch.Tensor], HybridCache]:
    """A decode step (of the prompt's last token, again) and its cache after ``context``
    prefilled tokens and a warm-up over one chunk close (see :func:`time_decode`)."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    _, cache = model.prefill(ids)
    token = ids[:, -1]
    decoder = GraphedDecoder(model, cache) if graphed else None

    def step() -> torch.Tensor:
        return model.decode_step(token, cache) if decoder is None else decoder(token)

    for _ in range(model.config.chunk_size + 1):
        step()
    return step, cache


def run_decode_benchmark(contexts: tuple[int, ...], fractions: tuple[float, ...], steps: int,
                         out_json: Path | None) -> list[dict]:
    for name, values in (("--context", contexts), ("--steps", (steps,))):
        if any(not whole_at_least(v) for v in values):
            raise ValueError(f"{name} must be integers >= 1, got {list(values)}")
    if not all(0 <= f <= 1 for f in fractions):
        raise ValueError(f"--fractions must lie in [0, 1], got {list(fractions)}")
    if not torch.cuda.is_available():
        raise ValueError("nats bench decode needs a CUDA GPU")
    device = torch.device("cuda")
    cases = [("softmax", None)] + [("nats", f) for f in fractions]
    rows = []
    for context in contexts:
        for kind, fraction in cases:
            torch.manual_seed(0)
            model = NatsForCausalLM(decode_config(layer_types=(kind,))).to(device,
                                                                            torch.bfloat16)
            model.eval().set_route_override(fraction)
            row = {"layer": kind, "softmax_fraction": 1.0 if fraction is None else fraction,
                   "context": context}
            try:
                eager, kv = time_decode(model, context, steps, device, graphed=False)
                graph, _ = time_decode(model, context, steps, device, graphed=True)
            except torch.cuda.OutOfMemoryError:  # a finding at this length, not a failure
                rows.append({**row, "oom": True})
                print(f"{context:>8} {kind:>8}: out of memory", flush=True)
            else:
                rows.append({**row, "ms_per_token": graph, "eager_ms_per_token": eager,
                             "kv_bytes": kv})
                print(f"{context:>8} {kind:>8} frac {row['softmax_fraction']:5.3f}: "
                      f"{graph:7.3f} ms/token graphed, {eager:7.3f} eager, "
                      f"KV cache {kv / 2**20:8.1f} MiB", flush=True)
            if out_json is not None:  # after every row: a run cut short keeps what it measured
                atomic_write_bytes(out_json, (json.dumps(
                    {"device": torch.cuda.get_device_name(), "rows": rows}, indent=2)
                    + "\n").encode())
            del model
            torch.cuda.empty_cache()
    return rows
