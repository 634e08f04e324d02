"""The serial state kernels (``state_fwd``, ``state_bwd``) at the benchmark model's head
shape (6 heads of 128), value block 32 (the default) against 16, at batch 1 and at a
training batch (run by hand: ``python benchmarks/profile_state_pass.py [OUT.json]``;
``DRY_RUN=1 TRITON_INTERPRET=1`` runs it at a tiny shape on the CPU).

At batch 1 these kernels run one program per (head, value block): 24 programs on a GPU of
132 SMs. A smaller value block doubles the programs. Each variant is timed alone on one
real pass's intermediates (``profile_gated_delta_rule.Pass``), its outputs compared with
the default config's and with themselves over repeats (a miscompiled or racy config shows).
"""

from __future__ import annotations

import json
import os
import sys

import profile_gated_delta_rule as gdr

HEADS = 6
CASES = ((32768, 32768), (16384, 16384), (16384, 4096), (131072, 131072))
"""(tokens, sequence length): prefill and training shapes of ``nats bench model``."""
VARIANTS = {"state_fwd": ((32, 4, 3), (16, 4, 3), (16, 4, 2), (16, 2, 3)),
            "state_bwd": ((32, 4, 2), (16, 4, 2), (16, 2, 2))}
"""Per kernel, (value block, warps, stages); the default first."""
if os.environ.get("DRY_RUN"):  # a check of this script under the CPU interpreter
    HEADS, CASES = 2, ((256, 256), (256, 128))


def main(out: str | None) -> None:
    gdr.HEADS = HEADS
    rows = []
    for tokens, seq_len in CASES:
        gdr.TOKENS = tokens
        p = gdr.Pass(seq_len)
        for step, variants in VARIANTS.items():
            tuner, default = gdr.KERNELS[step], None
            for bv, warps, stages in variants:
                old = gdr.pin(tuner, gdr.cfg(warps, stages, BV=bv))
                try:
                    outputs = gdr.flat(getattr(p, step)())
                    default = default or [t.clone() for t in outputs]
                    row = {"T": seq_len, "B": tokens // seq_len, "step": step, "BV": bv,
                           "warps": warps, "stages": stages, "ms": gdr.ms(getattr(p, step)),
                           "rel_vs_default": [gdr.rel(a, b) for a, b
                                              in zip(outputs, default, strict=True)],
                           "repeat_maxdiff": gdr.repeat_diffs(p, step, 3)}
                finally:
                    tuner.configs, tuner.cache = old, {}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
