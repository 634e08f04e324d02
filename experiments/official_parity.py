"""Does a converted official NAtS-L checkpoint compute what the official code computes?

    python experiments/official_parity.py --official-src PATH/src --out runs/parity   # a GPU

``PATH`` is a checkout of automl/NeuralAttentionSearchLinear (not vendored here), and
flash-linear-attention (``fla``) must be importable (0.4.2 was used; the official setup.py
pins 0.4.0). The official kernels pass ``gk=None`` to two fla functions that no fla release
accepts it in, so the official side wraps them to drop it (``_accept_gk_none``).
transformers must be 4.x (with 5.17 every official case failed: "'list' object has no
attribute 'keys'"). The official package is also called ``nats``, so
each side runs in a process of its own:

1. ``--side official``: with the official source first on the path, build the official
   model for each case (small: our Triton kernels take head widths up to 128), give every
   norm weight and both branch weights of the gated output norm their own random values
   (so that a swapped or shared weight shows), scale the scorers up (so that few routes
   sit at a bf16 tie), and save the model (``save_pretrained``, safetensors), random
   token ids, its logits and each NAtS-L layer's routing logits and decisions.
2. ``--side ours``: convert each saved model (``nats.official.model_from_official``) and
   run the same ids with the Triton kernels under bf16 autocast and with the float32
   reference; report the logits' error against the official ones (in bf16 beside our own
   bf16 run's error against our float32 one, the scale of rounding) and how many route
   decisions differ, counting apart those whose two logits are within ``--tie`` of
   each other.

Writes ``report.json`` to ``--out`` and prints one line per case and precision. The
official side compiles its kernels for minutes per case on a cold machine; a case it
finished is not run again, so a run cut short resumes with the same ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

CASES = {
    # Two Gated DeltaNet layers and two NAtS-L layers, the released configs' settings.
    "base": dict(hidden_size=256, num_heads=2, head_dim=64, expand_v=2, num_attn_heads=4,
                 num_hidden_layers=4, gdn_layers=[0, 2], nats_block_size=64, vocab_size=512,
                 attn_qk_norm=True, attn_with_short_conv=True, decay_for_non_gdn_blocks=True,
                 attn_apply_pos_encoding=False, tie_word_embeddings=False, norm_eps=1e-6),
    # The official config class's default: RoPE on the softmax heads.
    "rope": dict(hidden_size=256, num_heads=2, head_dim=64, expand_v=2, num_attn_heads=4,
                 num_hidden_layers=2, gdn_layers=[0], nats_block_size=64, vocab_size=512,
                 attn_qk_norm=True, attn_with_short_conv=True, decay_for_non_gdn_blocks=True,
                 attn_apply_pos_encoding=True, tie_word_embeddings=False, norm_eps=1e-6),
    # Narrow heads, one softmax head per routing head, every layer NAtS-L, tied embeddings.
    # (Blocks of 128 are not a case: the official kernels read the linear state at a block
    # index where they saved one per 64-token piece, so the converter refuses them.)
    "allnats": dict(hidden_size=128, num_heads=2, head_dim=32, expand_v=2, num_attn_heads=2,
                    num_hidden_layers=2, gdn_layers=[], nats_block_size=64, vocab_size=256,
                    attn_qk_norm=True, attn_with_short_conv=True,
                    decay_for_non_gdn_blocks=True, attn_apply_pos_encoding=False,
                    tie_word_embeddings=True, norm_eps=1e-6),
}
LENGTHS = (512, 456)
"""Whole chunks, and a last chunk cut short."""


def _accept_gk_none() -> None:
    """Let fla's released functions take the ``gk=None`` the official kernels pass.

    The official code calls ``chunk_scaled_dot_kkt_fwd`` and ``recompute_w_u_fwd`` with a
    per-key gate ``gk`` that no fla release (0.4.0 to 0.5.0) accepts; a NAtS-L layer's
    gate is per head, so it passes None. Patched before the official modules bind the names.
    """
    import functools

    import fla.ops.common.chunk_scaled_dot_kkt as kkt
    import fla.ops.gated_delta_rule.wy_fast as wy

    def drop_gk(fn):
        @functools.wraps(fn)
        def call(*args, gk=None, **kwargs):
            if gk is not None:
                raise NotImplementedError("a per-key gate: no fla release computes it")
            return fn(*args, **kwargs)
        return call

    kkt.chunk_scaled_dot_kkt_fwd = drop_gk(kkt.chunk_scaled_dot_kkt_fwd)
    wy.recompute_w_u_fwd = drop_gk(wy.recompute_w_u_fwd)


def official_side(out: Path, cases: list[str]) -> None:
    _accept_gk_none()
    for name in cases:
        if (out / name / "done").exists():  # a run cut short resumes where it stopped
            print(f"official: {name} already done", flush=True)
            continue
        try:
            _official_case(out / name, CASES[name])
        except Exception:  # a case the official code refuses: report it, go on
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "case.error").write_text(traceback.format_exc())
        (out / name / "done").touch()
        print(f"official: {name} done", flush=True)


def _official_case(folder: Path, kwargs: dict) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import nats.models.natsl_attn_gdn as official  # the official package: registers it
    from nats.layers.natsl_attn_gdn import NeuralAttentionSearchLinearAttnGDN

    torch.manual_seed(0)
    config = official.NeuralAttentionSearchLineraAttnGDNConfig(**kwargs)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "nats_layer" in pname:
                p.mul_(50)
    model = model.cuda().eval()
    records: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.attn
        if isinstance(attn, NeuralAttentionSearchLinearAttnGDN):
            def sample(logits, _f=attn.nats_sample_func, _i=i, _r=records):
                _r[f"logits{_i}"] = logits.detach().float()
                routes = _f(logits)
                _r[f"routes{_i}"] = routes.detach().clone().float()
                return routes
            attn.nats_sample_func = sample
    model.save_pretrained(folder / "model", safe_serialization=True)
    for dtype in ("float32", "bfloat16"):
        model = model.to(getattr(torch, dtype))
        for t in LENGTHS:
            ids = torch.randint(0, kwargs["vocab_size"], (2, t),
                                generator=torch.Generator().manual_seed(t)).cuda()
            records.clear()
            try:
                with torch.no_grad():
                    logits = model(input_ids=ids, use_cache=False).logits.float()
            except Exception:  # a case the official kernels refuse: report it
                (folder / f"{dtype}-{t}.error").write_text(traceback.format_exc())
                continue
            save_file({"ids": ids.cpu(), "logits": logits.cpu(),
                       **{k: v.cpu().contiguous() for k, v in records.items()}},
                      str(folder / f"{dtype}-{t}.safetensors"))


def ours_side(out: Path, tie: float, cases: list[str]) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    from nats.model import NatsForCausalLM
    from nats.official import model_from_official

    report = []
    for name in cases:
        folder = out / name
        if (folder / "case.error").exists():
            report.append({"case": name,
                           "official_error": (folder / "case.error").read_text()[-600:]})
            continue
        converted = model_from_official(folder / "model").float()
        models = {}
        device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run
        for backend in ("reference", "triton" if device == "cuda" else "reference"):
            models[backend] = NatsForCausalLM(converted.config.replace(backend=backend))
            models[backend].load_state_dict(converted.state_dict())
            models[backend].to(device).eval()
        for dtype in ("float32", "bfloat16"):
            for t in LENGTHS:
                row = {"case": name, "official_dtype": dtype, "T": t}
                error = folder / f"{dtype}-{t}.error"
                if error.exists():
                    report.append({**row, "official_error": error.read_text()[-600:]})
                    continue
                ref = load_file(str(folder / f"{dtype}-{t}.safetensors"))
                ids = ref["ids"].to(device)
                backend = "reference" if dtype == "float32" or device == "cpu" else "triton"
                model = models[backend]
                autocast = torch.autocast(device, torch.bfloat16, enabled=dtype == "bfloat16")
                with torch.no_grad(), autocast:
                    result = model(ids)
                logits = result.logits.float().cpu()
                diff = (logits - ref["logits"]).abs()
                if dtype == "bfloat16":  # the scale of bf16 error: ours against our float32
                    with torch.no_grad():
                        exact = models["reference"](ids).logits.float().cpu()
                    row["own_bf16_mean_abs_error"] = float((logits - exact).abs().mean())
                row.update(backend=backend, logits_max_abs=float(ref["logits"].abs().max()),
                           max_abs_error=float(diff.max()), mean_abs_error=float(diff.mean()),
                           argmax_agreement=float((logits.argmax(-1)
                                                   == ref["logits"].argmax(-1)).float().mean()))
                flips = clear_flips = decisions = 0
                for i, routes in enumerate(result.routes):
                    if routes is None:
                        continue
                    # The last chunk's route reaches no query (the official layer sets it
                    # to both options).
                    theirs = ref[f"routes{i}"][:, :-1].argmax(-1)
                    margin = (ref[f"logits{i}"][:, :-1, ..., 0]
                              - ref[f"logits{i}"][:, :-1, ..., 1]).abs()
                    differ = routes[:, :-1].float().cpu().argmax(-1) != theirs
                    decisions += differ.numel()
                    flips += int(differ.sum())
                    clear_flips += int((differ & (margin > tie)).sum())
                row.update(route_decisions=decisions, route_flips=flips,
                           route_flips_beyond_tie=clear_flips)
                report.append(row)
                print(json.dumps(row), flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--official-src", type=Path, help="the official repository's src folder")
    p.add_argument("--out", type=Path, default=Path("runs/official-parity"))
    p.add_argument("--side", choices=("both", "official", "ours"), default="both")
    p.add_argument("--tie", type=float, default=0.05,
                   help="route logits closer than this are a tie that bf16 may break "
                        "either way")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                   help="which cases to run (default all)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.side == "official":
        official_side(args.out, args.cases)
        return
    if args.side == "both":
        if args.official_src is None:
            p.error("--official-src is needed to run the official side")
        here = Path(__file__).resolve()
        # The official source goes first: its package is also called `nats`.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(args.official_src.resolve()),
             *[x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]])}
        subprocess.run([sys.executable, str(here), "--side", "official", "--out",
                        str(args.out.resolve()), "--cases", *args.cases], env=env, cwd="/",
                       check=True)
    report = ours_side(args.out, args.tie, args.cases)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
