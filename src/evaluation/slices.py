"""Task slices: one evaluation setting each (task, length and knobs) as a :class:`TrainConfig`.

A slice is the training config of the evaluated run (or the defaults, for an exported model)
with the task, length and knobs replaced, so its batches come from the trainer's own
:func:`build_batches` (the run's corpus and evaluation seed included) and a bad knob fails
with the config's one-line error.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from nats.trainers import TrainConfig

KNOBS = {"mqar": ("mqar_placement", "mqar_filler", "mqar_queries"),
         "needle": ("needle_distractors", "needle_haystack")}
"""The knobs each task's slices vary (every combination of the values given)."""
SHORT = {"mqar_pairs": "pairs", "mqar_placement": "placement", "mqar_filler": "filler",
         "mqar_queries": "queries", "needle_distractors": "distractors",
         "needle_haystack": "haystack"}


def slice_configs(base: TrainConfig, task: str, seq_lens: Sequence[int],
                  pairs: Sequence[int] = (), batch_size: int | None = None,
                  knobs: dict[str, Sequence[Any]] | None = None) -> list[TrainConfig]:
    """One config per length (zipped with ``pairs`` for MQAR: one value for all lengths or
    one per length) and per combination of the ``knobs`` values (unset: the base's)."""
    if not seq_lens:
        raise ValueError("--seq-len needs at least one length")
    if pairs and task != "mqar":
        raise ValueError(f"--pairs is an MQAR knob; task {task!r} has none")
    if len(pairs) > 1 and len(pairs) != len(seq_lens):
        raise ValueError(f"--pairs takes one value or one per --seq-len ({len(seq_lens)}), "
                         f"got {len(pairs)}")
    per_length = list(pairs) * len(seq_lens) if len(pairs) == 1 else list(pairs)
    knobs = {k: v for k, v in (knobs or {}).items() if v}
    for name in knobs:
        if name not in KNOBS.get(task, ()):
            raise ValueError(f"--{SHORT[name]} is not a knob of task {task!r}")
    names = [n for n in KNOBS.get(task, ()) if n in knobs]
    out = []
    for i, seq_len in enumerate(seq_lens):
        length = {"seq_len": seq_len}
        if per_length:
            length["mqar_pairs"] = per_length[i]
        for values in itertools.product(*(knobs[n] for n in names)):
            # A slice is one fixed task: a training mixture of pair counts does not apply.
            out.append(base.replace(task=task, grad_accum_steps=1, mqar_pairs_mix=(),
                                    batch_size=batch_size or base.batch_size,
                                    **length, **dict(zip(names, values, strict=True))))
    return out


def slice_params(config: TrainConfig) -> dict[str, Any]:
    """The settings that tell a slice apart: length and the task's knobs."""
    params: dict[str, Any] = {"seq_len": config.seq_len}
    if config.task == "mqar":
        params["pairs"] = config.mqar_pairs
    params.update({SHORT[n]: getattr(config, n) for n in KNOBS.get(config.task, ())})
    return params


def slice_name(config: TrainConfig) -> str:
    """E.g. ``mqar seq_len=256 pairs=16 placement=start filler=random queries=power-law``."""
    return " ".join([config.task, *(f"{k}={v}" for k, v in slice_params(config).items())])
