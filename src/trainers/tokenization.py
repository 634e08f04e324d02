"""Tokenizers for text tasks: UTF-8 bytes (the default) or a local ``tokenizer.json``.

Both turn a batch of documents into one packed token array in which every document is
followed by the tokenizer's document separator. Nothing is downloaded: a tokenizer is a
folder (or file) on disk, read with the ``tokenizers`` library (``pip install 'nats[text]'``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

SEPARATOR_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]",
                   "<|im_end|>")
"""Special tokens taken, in this order, as a tokenizer's document separator."""


class Tokenizer(Protocol):
    vocab_size: int
    """Token ids lie in ``0 .. vocab_size - 1``."""
    separator: int | None
    """The token after every document, or ``None`` (documents then simply abut)."""
    fingerprint: str
    """Changes whenever the tokenization changes (names cached token arrays)."""
    dtype: type[np.integer]

    def pack(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        """The tokens of ``texts``, each followed by the separator, and the bytes they stand
        for: the UTF-8 bytes of the texts plus one per separator."""
        ...

    def encode(self, text: str) -> list[int]:
        """The tokens of one text, without a separator (a prompt)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


def utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text``; lone surrogates (possible in JSON strings) become ``?``."""
    return text.encode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes as tokens ``0 .. 255``; byte 0 (NUL, absent from text) ends a document."""

    vocab_size = 256
    separator = 0
    fingerprint = "bytes-v1"
    dtype = np.uint8

    def pack(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        data = b"".join(utf8(t) + b"\0" for t in texts)
        return np.frombuffer(data, dtype=np.uint8), len(data)

    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class FileTokenizer:
    """A ``tokenizers`` tokenizer read from a local ``tokenizer.json``.

    Documents are encoded without the tokenizer's own special tokens (no per-document BOS
    or CLS); the separator is the first of :data:`SEPARATOR_NAMES` it knows, else its
    first special token, else none.
    """

    dtype = np.int32

    def __init__(self, path: str | Path) -> None:
        file = tokenizer_file(path)
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ValueError(f"tokenizer: reading {str(path)!r} needs the 'tokenizers' package "
                             "(pip install 'nats[text]')") from None
        raw = file.read_bytes()
        try:
            self.tokenizer: Any = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception type
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"tokenizer: {str(file)!r} is not a valid tokenizer.json "
                             f"({first})") from None
        self.path = file
        self.fingerprint = "tokenizers-" + hashlib.sha256(raw).hexdigest()
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self.separator = _separator(self.tokenizer, vocab)

    def pack(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        texts = list(texts)
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False) \
            if hasattr(self.tokenizer, "encode_batch_fast") \
            else self.tokenizer.encode_batch(texts, add_special_tokens=False)
        end = np.array([] if self.separator is None else [self.separator], dtype=self.dtype)
        parts = [a for e in encodings for a in (np.asarray(e.ids, dtype=self.dtype), end)]
        tokens = np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)
        return tokens, sum(len(utf8(t)) for t in texts) + len(end) * len(texts)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"FileTokenizer({str(self.path)!r})"


def _separator(tokenizer: Any, vocab: dict[str, int]) -> int | None:
    for name in SEPARATOR_NAMES:
        if name in vocab:
            return vocab[name]
    special = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    return special[0] if special else None


def tokenizer_file(path: str | Path) -> Path:
    """``path/tokenizer.json``, or ``path`` itself when it names the file."""
    path = Path(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"tokenizer: {str(path)!r} holds no tokenizer.json")
        return path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: {str(path)!r} does not exist")
    return path


BYTE_VOCAB_LIMIT = 512
"""A model without its run is taken to read UTF-8 bytes (without a tokenizer given) only
below this vocabulary: 256 bytes and a task's few markers (the needle task's 266)."""


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """UTF-8 bytes when ``path`` is ``None``, else the tokenizer saved at ``path``."""
    return ByteTokenizer() if path is None else FileTokenizer(path)
