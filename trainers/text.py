"""Byte-level text helpers: the default corpus, UTF-8 encoding and byte-model generation.

The default corpus is the Python standard library's own ``.py`` sources: real text that
every machine has, with no download. Loading corpora is :mod:`.text_data`'s work.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nats import NatsForCausalLM

THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages"})
"""Folders inside the standard library's tree that hold installed packages, not stdlib."""


def stdlib_sources() -> list[Path]:
    """This interpreter's standard library ``.py`` files, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in THIRD_PARTY_DIRS and d != "__pycache__"]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return sorted(found)


def encode_text(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as token ids ``[len]``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode_tokens(ids: Sequence[int]) -> str:
    """Text of byte token ids; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def generate_text(model: NatsForCausalLM, prompt: str, max_new_tokens: int,
                  **sampling: Any) -> str:
    """The continuation of ``prompt`` by a byte-level model (see ``NatsForCausalLM.generate``)."""
    if model.config.vocab_size < 256:
        raise ValueError(f"this model has vocab_size={model.config.vocab_size}; byte prompts "
                         "need a byte-level model (vocab_size >= 256)")
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one byte")
    device = next(model.parameters()).device
    ids = encode_text(prompt)[None].to(device)
    out = model.generate(ids, max_new_tokens, **sampling)
    return decode_tokens(out[0, ids.shape[1]:].tolist())
