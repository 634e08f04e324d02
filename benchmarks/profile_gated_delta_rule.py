"""Per-kernel times of the Triton hybrid gated delta rule, and launch-config variants of each
(run by hand on a GPU; no pytest): ``python benchmarks/profile_gated_delta_rule.py [OUT]``.

Shape of ``nats bench kernels``: bf16, B*T = 65,536, H = 16, Dk = Dv = 128, chunk 64, 25 %
softmax chunks. Every kernel is timed alone on the intermediates of one real pass
(``triton.testing.do_bench``, median). Each variant pins one config of one kernel; its
outputs are compared with the default config's, so a miscompiled config shows as a large
difference (configs only change rounding, ~1e-3 in bf16). Writes JSON to ``OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from nats.kernels import num_chunks
from nats.kernels.bench import BenchShape
from nats.kernels.triton import gated_delta_rule_bwd as B
from nats.kernels.triton import gated_delta_rule_fwd as Fw
from nats.kernels.triton.gated_delta_rule import KERNEL_CHUNK, hybrid_gated_delta_rule
from nats.kernels.triton.utils import chunk_map

SHAPE = BenchShape()
"""The registry's shape (``nats bench kernels``): tokens, linear heads and width, chunk."""
FRAC = 0.25
SEQ_LENS = (8192, 32768)
DEVICE = "cuda"
if os.environ.get("DRY_RUN"):  # a check of this script under the CPU interpreter
    SHAPE = BenchShape(tokens=256, seq_lens=(128, 256), heads=2, head_dim_linear=32)
    SEQ_LENS, DEVICE = (128, 256), "cpu"
TOKENS, HEADS, DIM, CHUNK = SHAPE.tokens, SHAPE.heads, SHAPE.head_dim_linear, SHAPE.chunk_size


def inputs(seq_len: int, seed: int = 0):
    batch = TOKENS // seq_len
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=DEVICE)

    q, k = (F.normalize(randn(batch, seq_len, HEADS, DIM), dim=-1).bfloat16() for _ in range(2))
    v = randn(batch, seq_len, HEADS, DIM).bfloat16()
    g = F.logsigmoid(randn(batch, seq_len, HEADS) + 3)
    beta = torch.sigmoid(randn(batch, seq_len, HEADS))
    n = num_chunks(seq_len, CHUNK)
    linear = (torch.rand(batch, n, HEADS, generator=gen, device=DEVICE) >= FRAC).long()
    routes = F.one_hot(linear, 2).float()
    do = randn(batch, seq_len, HEADS, DIM).bfloat16()
    return q, k, v, g, beta, routes, do


class Pass:
    """The intermediates of one forward+backward, packed as the operator packs them."""

    def __init__(self, seq_len: int):
        q, k, v, g, beta, routes, do = inputs(seq_len)
        batch = q.shape[0]
        self.cmap = chunk_map(batch, seq_len, batch * routes.shape[1], CHUNK, q.device)
        p = [t.reshape(1, batch * seq_len, *t.shape[2:]).contiguous()
             for t in (q, k, v, g, beta, do)]
        self.q, self.k, self.v, self.g, self.beta, self.do = p
        self.z = routes[..., 1].reshape(-1, HEADS).contiguous()
        self.bt = min(CHUNK, KERNEL_CHUNK)
        self.r, self.scale = CHUNK // self.bt, DIM**-0.5
        self.run_all()

    def run_all(self) -> None:
        s = self
        s.gc, s.a, s.w, s.u = s.wy_fwd()
        s.h, s.v_new, _ = s.state_fwd()
        s.o = s.output()
        s.dvl = s.dv_local()
        s.dh, s.dv_new, s.dz, s.dgs, _ = s.state_bwd()
        s.dq, s.dk_part, s.dw, s.dgc = s.dqkwg()
        s.grads = s.wy_bwd()

    def wy_fwd(self):
        return Fw.wy_fwd(self.k, self.v, self.g, self.beta, self.cmap, self.bt, self.r)

    def wu(self):
        return Fw.wy_fwd(self.k, self.v, self.g, self.beta, self.cmap, self.bt, self.r,
                         saved=(self.gc, self.a))

    def state_fwd(self):
        return Fw.state_fwd(self.k, self.w, self.u, self.gc, self.z, None, False, self.cmap,
                            self.bt, self.r)

    def output(self):
        return Fw.output_fwd(self.q, self.k, self.v_new, self.gc, self.h, self.scale,
                             torch.bfloat16, self.cmap, self.bt, self.r)

    def dv_local(self):
        return B.dv_local(self.q, self.k, self.do, self.gc, self.scale, self.cmap, self.bt, self.r)

    def state_bwd(self):
        return B.state_bwd(self.q, self.k, self.w, self.do, self.v_new, self.gc, self.z, self.h,
                           None, False, False, self.scale, self.cmap, self.bt, self.r)

    def dqkwg(self):
        return B.dqkwg(self.q, self.k, self.v_new, self.do, self.dv_new, self.gc, self.h, self.dh,
                       self.scale, self.cmap, self.bt, self.r)

    def wy_bwd(self):
        return B.wy_bwd(self.k, self.v, self.g, self.beta, self.gc, self.a, self.dw, self.dv_new,
                        self.dk_part, self.dgc, self.dgs, self.cmap, self.bt, self.r)


