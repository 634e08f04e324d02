"""`nats bench attention`: one softmax layer against one linear-attention layer.

The classic experiment of "Transformers are RNNs" (Katharopoulos et al., 2020): a single
attention layer, ``d_k = d_v = 64``, batch 32, causal, forward time (mean and standard
deviation over ``runs`` runs) against the sequence length, for softmax attention
(materialised ``[B, H, T, T]`` scores, and PyTorch SDPA) and every linear operator of
:mod:`nats.layers.linear_ops`, chunked (the operator the models train with) and recurrent
(token by token, the decode step in a loop). Then one decoding step against a context of
``L`` tokens: softmax reads a KV cache that grows with ``L``, the linear operators a state
of fixed size; the latency and the bytes held are recorded per context.

Every method runs under ``torch.no_grad`` (inference). On a GPU each run is timed with
CUDA events and the peak memory above the inputs is recorded; on the CPU, wall time. A
method that runs out of memory is recorded as such and not tried at longer lengths.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from nats.atomic_write import atomic_write_bytes, check_output_file
from nats.config import LINEAR_OPS, whole_at_least
from nats.kernels.linear_ops import LINEAR_OP_SPECS
from nats.kernels.reference.chunks import CHUNK_SIZES
from nats.layers.linear_ops import LinearOperator, TokenGates

SOFTMAX_METHODS = ("softmax_naive", "softmax_sdpa")
FORMS = ("chunked", "recurrent")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GPU_SEQ_LENS = (128, 256, 512, 1024, 2048, 4096, 6000, 8192, 16384, 32768, 65536)
CPU_SEQ_LENS = (128, 256, 512)
GPU_CONTEXTS = (128, 1024, 8192, 65536, 262144, 1048576)
CPU_CONTEXTS = (128, 1024, 8192)


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What to measure; :func:`default_config` fills in the device's defaults."""

    device: str
    seq_lens: tuple[int, ...]
    runs: int
    recurrent_runs: int
    recurrent_max_len: int
    decode_contexts: tuple[int, ...]
    warmup: int = 3
    batch: int = 32
    heads: int = 1
    head_dim: int = 64
    chunk_size: int = 64
    dtype: str = "float32"
    ops: tuple[str, ...] = LINEAR_OPS
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("runs", "recurrent_runs", "batch", "heads", "head_dim", "chunk_size")
        for name in positive:
            value = getattr(self, name)
            if not whole_at_least(value):
                raise ValueError(f"{name} = {value!r} must be a positive integer")
        if self.warmup < 0 or self.recurrent_max_len < 0:
            raise ValueError("warmup and recurrent_max_len must be >= 0")
        for name in ("seq_lens", "decode_contexts"):
            values = getattr(self, name)
            if not values or any(not whole_at_least(v) for v in values):
                raise ValueError(f"{name} = {list(values)} must be positive integers")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype = {self.dtype!r} must be one of {tuple(DTYPES)}")
        if self.chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size = {self.chunk_size!r} must be one of {CHUNK_SIZES}")
        bad = [op for op in self.ops if op not in LINEAR_OP_SPECS]
        if bad or not self.ops:
            raise ValueError(f"ops = {list(self.ops)} must be operators from "
                             f"{tuple(LINEAR_OP_SPECS)}")


def default_config(device: str, **changes) -> AttentionBenchConfig:
    """The defaults of ``device`` ("cpu" or "cuda"), then ``changes`` (None keeps one).

    GPU: the classic lengths 128 .. 6000 and on to 65536 (the materialised softmax runs
    out of memory on the way: recorded, not fatal), 100 runs, bf16; recurrent forms
    (a Python loop of decode steps) to 1024 tokens and 10 runs. CPU: lengths to 512, 3 runs
    (fewer for the recurrent forms), float32. Either way the whole run takes minutes.
    """
    if torch.device(device).type == "cuda":
        base = dict(seq_lens=GPU_SEQ_LENS, runs=100, recurrent_runs=10, recurrent_max_len=1024,
                    decode_contexts=GPU_CONTEXTS, warmup=5, dtype="bfloat16")
    else:
        base = dict(seq_lens=CPU_SEQ_LENS, runs=3, recurrent_runs=2, recurrent_max_len=256,
                    decode_contexts=CPU_CONTEXTS, warmup=1, dtype="float32")
    base.update({k: v for k, v in changes.items() if v is not None})
    for key in ("seq_lens", "decode_contexts", "ops"):
        if key in base:
            base[key] = tuple(base[key])
    return AttentionBenchConfig(device=device, **base)


