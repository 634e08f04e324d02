"""The kernels of one decode step, per model form (run by hand on a GPU; no pytest):
``python benchmarks/profile_decode_step.py [CONTEXT ...] [--out OUT.json]``.

The model of ``nats bench model`` (12 layers, width 768, bf16) as NAtS-L at a forced
quarter softmax, the layer hybrid of the same share, the all-linear model and the
transformer, prefilled with ``CONTEXT`` tokens (default 131,072), then decoded as
``generate`` does on a GPU (:class:`nats.cuda_graph.GraphedDecoder`): after a warm-up
over one chunk close, ``torch.profiler`` over 16 replayed steps (one of which closes a
chunk). Prints per form the kernel time and the launches a step, then each kernel's time
and launches a step: the "step_profile" figures of docs/BENCHMARKS.md. ``DRY_RUN=1`` runs
it on the CPU at ``nats bench model --device cpu``'s shapes, eagerly, the operators' own
CPU time standing in for the kernels' (a check that it runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from nats.evaluation.decode_benchmark import warm_decoder
from nats.evaluation.kernel_profile import kernel_profile, print_kernels
from nats.evaluation.model_bench import default_config, variant_model, variants
from nats.model import NatsForCausalLM

FORMS = ("nats@0.25", "layer-hybrid", "all-linear", "transformer")
"""The forms profiled: these names, and the layer hybrid at whatever share the config
gives (a quarter on the GPU)."""
STEPS = 16


def profile_steps(model: NatsForCausalLM, context: int, device: torch.device,
                  steps: int = STEPS) -> dict[str, Any]:
    """Kernel time (µs) and launches a step over ``steps`` steps, in total and by kernel."""
    step, cache = warm_decoder(model, context, device, graphed=device.type == "cuda")
    return {"context": context, "kv_bytes": cache.kv_bytes(),
            **kernel_profile(step, steps, device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("contexts", nargs="*", type=int, help="default 131072")
    parser.add_argument("--out", type=Path, help="the figures as JSON")
    args = parser.parse_args()
    dry = bool(os.environ.get("DRY_RUN"))
    device = torch.device("cpu" if dry else "cuda")
    config = default_config(device.type)
    contexts = args.contexts or (list(config.decode_contexts) if dry else [131_072])
    report: dict[str, Any] = {"device": "cpu" if dry else torch.cuda.get_device_name(),
                              "steps": STEPS, "forms": {}}
    for variant in variants(config):
        if not variant.name.startswith(FORMS):
            continue
        model = variant_model(variant, config, device)
        model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
        for context in contexts:
            with torch.no_grad():
                figures = profile_steps(model, context, device)
            report["forms"].setdefault(variant.name, []).append(figures)
            print(f"{variant.name} at {context}: {figures['us_per_call']:.0f} us of kernel "
                  f"time and {figures['launches_per_call']:.0f} launches a step", flush=True)
            print_kernels(figures["kernels"][:25])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
