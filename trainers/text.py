"""Byte-level text (vocabulary 256) read from local files, split by file into train/val.

The default corpus is the Python standard library's own ``.py`` sources: real text that
every machine has, with no download.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nats import NatsForCausalLM

from .synthetic import Batch

THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages"})
"""Folders inside the standard library's tree that hold installed packages, not stdlib."""


def stdlib_sources() -> list[Path]:
    """This interpreter's standard library ``.py`` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in find_files([root], "**/*.py")
            if not THIRD_PARTY_DIRS.intersection(p.relative_to(root).parts)]


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


def find_files(paths: Sequence[str | Path], glob: str) -> list[Path]:
    """Files named in ``paths``, directories expanded with ``glob``, in a fixed order."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if path.is_dir():
            found.update(p for p in path.glob(glob) if p.is_file())
        elif path.is_file():
            found.add(path)
        else:
            raise FileNotFoundError(f"data_paths: {str(path)!r} does not exist")
    return sorted(found)


def in_validation(path: Path, val_fraction: float) -> bool:
    """Whether ``path`` belongs to the validation split.

    Decided by a hash of the file name and its parent, not by the file list, so the split
    of a file never changes when files are added or the corpus moves to another machine.
    """
    key = f"{path.parent.name}/{path.name}".encode()
    return zlib.crc32(key) % 10_000 < val_fraction * 10_000


@dataclass(frozen=True)
class ByteWindows:
    """Random ``seq_len``-byte windows of one split; every position carries loss."""

    data: torch.Tensor
    seq_len: int

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        starts = torch.randint(0, len(self.data) - self.seq_len + 1, (batch_size,),
                               generator=generator)
        offsets = starts[:, None] + torch.arange(self.seq_len)
        input_ids = self.data[offsets].long()
        return input_ids, input_ids.clone()


def load_byte_splits(paths: Sequence[str | Path], glob: str, val_fraction: float,
                     seq_len: int) -> tuple[ByteWindows, ByteWindows]:
    """Train and validation windows over the files in ``paths`` (stdlib if empty)."""
    files = find_files(paths, glob) if paths else stdlib_sources()
    splits: dict[bool, list[bytes]] = {False: [], True: []}
    for f in files:
        splits[in_validation(f, val_fraction)].append(f.read_bytes())
    data = {val: torch.from_numpy(np.frombuffer(b"".join(parts), dtype=np.uint8).copy())
            for val, parts in splits.items()}
    for val, name in ((False, "train"), (True, "validation")):
        if len(data[val]) < seq_len:
            raise ValueError(
                f"data_paths: the {name} split of {len(files)} file(s) holds "
                f"{len(data[val])} bytes, fewer than seq_len={seq_len}; "
                "give more files or change val_fraction")
    return ByteWindows(data[False], seq_len), ByteWindows(data[True], seq_len)