@dataclass
class Timing:
    """One measured (method, length): milliseconds over ``runs`` runs, or why none."""

    method: str
    length: int
    mean_ms: float | None = None
    """``None`` where nothing was measured (``status`` says why)."""
    std_ms: float | None = None
    runs: int = 0
    peak_mib: float | None = None
    """CUDA: peak memory allocated during a run, above what was held before it."""
    held_mib: float | None = None
    """Decoding: the KV cache or state the step reads (what grows, or not, with L)."""
    status: str = "ok"
    """``"ok"``, ``"oom"``, ``"skipped: <why>"`` or ``"error: <exception>"``."""


@dataclass
class AttentionBenchResult:
    config: AttentionBenchConfig
    device_name: str
    forward: list[Timing] = field(default_factory=list)
    decode: list[Timing] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"device": self.device_name, "torch": torch.__version__,
                "config": asdict(self.config), "forward": [asdict(t) for t in self.forward],
                "decode": [asdict(t) for t in self.decode]}


def _time(fn: Callable[[], object], runs: int, warmup: int, device: torch.device,
          method: str, length: int) -> Timing:
    """Mean and standard deviation of ``runs`` timed calls after ``warmup`` untimed ones."""
    cuda = device.type == "cuda"
    try:
        for _ in range(warmup):
            fn()
        times, peak = [], 0
        for _ in range(runs):
            if cuda:
                torch.cuda.synchronize(device)
                held = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
                peak = max(peak, torch.cuda.max_memory_allocated(device) - held)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
    except torch.OutOfMemoryError:
        if cuda:
            torch.cuda.empty_cache()
        return Timing(method, length, status="oom")
    except Exception as e:  # reported in the row; the other methods still get measured
        return Timing(method, length, status=f"error: {type(e).__name__}: {str(e)[:300]}")
    std = statistics.stdev(times) if len(times) > 1 else 0.0
    return Timing(method, length, statistics.fmean(times), std, runs,
                  peak_mib=peak / 2**20 if cuda else None)