KERNELS = {  # step name -> its autotuner (state_bwd's step includes a dv_local launch)
    "wy_fwd": Fw._wy_kernel,
    "wu": Fw._wu_kernel,
    "state_fwd": Fw._state_fwd_kernel,
    "output": Fw._output_kernel,
    "dv_local": B._dv_local_kernel,
    "state_bwd": B._state_bwd_kernel,
    "dqkwg": B._dqkwg_kernel,
    "wy_bwd": B._wy_bwd_kernel,
}


def cfg(nw: int, ns: int = 2, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=nw, num_stages=ns)


VARIANTS = {  # step -> list of (label, config, module overrides); the defaults are first
    "wy_fwd": [(f"{'tf32' if tf32 else 'ieee'} inverse w{nw}", cfg(nw), {"TF32_INVERSE": tf32})
               for tf32 in (Fw.TF32_INVERSE, not Fw.TF32_INVERSE) for nw in (2, 4)],
    "state_fwd": [(f"BV{bv} w{nw} s{ns}", cfg(nw, ns, BV=bv), {})
                  for bv, nw, ns in ((32, 4, 3), (32, 4, 2))],
    "state_bwd": [(f"BV{bv} w{nw} s{ns}", cfg(nw, ns, BV=bv), {})
                  for bv, nw, ns in ((32, 4, 2), (16, 4, 2), (32, 4, 3))],
    "dqkwg": [(f"BK{bk} BV{bv} w{nw} s{ns}", cfg(nw, ns, BV=bv), {"DQKWG_BLOCK_K": bk})
              for bk, bv, nw, ns in ((64, 64, 4, 1), (64, 32, 4, 1), (128, 64, 4, 1))],
    "wy_bwd": [(f"BK{bk} BV{bv} w{nw} s{ns}", cfg(nw, ns, BV=bv), {"WY_BWD_BLOCK_K": bk})
               for bk, bv, nw, ns in ((64, 64, 4, 1), (64, 32, 4, 1), (128, 64, 4, 1))],
}


def owner(setting: str):
    """The kernel module that holds a module-level ``setting``."""
    return B if hasattr(B, setting) else Fw


def repeat_diffs(p: Pass, name: str, runs: int = 3) -> list[float]:
    """Largest |difference| of each output over repeated runs with one config: any
    non-zero value means the kernel is not deterministic (a race, or atomics' order)."""
    first = flat(getattr(p, name)())
    worst = [0.0] * len(first)
    for _ in range(runs - 1):
        again = flat(getattr(p, name)())
        worst = [max(w, (a.double() - b.double()).abs().max().item())
                 for w, a, b in zip(worst, again, first, strict=True)]
    return worst


