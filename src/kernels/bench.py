"""`nats bench kernels`: the mixed operator against SDPA, FlexAttention and fla, on a GPU.

Every figure is a median of CUDA-event timings (``triton.testing.do_bench``) taken in one
run, so ratios against SDPA causal attention measured beside it are what to compare
across machines. The shapes: bf16, ``B*T`` tokens fixed, ``H`` routing
heads with linear heads of ``Dk = Dv = 128`` and ``r = 2`` softmax heads of 64 each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .ops import hybrid_gated_delta_rule, hybrid_softmax_attention
from .reference.chunks import CHUNK_SIZES, SOFTMAX
from .streams import concurrently


@dataclass(frozen=True)
class BenchShape:
    tokens: int = 65536
    seq_lens: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    fractions: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0)
    heads: int = 16
    softmax_heads_per_head: int = 2
    head_dim_linear: int = 128
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name in ("tokens", "heads", "softmax_heads_per_head", "head_dim_linear"):
            if not _count(getattr(self, name)):
                raise ValueError(f"BenchShape.{name} = {getattr(self, name)!r} must be an "
                                 "integer >= 1")
        if self.chunk_size not in CHUNK_SIZES:
            raise ValueError(f"BenchShape.chunk_size = {self.chunk_size!r} must be one of "
                             f"{CHUNK_SIZES}")
        if not self.seq_lens or not all(_count(t) and t <= self.tokens for t in self.seq_lens):
            raise ValueError(f"BenchShape.seq_lens = {list(self.seq_lens)} must be integers "
                             f"in [1, tokens = {self.tokens}] (a batch holds tokens // seq_len "
                             "sequences)")
        if not self.fractions or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                         and 0 <= f <= 1 for f in self.fractions):
            raise ValueError(f"BenchShape.fractions = {list(self.fractions)} must be numbers "
                             "in [0, 1]")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class BenchRow:
    seq_len: int
    fraction: float
    method: str
    fwd_ms: float
    fwd_bwd_ms: float
    extra: dict[str, float] = field(default_factory=dict)


def random_routes(batch: int, n_chunks: int, heads: int, fraction: float,
                  device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Exactly ``round(fraction * N)`` softmax chunks per (batch, head), at random places."""
    order = torch.rand(batch, n_chunks, heads, device=device, generator=generator).argsort(1)
    is_sm = order < round(fraction * n_chunks)
    return F.one_hot((~is_sm).long(), 2).float()