def naive_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with the ``[B, H, T, T]`` scores materialised (``[B, H, T,
    D]`` layout): what attention cost before fused kernels."""
    seq_len = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v


class _Inputs:
    """Random inputs of one length: softmax heads ``[B, H, T, D]``, the same tensors as
    linear heads ``[B, T, H, D]`` with each operator's q/k features, and gates (decay
    ``g = logsigmoid(N(4, 1))`` near 1, as the kernel benchmark takes them)."""

    def __init__(self, cfg: AttentionBenchConfig, seq_len: int, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(cfg.seed + seq_len)
        dtype = DTYPES[cfg.dtype]
        shape = (cfg.batch, seq_len, cfg.heads, cfg.head_dim)
        self.q, self.k, self.v = (torch.randn(shape, device=device, generator=gen, dtype=dtype)
                                  for _ in range(3))
        gate_shape = (cfg.batch, seq_len, cfg.heads)
        self.g = F.logsigmoid(torch.randn(gate_shape, device=device, generator=gen) + 4.0)
        self.beta = torch.rand(gate_shape, device=device, generator=gen)

    def softmax_heads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.transpose(1, 2) for t in (self.q, self.k, self.v))

    def linear(self, op: LinearOperator) -> tuple[torch.Tensor, ...]:
        """q, k, v as ``op`` takes them, and its gates (g zero without a decay gate)."""
        q, k, v = op.features(*(t.flatten(2) for t in (self.q, self.k, self.v)))
        g = self.g if op.spec.decays else torch.zeros_like(self.g)
        return q, k, v, TokenGates(g, self.beta if op.spec.delta else None)


def operator(cfg: AttentionBenchConfig, name: str) -> LinearOperator:
    return LinearOperator(name, cfg.heads, cfg.head_dim, cfg.head_dim, cfg.chunk_size)


def recurrent(op: LinearOperator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              gates: TokenGates) -> torch.Tensor:
    """The operator token by token: its decode step over the sequence."""
    state = op.initial_state(q.shape[0], q.device)
    outs = []
    for t in range(q.shape[1]):
        o, state = op.step(state, q[:, t], k[:, t], v[:, t], gates.window(t))
        outs.append(o)
    return torch.stack(outs, 1)


def forward_methods(cfg: AttentionBenchConfig, inputs: _Inputs, seq_len: int,
                    ) -> Iterator[tuple[str, Callable[[], object], int, int]]:
    """``(method, call, runs, warmup)`` of every method at one length (a recurrent form
    is warmed up once: its many small steps have nothing to compile or tune)."""
    q, k, v = inputs.softmax_heads()
    yield "softmax_naive", lambda: naive_softmax_attention(q, k, v), cfg.runs, cfg.warmup
    yield ("softmax_sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           cfg.runs, cfg.warmup)
    for name in cfg.ops:
        op = operator(cfg, name)
        args = inputs.linear(op)
        yield f"{name}_chunked", lambda op=op, args=args: op.parallel(*args), cfg.runs, \
            cfg.warmup
        if seq_len <= cfg.recurrent_max_len:
            yield (f"{name}_recurrent", lambda op=op, args=args: recurrent(op, *args),
                   cfg.recurrent_runs, min(cfg.warmup, 1))


def forward_method_names(cfg: AttentionBenchConfig) -> list[str]:
    return [*SOFTMAX_METHODS, *(f"{op}_{form}" for op in cfg.ops for form in FORMS)]


def bench_forward(cfg: AttentionBenchConfig, device: torch.device,
                  report: Callable[[Timing], None]) -> list[Timing]:
    rows: list[Timing] = []
    out_of_memory: set[str] = set()
    for seq_len in cfg.seq_lens:
        inputs = _Inputs(cfg, seq_len, device)
        measured = set()
        for method, call, runs, warmup in forward_methods(cfg, inputs, seq_len):
            measured.add(method)
            if method in out_of_memory:
                row = Timing(method, seq_len, status="skipped: out of memory at a shorter length")
            else:
                row = _time(call, runs, warmup, device, method, seq_len)
                if row.status == "oom":
                    out_of_memory.add(method)
            rows.append(row)
            report(row)
        for method in forward_method_names(cfg):
            if method not in measured:  # recurrent forms past --recurrent-max-len
                rows.append(Timing(method, seq_len, status="skipped: longer than "
                                   f"recurrent_max_len={cfg.recurrent_max_len}"))
                report(rows[-1])
        del inputs
    return rows


def bench_decode(cfg: AttentionBenchConfig, device: torch.device,
                 report: Callable[[Timing], None]) -> list[Timing]:
    """One token against ``L`` tokens of context: softmax (SDPA over the KV cache) and each
    operator's decode step on its state."""
    rows: list[Timing] = []
    dtype = DTYPES[cfg.dtype]
    b, h, d = cfg.batch, cfg.heads, cfg.head_dim
    gen = torch.Generator(device=device).manual_seed(cfg.seed)

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen, dtype=dt)

    for context in cfg.decode_contexts:
        try:
            cache_k, cache_v = randn(b, h, context, d), randn(b, h, context, d)
        except torch.OutOfMemoryError:
            rows.append(Timing("softmax_sdpa", context, status="oom"))
            report(rows[-1])
            torch.cuda.empty_cache()
        else:
            step = partial(F.scaled_dot_product_attention, randn(b, h, 1, d), cache_k, cache_v)
            row = _time(step, cfg.runs, cfg.warmup, device, "softmax_sdpa", context)
            row.held_mib = 2 * cache_k.numel() * cache_k.element_size() / 2**20
            rows.append(row)
            report(row)
            del cache_k, cache_v
        for name in cfg.ops:
            op = operator(cfg, name)
            # The state after `context` tokens: its values do not change the step's cost.
            state = randn(b, h, d, op.state_width, dt=torch.float32).abs() * context**-0.5
            q, k, v = (randn(b, 1, h * d) for _ in range(3))
            q, k, v = (t[:, 0] for t in op.features(q, k, v))
            gates = TokenGates(torch.zeros(b, h, device=device),
                               torch.full((b, h), 0.5, device=device))
            row = _time(partial(op.step, state, q, k, v, gates), cfg.runs, cfg.warmup, device,
                        name, context)
            row.held_mib = state.numel() * state.element_size() / 2**20
            rows.append(row)
            report(row)
    return rows


