"""Emulate, in PyTorch on the CPU, where the bf16 Triton GDR rounds, to see which rounding
drives the route gradient's error (run by hand: ``python benchmarks/emulate_gdr_rounding.py
[T H seed]``; about 10 s a variant at T = 8192, H = 4).

Chunk 64 (one kernel chunk per routing chunk), dense B = 1, the GPU test's inputs. Each
rounding point of the kernels (bf16 storage, bf16 / tf32 dot operands) is applied to
float64 values; everything else is float64. The reference is the same pass with no rounding
(inputs rounded to bf16 as the test's reference sees them). The Triton interpreter cannot do
this: its bf16 dot multiplies the raw uint16 bits. Result (docs/history/GDR_PERF.md): forming
u = A (beta * v) from a bf16-rounded ``beta * v`` gives ~1.05e-2 droutes error; folding
beta into A's columns (what the kernels now do) gives ~3e-3, as float32 A did.
"""
# ruff: noqa
import sys, torch, torch.nn.functional as F
D = torch.float64

def bf(x):  # round to bf16
    return x.to(torch.bfloat16).to(D)

def tf32(x):  # round-to-nearest to 10 mantissa bits
    x32 = x.to(torch.float32)
    i = x32.view(torch.int32)
    i = (i + 0x1000) & ~0x1FFF
    return i.view(torch.float32).to(D)

