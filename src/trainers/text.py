"""Text helpers: the default corpus and generating text from a prompt.

The default corpus is the Python standard library's own ``.py`` sources: real text that
every machine has, with no download. Loading corpora is :mod:`.text_data`'s work.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sysconfig
from pathlib import Path
from typing import Any

import torch

from nats import NatsForCausalLM

from .tokenization import ByteTokenizer, Tokenizer

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


@functools.cache
def stdlib_bytes() -> torch.Tensor:
    """The standard library's ``.py`` sources, concatenated (uint8; ~30 MB, read once)."""
    data = b"".join(path.read_bytes() for path in stdlib_sources())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def stdlib_fingerprint() -> dict[str, Any]:
    """Which standard library the default corpus and the needle's text haystacks come from:
    this interpreter's, so they change with the Python version, and results on them compare
    only at one fingerprint (a needle result that did not reproduce had none recorded:
    docs/RESULTS.md)."""
    return dict(_stdlib_fingerprint())


@functools.cache
def _stdlib_fingerprint() -> tuple[tuple[str, Any], ...]:
    data = stdlib_bytes()  # the bytes a needle run has read already
    return (("python", platform.python_version()), ("files", len(stdlib_sources())),
            ("bytes", data.numel()), ("sha256", hashlib.sha256(data.numpy()).hexdigest()))


def generate_text(model: NatsForCausalLM, prompt: str, max_new_tokens: int,
                  tokenizer: Tokenizer | None = None, **sampling: Any) -> str:
    """The continuation of ``prompt`` (see ``NatsForCausalLM.generate``), tokenized as the
    model was trained: UTF-8 bytes by default, else ``tokenizer``; only ids the tokenizer
    can decode are generated (a model's vocabulary may hold more, e.g. a task's markers)."""
    tokenizer = tokenizer or ByteTokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"this model has vocab_size={model.config.vocab_size}, fewer than the "
                         f"{tokenizer.vocab_size} tokens of {tokenizer!r}: text prompts need "
                         "the tokenizer the model was trained with (--tokenizer)")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty: generation needs at least one token")
    device = next(model.parameters()).device
    prompt_ids = torch.tensor([ids], device=device)
    out = model.generate(prompt_ids, max_new_tokens, vocab_limit=tokenizer.vocab_size,
                         **sampling)
    return tokenizer.decode(out[0, len(ids):].tolist())
