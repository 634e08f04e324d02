"""A graphed batch-1 prefill split into the graph's replay and the host's finish, per model
form (run by hand on a GPU; no pytest): ``python benchmarks/split_graphed_prefill.py
[LENGTH ...] [--out OUT.json]``.

The model of ``nats bench model`` (12 layers, width 768, bf16 autocast) as NAtS-L at a
forced quarter softmax and the layer hybrid of the same share, each prefilling a prompt of
``LENGTH`` tokens (default 4096 and 32768) through :class:`nats.cuda_graph.GraphedPrefill`
as ``nats bench model --cuda-graph`` does. After two calls (the capture, then a replay),
three timings, each the median of :data:`REPEATS` calls after :data:`WARMUP`, timed on the
host from an idle GPU to an idle GPU (:func:`nats.latency.median_ms`), and each taken twice
in turn: the whole call (what ``nats bench model`` times), the replay alone (the copy of
the ids it reads, then the graph), and the finish alone (the cache built from the replay's
outputs: the NAtS-L stores' sizes read, the stores packed, every other cache tensor copied
out of the graph's memory). What the whole call
spends beyond the two is the logits' copy and the call's own host work.

Compare forms within one run: the same code's whole call moves by several per cent from
one process to the next (docs/BENCHMARKS.md, "What bounds the graphed prefill").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nats.cuda_graph import GraphedPrefill
from nats.evaluation.model_bench import default_config, variant_model, variants
from nats.latency import median_ms

FORMS = ("nats@0.25", "layer-hybrid")
"""The forms timed: the token-level hybrid and the layer-level one of the same share."""
LENGTHS = (4096, 32_768)
REPEATS = 25
WARMUP = 5


def split(prefill: GraphedPrefill, ids: torch.Tensor) -> dict[str, list[float]]:
    """The whole call, the replay and the finish of ``prefill(ids)``, each timed twice."""
    prefill(ids)
    prefill(ids)  # the first replay
    (captured,) = prefill.graphs.values()

    def replay() -> None:
        captured.ids.copy_(ids)
        captured.graph.replay()

    parts = {"whole": lambda: prefill(ids), "replay": replay,
             "finish": lambda: prefill.model.prompt_cache(captured.caches, ids, own=True)}
    figures: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(2):
        for name, fn in parts.items():
            ms = median_ms(fn, ids.device, warmup=WARMUP, repeats=REPEATS)
            figures[name].append(round(ms, 3))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lengths", nargs="*", type=int, help="default 4096 32768")
    parser.add_argument("--out", type=Path, help="the figures as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("split_graphed_prefill.py: needs a CUDA GPU (a CUDA graph's replay)")
    device = torch.device("cuda")
    try:
        config = default_config("cuda", prefill_lens=args.lengths or LENGTHS)
    except ValueError as error:
        raise SystemExit(f"split_graphed_prefill.py: {error}") from None
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "repeats": REPEATS,
                                 "forms": {}}
    for variant in [v for v in variants(config) if v.name.startswith(FORMS)]:
        model = variant_model(variant, config, device).eval()
        for length in config.prefill_lens:
            ids = torch.randint(0, config.vocab_size, (1, length), device=device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                figures = split(GraphedPrefill(model), ids)
            report["forms"].setdefault(variant.name, []).append({"length": length, **figures})
            print(f"{variant.name} at {length}: " + ", ".join(
                f"{name} {' / '.join(f'{ms:.2f}' for ms in times)} ms"
                for name, times in figures.items()), flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