def run_attention_benchmark(cfg: AttentionBenchConfig, out_json: Path | None,
                            progress: bool = True) -> AttentionBenchResult:
    """Measure, print a line per row, write the JSON (after every row) and the PNG plot."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is available")
    if out_json is not None:  # before measuring: a wrong --out must not cost the run
        if out_json.suffix == ".png":
            raise ValueError(f"--out {out_json}: the JSON file (its plot is written beside "
                             "it as .png)")
        check_output_file(out_json)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = AttentionBenchResult(cfg, name)
    total = len(cfg.seq_lens) * len(forward_method_names(cfg)) + len(cfg.decode_contexts) * (
        1 + len(cfg.ops))
    from tqdm import tqdm

    bar = tqdm(total=total, desc="bench attention", unit="row", disable=not progress)

    def report(row: Timing) -> None:
        bar.write(format_row(row))
        bar.update(1)
        if out_json is not None:
            write_json(out_json, result)

    with torch.no_grad():
        result.forward = bench_forward(cfg, device, report)
        result.decode = bench_decode(cfg, device, report)
    bar.close()
    if out_json is not None:
        write_json(out_json, result)
        plot_result(result, out_json.with_suffix(".png"))
    return result


def format_row(row: Timing) -> str:
    if row.status != "ok":
        return f"{row.method:<32} {row.length:>7}  {row.status}"
    extra = "" if row.peak_mib is None else f"  peak {row.peak_mib:9.1f} MiB"
    if row.held_mib is not None:
        extra += f"  holds {row.held_mib:9.3f} MiB"
    return (f"{row.method:<32} {row.length:>7}  {row.mean_ms:10.3f} ms +- {row.std_ms:8.3f}"
            f" ({row.runs} runs){extra}")


def write_json(path: Path, result: AttentionBenchResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(result.to_dict(), indent=2, allow_nan=False)
                              + "\n").encode())


def plot_result(result: AttentionBenchResult, path: Path) -> Path:
    """Log-log panels: forward ms against T (solid: softmax and chunked, dashed:
    recurrent), decode ms per token and the bytes a step reads against the context."""

    from nats.plotting import (
        PALETTE,
        Series,
        format_tokens,
        line_plot,
        save_png,
        stack,
    )

    # One colour per softmax method and per operator, the same in every panel.
    colors = dict(zip((*SOFTMAX_METHODS, *result.config.ops), itertools.cycle(PALETTE)))

    def series(rows: list[Timing], value: Callable[[Timing], float | None]) -> list[Series]:
        out = []
        for name in dict.fromkeys(r.method for r in rows):
            points = [(r.length, value(r)) for r in rows if r.status == "ok"
                      and r.method == name and value(r) is not None]
            if points:
                base = name.removesuffix("_chunked").removesuffix("_recurrent")
                out.append(Series(name, points, colors[base],
                                  dashed=name.endswith("_recurrent")))
        return out

    cfg = result.config
    where = (f"{result.device_name}, batch {cfg.batch}, {cfg.heads} head(s) of "
             f"{cfg.head_dim}, {cfg.dtype}")
    panels = [
        line_plot(series(result.forward, lambda r: r.mean_ms), xlabel="sequence length T",
                  ylabel="forward ms (mean)", title=f"one causal attention layer: {where}",
                  log_x=True, log_y=True, xfmt=format_tokens, size=(900, 480)),
        line_plot(series(result.decode, lambda r: r.mean_ms), xlabel="context length",
                  ylabel="ms per decoded token", title="decoding one token", log_x=True,
                  log_y=True, xfmt=format_tokens, size=(900, 420)),
        line_plot(series(result.decode, lambda r: r.held_mib), xlabel="context length",
                  ylabel="MiB held (KV cache or state)", title="decoding memory",
                  log_x=True, log_y=True, xfmt=format_tokens, size=(900, 420)),
    ]
    return save_png(stack(panels), path)


__all__ = ["AttentionBenchConfig", "AttentionBenchResult", "Timing", "default_config",
           "naive_softmax_attention", "run_attention_benchmark"]