def make_inputs(shape: BenchShape, seq_len: int, device: torch.device, seed: int = 0):
    """Random bf16 inputs of the mixed operator (never zeros: they time differently)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, h, d = shape.tokens // seq_len, shape.heads, shape.head_dim_linear
    r = shape.softmax_heads_per_head

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=device, generator=gen, dtype=torch.bfloat16)

    sm = [randn(batch, seq_len, h * r, d // r) for _ in range(3)]
    lin = [F.normalize(randn(batch, seq_len, h, d).float(), dim=-1).bfloat16() for _ in range(2)]
    lin.append(randn(batch, seq_len, h, d))
    g = F.logsigmoid(torch.randn(batch, seq_len, h, device=device, generator=gen) + 4.0)
    beta = torch.rand(batch, seq_len, h, device=device, generator=gen)
    return sm, lin, g, beta, gen


def _timings(fn: Callable[[], tuple[torch.Tensor, ...]], leaves: list[torch.Tensor],
             ) -> tuple[float, float]:
    """Median forward and forward+backward milliseconds of ``fn``'s outputs.

    The backward is driven by fixed random output gradients, so no loss kernel is timed.
    """
    import triton.testing

    grads = [torch.randn_like(o) for o in fn()]

    def fwd_bwd() -> None:
        torch.autograd.backward(fn(), grads)

    fwd = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    both = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median",
                                   grad_to_none=leaves)
    return float(fwd), float(both)


def bench_seq_len(shape: BenchShape, seq_len: int, device: torch.device,
                  ) -> Iterator[BenchRow]:
    """All methods and fractions at one sequence length, each row as soon as it is measured."""
    sm, lin, g, beta, gen = make_inputs(shape, seq_len, device)
    batch, n_chunks = sm[0].shape[0], math.ceil(seq_len / shape.chunk_size)
    leaves = [t.requires_grad_() for t in (*sm, *lin, g, beta)]
    c = shape.chunk_size
    q, k, v = (t.transpose(1, 2) for t in sm)
    yield BenchRow(seq_len, 1.0, "sdpa_causal", *_timings(
        lambda: (F.scaled_dot_product_attention(q, k, v, is_causal=True),), leaves))
    fla = _fla_gated_delta_rule()
    if fla is not None:
        yield from _optional(seq_len, 0.0, "fla_chunk_gdr", lambda: (fla(*lin, g, beta)[0],),
                             leaves)

    for fraction in shape.fractions:
        routes = random_routes(batch, n_chunks, shape.heads, fraction, device, gen)

        def linear(routes: torch.Tensor = routes) -> torch.Tensor:
            return hybrid_gated_delta_rule(*lin, g, beta, routes, c, backend="triton")[0]

        def softmax(routes: torch.Tensor = routes) -> torch.Tensor:
            return hybrid_softmax_attention(*sm, routes, c, backend="triton")

        parts = {"softmax": _timings(lambda s=softmax: (s(),), leaves),
                 "linear": _timings(lambda li=linear: (li(),), leaves),
                 "sequential": _timings(lambda s=softmax, li=linear: (s(), li()), leaves)}
        yield BenchRow(seq_len, fraction, "nats_mixed", *_timings(
            lambda s=softmax, li=linear: concurrently(s, li, device), leaves),
            extra={f"{name}_{kind}_ms": t for name, (f, b) in parts.items()
                   for kind, t in (("fwd", f), ("fwd_bwd", b))})
        flex = _flex_softmax(sm, routes, shape)
        if flex is not None:
            yield from _optional(seq_len, fraction, "flex_mask+linear",
                                 lambda fl=flex, li=linear: (fl(), li()), leaves)


def _optional(seq_len: int, fraction: float, method: str,
              fn: Callable[[], tuple[torch.Tensor, ...]], leaves: list[torch.Tensor],
              ) -> list[BenchRow]:
    """A comparison from another library: its failure is reported, not fatal.

    fla, for one, refuses its backward on Hopper with Triton 3.4-3.7; the forward is
    then still timed.
    """
    import triton.testing

    try:
        return [BenchRow(seq_len, fraction, method, *_timings(fn, leaves))]
    except Exception as e:  # any failure of a third-party baseline is reported
        print(f"bench: {method} at T={seq_len}: {type(e).__name__}: {str(e)[:200]}")
    try:
        with torch.no_grad():
            fwd = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return [BenchRow(seq_len, fraction, method + " (fwd only)", float(fwd), math.nan)]
    except Exception as e:
        print(f"bench: {method} forward at T={seq_len}: {type(e).__name__}: {str(e)[:200]}")
        return []


def _fla_gated_delta_rule():
    """fla's chunked gated delta rule, when the optional ``fla-core`` package is there."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _flex_softmax(sm: list[torch.Tensor], routes: torch.Tensor, shape: BenchShape):
    """FlexAttention with NAtS-L's chunk mask (compiled), or None where it is missing."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    c, r = shape.chunk_size, shape.softmax_heads_per_head
    is_sm = routes[..., SOFTMAX] > 0.5
    batch, seq_len, heads = sm[0].shape[:3]

    def mask_mod(b, h, q_idx, kv_idx):
        q_chunk, kv_chunk = q_idx // c, kv_idx // c
        own = (q_chunk == kv_chunk) & (kv_idx <= q_idx)
        return own | ((kv_chunk < q_chunk) & is_sm[b, kv_chunk, h // r])

    # Compiled, so the mask is evaluated block by block, never as a dense [B, H, T, T];
    # blocks of one chunk, so that every block is wholly visible or wholly masked.
    block_mask = create_block_mask(mask_mod, batch, heads, seq_len, seq_len,
                                   device=sm[0].device, BLOCK_SIZE=c, _compile=True)
    compiled = torch.compile(flex_attention)
    q, k, v = (t.transpose(1, 2) for t in sm)
    tiles = {name: c for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                                  "BLOCK_N2")}  # kernel tiles must divide the mask blocks
    return lambda: compiled(q, k, v, block_mask=block_mask, kernel_options=tiles)


def run_benchmark(shape: BenchShape, out_json: Path | None) -> list[BenchRow]:
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU (timings on the CPU "
                           "interpreter mean nothing)")
    device = torch.device("cuda")
    rows: list[BenchRow] = []
    for seq_len in shape.seq_lens:
        new = []
        for row in bench_seq_len(shape, seq_len, device):
            new.append(row)
            rows.append(row)
            # Written after every row, so an interrupted run keeps what it measured.
            print(format_table([row], header=False, base=new[0]), flush=True)
            if out_json is not None:
                _write_json(out_json, shape, rows)
        torch.cuda.empty_cache()
        print(format_table(new), flush=True)
    return rows


def _write_json(path: Path, shape: BenchShape, rows: list[BenchRow]) -> None:
    import triton

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "shape": asdict(shape),
        "rows": [_json_row(r) for r in rows]}, indent=2, allow_nan=False) + "\n")
    tmp.replace(path)


def _json_row(row: BenchRow) -> dict:
    """``row`` as standard JSON: a time not measured (NaN) is null."""
    def plain(v: float) -> float | None:
        return None if math.isnan(v) else v
    return {**asdict(row), "fwd_ms": plain(row.fwd_ms), "fwd_bwd_ms": plain(row.fwd_bwd_ms),
            "extra": {k: plain(v) for k, v in row.extra.items()}}


def format_table(rows: list[BenchRow], header: bool = True, base: BenchRow | None = None) -> str:
    """One line per (T, fraction, method): milliseconds and ratios to SDPA at that T
    (``base``: that SDPA row, where ``rows`` lack it)."""
    sdpa = {r.seq_len: r for r in rows if r.method == "sdpa_causal"}
    if base is not None:
        sdpa.setdefault(base.seq_len, base)
    lines = [f"{'T':>6} {'frac':>6} {'method':<18} {'fwd ms':>8} {'f+b ms':>8} "
             f"{'fwd/sdpa':>9} {'f+b/sdpa':>9}"] if header else []
    for r in rows:
        ref = sdpa[r.seq_len]
        lines.append(f"{r.seq_len:>6} {r.fraction:>6.3f} {r.method:<18} {r.fwd_ms:>8.3f} "
                     f"{r.fwd_bwd_ms:>8.3f} {r.fwd_ms / ref.fwd_ms:>9.3f} "
                     f"{r.fwd_bwd_ms / ref.fwd_bwd_ms:>9.3f}")
    return "\n".join(lines)


__all__ = ["BenchRow", "BenchShape", "format_table", "random_routes", "run_benchmark"]
