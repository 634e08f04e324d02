"""The kernels of one training step or prefill, per model form (run by hand on a GPU; no
pytest): ``python benchmarks/profile_train_step.py [LENGTH ...] [--prefill] [--eager] [--out
OUT.json]``.

The model of ``nats bench model`` (12 layers, width 768, bf16 autocast, 16,384 tokens a
step) as NAtS-L at a forced quarter softmax, the layer hybrid of the same share, the
all-linear model and the transformer, trained as ``nats bench model --cuda-graph`` times
it (:func:`nats.evaluation.model_bench.training_step`: forward, backward, AdamW, the
routing statistics' commit; replayed from a CUDA graph unless ``--eager``) at each
``LENGTH`` (default 4096 and 16384). With ``--prefill``, each form's batch-1 prefill of
``LENGTH`` tokens instead (:func:`nats.evaluation.model_bench.prefill_call`: no gradient,
the cache built; default 4096 and 32768), as ``nats bench model --cuda-graph`` times it.
After the warm-up, the step's median wall time over
five calls, then ``torch.profiler`` over three: per form the kernel time and launches a
step, its kernels by time, and NAtS-L's kernels against the layer hybrid's (the
difference per kernel name, the largest first). ``DRY_RUN=1`` runs it on the CPU at ``nats
bench model --device cpu``'s shapes, eagerly, the operators' own CPU time standing in for
the kernels' (a check that it runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from nats.evaluation.kernel_profile import kernel_difference, kernel_profile, print_kernels
from nats.evaluation.model_bench import (
    default_config,
    prefill_call,
    training_step,
    variant_model,
    variants,
)
from nats.latency import median_ms

FORMS = ("nats@0.25", "layer-hybrid", "all-linear", "transformer")
"""The forms profiled: these names, and the layer hybrid at whatever share the config
gives (a quarter on the GPU). The first two are compared kernel by kernel."""
PREFILL_LENS = (4096, 32_768)
"""``--prefill``'s default lengths on a GPU: a short prompt and a long one."""
STEPS = 3
DEVICE = "cpu" if os.environ.get("DRY_RUN") else "cuda"


def profile_form(variant_name: str, step: Any, device: torch.device) -> dict[str, Any]:
    """The step's median wall ms, then its kernels over :data:`STEPS` profiled steps."""
    wall = median_ms(step, device, warmup=1, repeats=5)
    figures = {"wall_ms": wall, **kernel_profile(step, STEPS, device)}
    print(f"{variant_name}: {wall:.2f} ms a step, {figures['us_per_call'] / 1e3:.2f} ms of "
          f"kernel time in {figures['launches_per_call']:.0f} launches", flush=True)
    print_kernels(figures["kernels"][:25])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lengths", nargs="*", type=int,
                        help="default 4096 16384 (--prefill: 4096 32768)")
    parser.add_argument("--prefill", action="store_true",
                        help="profile the batch-1 prefill, not the training step")
    parser.add_argument("--eager", action="store_true", help="no CUDA graph")
    parser.add_argument("--out", type=Path, help="the figures as JSON")
    args = parser.parse_args()
    device = torch.device(DEVICE)
    try:
        if args.prefill:
            lengths = {"prefill_lens": args.lengths or (PREFILL_LENS if DEVICE == "cuda" else None)}
        else:
            lengths = {"train_lens": args.lengths or None}
        config = default_config(device.type, **lengths)
    except ValueError as error:
        raise SystemExit(f"profile_train_step.py: {error}") from None
    graphed = device.type == "cuda" and not args.eager
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cuda_graph": graphed, "steps": STEPS, "train_tokens": config.train_tokens,
        "measure": "prefill" if args.prefill else "train", "forms": {}, "difference": {}}
    for length in config.prefill_lens if args.prefill else config.train_lens:
        forms = {}
        for variant in [v for form in FORMS for v in variants(config)
                        if v.name.startswith(form)]:
            model = variant_model(variant, config, device)
            batch = 1 if args.prefill else config.train_tokens // length
            ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
            print(f"-- {variant.name} at {length}", flush=True)
            step = prefill_call(model, ids, graphed) if args.prefill \
                else training_step(model, ids, cuda_graph=graphed)
            forms[variant.name] = profile_form(variant.name, step, device)
            report["forms"].setdefault(variant.name, []).append({"length": length,
                                                                 **forms[variant.name]})
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        (a, pa), (b, pb) = list(forms.items())[:2]
        difference = kernel_difference(pa, pb)
        report["difference"][str(length)] = {"forms": [a, b], "kernels": difference}
        print(f"-- {a} minus {b} at {length}: {(pa['us_per_call'] - pb['us_per_call']) / 1e3:+.2f}"
              f" ms of kernel time, {pa['launches_per_call'] - pb['launches_per_call']:+.0f} "
              f"launches, {pa['wall_ms'] - pb['wall_ms']:+.2f} ms wall", flush=True)
        print_kernels(difference[:25])
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
