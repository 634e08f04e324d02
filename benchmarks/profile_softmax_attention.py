"""Where the softmax side's time goes, against SDPA's backends (run by hand on a GPU; no
pytest): ``python benchmarks/profile_softmax_attention.py [OUT]``.

Shape of ``nats bench kernels``: bf16, B*T = 65,536, 32 softmax heads of 64 (16 routing
heads, r = 2), chunk 64. Measures (``triton.testing.do_bench`` medians, ms):

* SDPA causal under each backend torch offers (the default first), and the names of the
  kernels the default runs, so the baseline is known;
* the forward, the dk/dv and the dq kernels of the operator with each launch config pinned
  (the autotuner's pick is printed too), with achieved TFLOP/s.

Every variant's output is compared with the default forward's, so a miscompiled config
shows as a large difference. Writes JSON to ``OUT``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nats.kernels.bench import BenchShape, random_routes
from nats.kernels.triton import softmax_attention as S
from nats.kernels.triton.utils import chunk_map

SHAPE = BenchShape()
"""The registry's shape (``nats bench kernels``): tokens, routing heads, r, chunk."""
CELLS = ((32768, 0.25), (32768, 1.0), (8192, 0.25), (8192, 1.0))
DEVICE = "cuda"
if os.environ.get("DRY_RUN"):  # a check of this script under the CPU interpreter
    SHAPE = BenchShape(tokens=256, seq_lens=(128, 256), heads=2, head_dim_linear=64,
                       chunk_size=32)
    CELLS, DEVICE = ((128, 0.5), (256, 1.0)), "cpu"
TOKENS, HEADS, R, CHUNK = SHAPE.tokens, SHAPE.heads, SHAPE.softmax_heads_per_head, SHAPE.chunk_size
DIM = SHAPE.head_dim_linear // R
"""Width of one softmax head."""
FWD = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 64, 4, 4), (64, 64, 4, 3),
       (128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 3)]
BWD = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (128, 64, 8, 2),
       (128, 64, 4, 2), (64, 64, 8, 2)]
if DEVICE == "cpu":
    FWD = BWD = [(32, 32, 4, 1)]


class Case:
    """Inputs and saved tensors of one (T, fraction) cell, packed as the operator packs them."""

    def __init__(self, seq_len: int, fraction: float):
        batch, hq = TOKENS // seq_len, HEADS * R
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32

        def randn(*s: int) -> torch.Tensor:
            return torch.randn(*s, device=DEVICE, generator=gen).to(dt)

        self.dense = [randn(batch, seq_len, hq, DIM) for _ in range(3)]
        self.q, self.k, self.v = (t.reshape(batch * seq_len, hq, DIM) for t in self.dense)
        self.do = randn(batch * seq_len, hq, DIM)
        n = -(-seq_len // CHUNK)
        routes = random_routes(batch, n, HEADS, fraction, torch.device(DEVICE), gen)
        self.routes = routes
        self.sel, self.before = S.softmax_chunk_list(routes)
        self.n_chunks = self.sel.shape[1]
        self.cmap = chunk_map(batch, seq_len, self.n_chunks, CHUNK, torch.device(DEVICE))
        self.total = batch * seq_len
        self.scale = DIM**-0.5
        self.flops_fwd = 4 * batch * hq * DIM * self.visible_pairs(seq_len, fraction)
        self.o, self.lse = self.fwd(S._attn_fwd, {})
        self.delta = (self.o.float() * self.do.float()).sum(-1).t().contiguous()

    @staticmethod
    def visible_pairs(seq_len: int, fraction: float) -> float:
        n = seq_len // CHUNK
        own = n * CHUNK * (CHUNK + 1) / 2
        return own + fraction * CHUNK * CHUNK * n * (n - 1) / 2

    def outs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full_like(self.q, float("nan")),
                torch.full((HEADS * R, self.total), float("nan"), device=DEVICE))

    def launch(self, kernel, grid_block: str, meta: dict, args: tuple, **const) -> None:
        """One launch: the autotuned kernel as the operator runs it, or ``kernel.fn`` with the
        config ``meta`` pinned (then its descriptors get their block rows here)."""
        grid = S._grid(grid_block, self.n_chunks, CHUNK, HEADS * R)
        const = dict(H=HEADS, R=R, C=CHUNK, DK=DIM, DV=DIM, **const)
        if meta:
            names = kernel.arg_names
            S._set_block_rows({**dict(zip(names, args, strict=False)), **meta})
            kernel[grid(meta)](*args, **const, **meta)
        else:
            kernel[grid](*args, **const)

    def fwd(self, kernel, meta: dict):
        o, lse = self.outs()
        self.launch(kernel, "BLOCK_M", meta, (
            self.q, self.k, self.v, S._descriptor(self.k), S._descriptor(self.v), o, lse,
            self.sel, self.before, *self.cmap, *self.q.stride()[:2], *self.k.stride()[:2],
            *self.v.stride()[:2], *o.stride()[:2], self.scale * S.LOG2E, self.n_chunks,
            self.total))
        return o, lse

    def dkdv(self, kernel, meta: dict):
        dk, dv = torch.empty_like(self.k), torch.empty_like(self.v)
        slots = S._dz_slots(CHUNK)
        dz = torch.zeros(HEADS * R, self.n_chunks, slots, device=DEVICE)
        self.launch(kernel, "BLOCK_N", meta, (
            self.k, self.v, self.q, self.do, dk, dv, dz, self.lse, self.delta, self.before,
            *self.cmap, *self.q.stride()[:2], *self.do.stride()[:2], *self.k.stride()[:2],
            *self.v.stride()[:2], *dk.stride()[:2], *dv.stride()[:2], dz.stride(0),
            self.scale * S.LOG2E, self.scale, self.total), ROUTE_GRAD=1, DZ_SLOTS=slots)
        return dk, dv, dz

    def dq(self, kernel, meta: dict):
        dq = torch.empty_like(self.q)
        self.launch(kernel, "BLOCK_M", meta, (
            self.k, self.v, S._descriptor(self.q), S._descriptor(self.k), S._descriptor(self.v),
            S._descriptor(self.do), dq, self.lse, self.delta, self.sel, self.before,
            *self.cmap, *self.k.stride()[:2], *self.v.stride()[:2], *dq.stride()[:2],
            self.scale * S.LOG2E, self.scale, self.n_chunks, self.total))
        return (dq,)