def flat(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ms(fn) -> float:
    if DEVICE == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def pin(tuner, config: triton.Config) -> list[triton.Config]:
    old = tuner.configs
    tuner.configs = [config]
    tuner.cache = {}
    return old


def dump(report: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as fh:
            json.dump(report, fh, indent=1)


def end_to_end(seq_len: int) -> tuple[float, float]:
    """Forward and forward+backward through autograd, default configs (ms)."""
    q, k, v, g, beta, routes, do = inputs(seq_len)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]

    def fwd() -> torch.Tensor:
        return hybrid_gated_delta_rule(*leaves, routes, CHUNK)[0]

    return ms(fwd), ms(lambda: torch.autograd.grad(fwd(), leaves, do))


def fla_kernels(seq_len: int) -> dict | None:
    """fla's ``chunk_gated_delta_rule`` on the same inputs (no routes): end to end and per
    CUDA kernel (torch.profiler, per call). Its guard against Triton < 3.7.1 on Hopper is
    lifted so that its backward can be timed; those gradients are not used."""
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True
    q, k, v, g, beta, _, do = inputs(seq_len)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]

    def fwd() -> torch.Tensor:
        return chunk_gated_delta_rule(*leaves)[0]

    def fwd_bwd() -> None:
        torch.autograd.grad(fwd(), leaves, do)

    report = {"fwd_ms": ms(fwd), "fwd_bwd_ms": ms(fwd_bwd)}
    calls = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fwd_bwd()
        torch.cuda.synchronize()
    report["kernels_ms"] = {e.key: e.device_time_total / 1e3 / calls for e in prof.key_averages()
                            if e.device_time_total > 0}
    return report


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    report: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                    "triton": triton.__version__}
    for seq_len in SEQ_LENS:
        p = Pass(seq_len)
        base = {name: getattr(p, name)() for name in KERNELS}
        times = {name: ms(getattr(p, name)) for name in KERNELS}
        picked = {name: str(getattr(t, "best_config", "?")) for name, t in KERNELS.items()}
        print(f"T={seq_len} default per-kernel ms: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                  times.items()), flush=True)
        print("  autotuned:", picked, flush=True)
        repeats = {name: repeat_diffs(p, name) for name in KERNELS}
        print("  repeat max |diff| per output: " + "; ".join(
            f"{k} {' '.join(f'{x:.1e}' for x in v)}" for k, v in repeats.items()), flush=True)
        rows = []
        for name, variants in VARIANTS.items():
            if seq_len != SEQ_LENS[0] and name not in ("state_fwd", "state_bwd"):
                continue
            tuner = KERNELS[name]
            want = flat(base[name])
            for label, config, mod in variants:
                saved_mod = {k2: getattr(owner(k2), k2) for k2 in mod}
                for k2, v2 in mod.items():
                    setattr(owner(k2), k2, v2)
                old = pin(tuner, config)
                try:
                    got = flat(getattr(p, name)())
                    errs = [rel(a, b) for a, b in zip(got, want, strict=True)]
                    per = " ".join(f"{e:.1e}" for e in errs)
                    t = ms(getattr(p, name))
                    rows.append({"T": seq_len, "kernel": name, "variant": label, "ms": t,
                                 "rel_diffs": errs})
                    print(f"  T={seq_len} {name:9s} {label:28s} {t:7.3f} ms  diffs {per}",
                          flush=True)
                except Exception as e:  # a config that fails to compile or launch is reported
                    print(f"  T={seq_len} {name:9s} {label:16s} FAILED {type(e).__name__}: "
                          f"{str(e)[:160]}", flush=True)
                    rows.append({"T": seq_len, "kernel": name, "variant": label,
                                 "error": str(e)[:300]})
                finally:
                    tuner.configs = old
                    tuner.cache = {}
                    for k2, v2 in saved_mod.items():
                        setattr(owner(k2), k2, v2)
                report[str(seq_len)] = {"default_ms": times, "autotuned": picked,
                                        "variants": rows, "repeat_max_abs_diff": repeats}
                dump(report, out)
        report[str(seq_len)] = {"default_ms": times, "autotuned": picked, "variants": rows,
                                "repeat_max_abs_diff": repeats}
        f, fb = end_to_end(seq_len)
        report[str(seq_len)]["e2e"] = {"fwd_ms": f, "fwd_bwd_ms": fb}
        print(f"T={seq_len} end to end: fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms", flush=True)
        if DEVICE == "cuda" and (fla := fla_kernels(seq_len)) is not None:
            report[str(seq_len)]["fla"] = fla
            print(f"T={seq_len} fla: fwd {fla['fwd_ms']:.3f} ms, fwd+bwd {fla['fwd_bwd_ms']:.3f} "
                  "ms; per kernel: " + ", ".join(f"{k[:40]} {v:.3f}" for k, v in sorted(
                      fla["kernels_ms"].items(), key=lambda kv: -kv[1])), flush=True)
        dump(report, out)


if __name__ == "__main__":
    main()
