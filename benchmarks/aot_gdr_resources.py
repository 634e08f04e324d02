"""Compile the GDR Triton kernels for sm_90 on a machine without a GPU and print each one's
registers, stack (spill) bytes, shared memory, local loads/stores and matrix instructions
(run by hand: ``python benchmarks/aot_gdr_resources.py [kernel ...]``).

Use the Triton of the GPU machine for numbers that match it, e.g.
``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``.
Pointer arguments are marked 16-byte aligned (and ``H`` divisible by 16, ``DIV_H=0`` to
drop that), as the JIT specialises them: without that, every load compiles to scalar
2-byte accesses and the spill counts are far too high.
"""
# ruff: noqa
import os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nats.kernels.bench import BenchShape
from nats.kernels.triton import gated_delta_rule_fwd as F, gated_delta_rule_bwd as B
from nats.kernels.triton.gated_delta_rule import KERNEL_CHUNK

TARGET = GPUTarget("cuda", 90, 32)
DIV_H = os.environ.get("DIV_H", "1") == "1"
BIN = os.path.dirname(triton.__file__) + "/backends/nvidia/bin/"

def jit(k):
    while not isinstance(k, triton.runtime.jit.JITFunction):
        k = k.fn
    return k

COMMON = dict(cu="*i32", chunk_offsets="*i32", chunk_seq="*i32", H="i32", scale="fp32",
              gc="*fp32", z="*fp32", dz="*fp32", dgs="*fp32", dgc="*fp32", dht="*fp32",
              dh0="*fp32", h0="*fp32", ht="*fp32", g="*fp32", beta="*fp32", dbeta="*fp32", dg="*fp32")

def rep(name, k, consts, nw, ns=2, types=None):
    jk = jit(k)
    types = dict(COMMON, **(types or {}))
    sig = {n: ("constexpr" if n in consts else types.get(n, "*bf16")) for n in jk.arg_names}
    try:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jk.arg_names)
                 if sig[n].startswith("*") or (n == "H" and DIV_H)}
        src = ASTSource(fn=jk, signature=sig, constexprs={(jk.arg_names.index(n),): v for n, v in consts.items()}, attrs=attrs)
        kk = triton.compile(src, target=TARGET, options={"num_warps": nw, "num_stages": ns})
    except Exception as e:
        print(f"{name:28s} w{nw} s{ns}: FAIL {type(e).__name__} {str(e)[:400]}", flush=True)
        return
    path = os.path.join(tempfile.gettempdir(), f"aot_{name}.cubin")
    open(path, "wb").write(kk.asm["cubin"])
    out = subprocess.run([BIN + "cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([BIN + "cuobjdump", "-sass", path], capture_output=True, text=True).stdout
    line = [l.strip() for l in out.splitlines() if "REG" in l][0].split()
    print(f"{name:28s} w{nw} s{ns}: {line[0]} {line[1]} smem {kk.metadata.shared:6d} "
          f"LDL {sass.count('LDL'):5d} STL {sass.count('STL'):5d} HGMMA {sass.count('HGMMA'):4d} "
          f"HMMA {sass.count('HMMA'):4d} LDG.U16 {sass.count('LDG.E.U16')} LDG.128 {sass.count('LDG.E.128')} STG.U16 {sass.count('STG.E.U16')}", flush=True)

SHAPE = BenchShape()  # the registry's shape (nats bench kernels): Dk = Dv, routing chunk
BT = min(SHAPE.chunk_size, KERNEL_CHUNK)
BASE = dict(K=SHAPE.head_dim_linear, V=SHAPE.head_dim_linear, BT=BT, R=SHAPE.chunk_size // BT, PREC="tf32")
if __name__ == "__main__":
    which = sys.argv[1:] or ["all"]
    def want(n): return "all" in which or n in which
    if want("dqkwg"):
        for nw in (2, 4, 8):
            rep("dqkwg_bk128", B._dqkwg_kernel, dict(BASE, BV=64, BK=128), nw); rep("dqkwg_bk64", B._dqkwg_kernel, dict(BASE, BV=64, BK=64), nw); rep("dqkwg_bk64_bv32", B._dqkwg_kernel, dict(BASE, BV=32, BK=64), nw)
    if want("wy_bwd"):
        for nw in (2, 4, 8):
            rep("wy_bwd", B._wy_bwd_kernel, dict(BASE, BV=64, BK=64), nw); rep("wy_bwd_bk128", B._wy_bwd_kernel, dict(BASE, BV=64, BK=128), nw); rep("wy_bwd_bk32", B._wy_bwd_kernel, dict(BASE, BV=64, BK=32), nw)
    if want("state_bwd"):
        for bv, nw, ns in ((32, 4, 2), (16, 4, 2), (64, 4, 2), (32, 8, 2), (16, 2, 2), (32, 4, 1)):
            rep(f"state_bwd_bv{bv}", B._state_bwd_kernel, dict(BASE, BV=bv, USE_DHT=True, STORE_DH0=True, DZ_MIN=0.5), nw, ns)
    if want("state_fwd"):
        for bv, nw, ns in ((32, 4, 3), (32, 4, 2), (16, 4, 3), (64, 4, 3), (32, 8, 3), (32, 4, 1)):
            rep(f"state_fwd_bv{bv}", F._state_fwd_kernel, dict(BASE, BV=bv, USE_H0=True, STORE_HT=True), nw, ns)
    if want("wy_fwd"):
        sa = dict(SAVED_A=False) if "SAVED_A" in jit(F._wy_kernel).arg_names else {}
        for nw in (2, 4, 8):
            rep("wy_fwd", F._wy_kernel, dict(BASE, **sa), nw)
        if hasattr(F, "_wu_kernel"):
            for nw in (2, 4):
                rep("wu", F._wu_kernel, dict(BASE), nw)
    if want("output"):
        for nw in (2, 4):
            rep("output", F._output_kernel, dict(BASE, BV=64), nw)
    if want("dv_local"):
        for nw in (2, 4):
            rep("dv_local", B._dv_local_kernel, dict(BASE), nw)