def make(T=8192, H=4, K=128, seed=8192, frac=0.25, chunk=64):
    """The GPU test's inputs in float32: ``gdr_inputs(1, T, H, K, K, seed=seed)`` and
    ``routes_with_softmax_fraction(1, T // chunk, H, frac)`` of tests/kernels/inputs.py
    (tests/test_benchmarks.py checks that the two stay the same)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = (F.normalize(r(1, T, H, K), dim=-1) for _ in range(2))
    x = dict(q=q, k=k, v=r(1, T, H, K), g=F.logsigmoid(r(1, T, H) + 3), beta=torch.sigmoid(r(1, T, H)), initial_state=r(1, H, K, K))
    linear = torch.rand(1, T // chunk, H, generator=torch.Generator().manual_seed(0)) >= frac
    return x, F.one_hot(linear.long(), 2).float()

def run(x, routes, cfg, C=64):
    """Returns dz [N, H] (linear routes grad) of the emulated kernel and the cotangents."""
    rd = {n: (bf(x[n].to(D)) if cfg.get("inputs_bf16", True) else x[n].to(D))
          for n in ("q", "k", "v", "g", "beta")}
    q, k, v, g, beta = (rd[n][0].movedim(1, 0) for n in ("q", "k", "v", "g", "beta"))  # [H,T,..]
    h0 = x["initial_state"][0].to(D)
    H, T, K = k.shape
    V = v.shape[-1]
    N = T // C
    scale = K ** -0.5
    ch = lambda t: t.reshape(H, N, C, *t.shape[2:])
    q, k, v, g, beta = ch(q), ch(k), ch(v), ch(g), ch(beta)
    z = routes[0, :, :, 1].to(D).T  # [H, N]
    gc = g.to(torch.float32).cumsum(-1).to(D)  # fp32 cumsum
    incl = torch.ones(C, C, dtype=torch.bool).tril()
    strict = incl.tril(-1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    L = (beta[..., :, None] * decay * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=D)
    A = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    xk = k * (beta * gc.exp())[..., None]
    xv = v * beta[..., None]
    ah = cfg["A"]
    R = {"none": lambda t: t, "tf32": tf32, "bf16": bf}
    if isinstance(ah, tuple):  # (A round, xk round, xv round, fold)
        ra, rk, rv, fold = ah
        if fold == "pre":  # A stored bf16, then (A diag(s)) rounded again
            w = bf(bf(A) * (beta * gc.exp())[..., None, :]) @ k
            u = bf(bf(A) * beta[..., None, :]) @ v
        elif fold:  # (A diag(s)) rounded, times the exact bf16 K / V
            w = R[ra](A * (beta * gc.exp())[..., None, :]) @ k
            u = R[ra](A * beta[..., None, :]) @ v
        else:
            w, u = R[ra](A) @ R[rk](xk), R[ra](A) @ R[rv](xv)
    elif ah == "bf16":
        w, u = bf(A) @ bf(xk), bf(A) @ bf(xv)
    elif ah == "tf32":
        w, u = tf32(A) @ tf32(xk), tf32(A) @ tf32(xv)
    elif ah == "tf32_xbf":
        w, u = tf32(A) @ bf(xk), tf32(A) @ bf(xv)
    elif ah == "split":
        hi = bf(A); lo = bf(A - hi)
        w, u = hi @ bf(xk) + lo @ bf(xk), hi @ bf(xv) + lo @ bf(xv)
    elif ah == "fp16":
        A16 = A.to(torch.float16).to(D)
        w, u = A16 @ bf(xk), A16 @ bf(xv)
    else:
        w, u = A @ xk, A @ xv
    if cfg.get("wu_round", True):
        w, u = bf(w), bf(u)
    gL = gc[..., -1]
    kd = k * (gL[..., None] - gc).exp()[..., None]
    kdr = bf(kd)
    # forward state
    hs, vns = [], []
    S = h0.clone()
    for i in range(N):
        hs.append(S)
        Sr = bf(S) if cfg.get("h_round", True) else S
        vn = u[:, i] - w[:, i] @ Sr
        vnr = bf(vn) if cfg.get("vn_round", True) else vn
        vns.append(vnr)
        S = S * gL[:, i, None, None].exp() + z[:, i, None, None] * (kdr[:, i].transpose(-1, -2) @ vnr)
    o_state = S
    vn = torch.stack(vns, 1)
    # cotangents as the test: randn(o.shape) then state
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(1, T, H, V, generator=gen).to(D)
    dht = torch.randn(1, H, K, V, generator=gen).to(D)[0]
    do = bf(do)[0].movedim(1, 0).reshape(H, N, C, V)
    # dv_local = (k q^T decay^T scale).bf16 @ do
    mt = (k @ q.transpose(-1, -2)) * decay.transpose(-1, -2) * scale
    dvl = bf(mt) @ do
    if cfg.get("dvl_half", False):
        dvl = bf(dvl)
    elif cfg.get("dvl_fp32", True):
        dvl = dvl.float().to(D)
    qd = bf(q * (gc.exp() * scale)[..., None])
    dS = dht.clone()
    dz = torch.zeros(H, N, dtype=D)
    for i in reversed(range(N)):
        dSr = bf(dS)
        dhz = z[:, i, None, None] * dS
        dv = dvl[:, i] + kdr[:, i] @ bf(dhz)
        sel = z[:, i] > 0.5
        if cfg.get("dz_exact", False):
            contrib = ((kd[:, i] @ dS) * vn[:, i]).sum((-1, -2))
        else:
            contrib = ((kdr[:, i] @ dSr) * vn[:, i]).sum((-1, -2))
        dz[:, i] = torch.where(sel, contrib, 0.0)
        dv_r = bf(dv)
        dS = dS * gL[:, i, None, None].exp() + qd[:, i].transpose(-1, -2) @ do[:, i] - w[:, i].transpose(-1, -2) @ dv_r
    return dz.T  # [N, H]

def rel(a, b):
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()

if __name__ == "__main__":
    torch.set_num_threads(2)
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    H = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else T
    x, routes = make(T, H, seed=seed)
    exact = run(x, routes, {"A": "exact", "wu_round": False, "h_round": False, "vn_round": False, "dz_exact": True, "dvl_fp32": False, "inputs_bf16": True})
    # bf16 rounding of inputs stays (the reference gets the same rounded inputs)
    for name, cfg in [
        ("A float32 (tf32 dots), dvl float32", {"A": "tf32"}),
        ("A bf16, beta*v rounded (76af0c4)", {"A": "bf16", "dvl_half": True}),
        ("A tf32, beta*v rounded", {"A": ("tf32", "tf32", "bf16", False), "dvl_half": True}),
        ("A tf32, beta exp(gc) k rounded", {"A": ("tf32", "bf16", "tf32", False),
                                            "dvl_half": True}),
        ("A bf16, scales folded (now)", {"A": ("bf16", "", "", "pre"), "dvl_half": True}),
    ]:
        got = run(x, routes, cfg)
        print(f"{name:32s} droutes rel {rel(got, exact):.3e}", flush=True)