def _meta(cfg: tuple[int, int, int, int]) -> dict:
    m, n, w, s = cfg
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def _bench(fn) -> float:
    if DEVICE == "cpu":
        fn()
        return 0.0
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def sdpa_rows(seq_len: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, hq = TOKENS // seq_len, HEADS * R
    q, k, v = (torch.randn(batch, hq, seq_len, DIM, device=DEVICE, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    rows = []
    for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                           ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("efficient", [SDPBackend.EFFICIENT_ATTENTION])):
        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both() -> None:
            fwd().backward(do)

        try:
            if backends is None:
                f, b = _bench(fwd), _bench(both)
            else:
                with sdpa_kernel(backends):
                    f, b = _bench(fwd), _bench(both)
            rows.append(dict(seq_len=seq_len, sdpa=name, fwd_ms=f, fwd_bwd_ms=b))
        except Exception as e:  # a backend torch cannot run here is a finding, not an error
            rows.append(dict(seq_len=seq_len, sdpa=name, error=str(e).splitlines()[0][:200]))
        print(rows[-1], flush=True)
    if DEVICE == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            fwd_out.backward(do)
            torch.cuda.synchronize()
        names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
        rows.append(dict(seq_len=seq_len, sdpa_default_kernels=names))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "profile_softmax.json"
    rows: list[dict] = []

    def save() -> None:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)

    for seq_len in sorted({t for t, _ in CELLS}):
        rows += sdpa_rows(seq_len)
        save()
    for seq_len, fraction in CELLS:
        case = Case(seq_len, fraction)
        ref_o = case.o
        base = dict(seq_len=seq_len, fraction=fraction, gflop_fwd=case.flops_fwd / 1e9)
        ms = _bench(lambda c=case: c.fwd(S._attn_fwd, {}))
        rows.append(dict(base, kernel="fwd", config="autotuned " + str(S._attn_fwd.best_config)
                         if DEVICE == "cuda" else "interp", ms=ms))
        print(rows[-1], flush=True)
        for cfg in FWD:
            try:
                o, _ = case.fwd(S._attn_fwd.fn, _meta(cfg))
                err = _err(o, ref_o)
                ms = _bench(lambda c=case, g=cfg: c.fwd(S._attn_fwd.fn, _meta(g)))
                rows.append(dict(base, kernel="fwd", config=cfg, ms=ms, err=err,
                                 tflops=case.flops_fwd / ms / 1e9 if ms else None))
            except Exception as e:  # a config that fails to compile is a result
                rows.append(dict(base, kernel="fwd", config=cfg, error=str(e)[:300]))
            print(rows[-1], flush=True)
            save()
        ref_dkdv = case.dkdv(S._attn_bwd_dkdv, {})
        ref_dq = case.dq(S._attn_bwd_dq, {})
        for name, kern, ref, call in (("dkdv", S._attn_bwd_dkdv, ref_dkdv, case.dkdv),
                                      ("dq", S._attn_bwd_dq, ref_dq, case.dq)):
            ms = _bench(lambda c=call, k=kern: c(k, {}))
            rows.append(dict(base, kernel=name, config="autotuned " + str(kern.best_config)
                             if DEVICE == "cuda" else "interp", ms=ms))
            print(rows[-1], flush=True)
            for cfg in BWD:
                try:
                    got = call(kern.fn, _meta(cfg))
                    err = max(_err(a, b) for a, b in zip(got, ref, strict=True))
                    ms = _bench(lambda c=call, k=kern, g=cfg: c(k.fn, _meta(g)))
                    rows.append(dict(base, kernel=name, config=cfg, ms=ms, err=err))
                except Exception as e:  # a config that fails to compile is a result
                    rows.append(dict(base, kernel=name, config=cfg, error=str(e)[:300]))
                print(rows[-1], flush=True)
                save()
    save()


if __name__ == "__main__":
    main()
