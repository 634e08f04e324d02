"""Seeded batch streams and the byte-level text corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nats.trainers import build_batches, decode_tokens, encode_text, load_byte_splits
from nats.trainers.data import stream_generator
from nats.trainers.text import in_validation, stdlib_sources

from .conftest import MicroConfig


def test_streams_are_reproducible_and_independent(micro: MicroConfig) -> None:
    batches = build_batches(micro())
    assert torch.equal(batches.train(5)[0], build_batches(micro()).train(5)[0])
    assert not torch.equal(batches.train(5)[0], batches.train(6)[0])
    assert not torch.equal(batches.train(5)[0], build_batches(micro(seed=1)).train(5)[0])
    first, again = batches.eval(2), batches.eval(2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0][0], batches.train(0)[0])
    a = torch.rand(3, generator=stream_generator(0, "train", 1))
    assert not torch.equal(a, torch.rand(3, generator=stream_generator(0, "eval", 1)))


def test_mqar_and_copy_batches_follow_the_config(micro: MicroConfig) -> None:
    x, y = build_batches(micro(task="mqar", seq_len=32, mqar_pairs=4)).train(0)
    assert x.shape == (2, 32) and (y != -100).sum(1).tolist() == [4, 4]
    x, y = build_batches(micro(copy_symbols=3)).train(0)
    assert x.shape == (2, 33) and x.max() <= 3


def _corpus(root: Path, n: int = 40) -> dict[Path, bytes]:
    files = {}
    for i in range(n):
        path = root / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        files[path] = f"# module {i}\nVALUE = {i * 7}\n".encode() * 3
        path.write_bytes(files[path])
    (root / "notes.txt").write_bytes(b"not python")
    return files


def test_byte_splits_partition_the_files_by_name(tmp_path: Path) -> None:
    files = _corpus(tmp_path)
    train, val = load_byte_splits([tmp_path], "**/*.py", 0.25, seq_len=8)
    in_val = [p for p in sorted(files) if in_validation(p, 0.25)]
    assert 0 < len(in_val) < len(files)
    assert bytes(val.data.tolist()) == b"".join(files[p] for p in in_val)
    assert bytes(train.data.tolist()) == b"".join(files[p] for p in sorted(files)
                                                  if p not in in_val)
    x, y = train.sample(16, torch.Generator().manual_seed(0))
    assert x.shape == (16, 8) and torch.equal(x, y)
    text = bytes(train.data.tolist())
    assert all(bytes(row) in text for row in x.tolist())


def test_byte_splits_need_both_splits(tmp_path: Path) -> None:
    _corpus(tmp_path)
    with pytest.raises(ValueError, match="validation split"):
        load_byte_splits([tmp_path], "**/*.py", 0.0, seq_len=8)
    with pytest.raises(FileNotFoundError, match="data_paths"):
        load_byte_splits([tmp_path / "missing"], "**/*.py", 0.1, seq_len=8)


def test_default_corpus_is_the_standard_library() -> None:
    sources = stdlib_sources()
    assert Path(os.__file__) in sources
    assert not any("site-packages" in p.parts for p in sources)


def test_bytes_round_trip() -> None:
    text = "def f(x):\n    return 'é→∑'\n"
    ids = encode_text(text)
    assert ids.dtype == torch.long and ids.max() < 256 and len(ids) == len(text.encode())
    assert decode_tokens(ids.tolist()) == text
    assert decode_tokens([0xFF]) == "\ufffd"
