"""Text corpora: sources, splits, packing and windows.

A corpus is a sequence of documents: one per text file, one per record of JSON / JSON
Lines / Parquet files or of a dataset folder written by ``save_to_disk``. Documents are
split into train and validation, tokenized (UTF-8 bytes unless a ``tokenizer.json`` is
given), and packed into one token stream with the tokenizer's separator after each
document; a training sequence is a ``seq_len``-token window of that stream. Text files are
read as UTF-8 with universal newlines (``\r\n`` becomes ``\n``; undecodable bytes become
U+FFFD); empty documents are skipped.

* Split. Text files go to validation by a stable hash of their name (never by the file
  list), records by a seeded hash of their text (identical records share a split); a saved
  ``DatasetDict`` with a ``validation`` (or ``valid``, ``val``, ``test``) split keeps it.
* In memory (default): each split is tokenized once into one array (kept per process and,
  for ``tokenizers`` tokenizers, cached on disk under ``$NATS_CACHE_DIR``, default
  ``~/.cache/nats``); a batch is random windows drawn from the step's own generator.
* Streaming: documents are read in order and packed on the fly into consecutive windows;
  batch ``s`` is windows ``s * batch_size .. (s + 1) * batch_size - 1`` of that stream,
  which starts over at its end. Resuming at step ``s`` re-reads the first ``s *
  batch_size`` windows (the data position is ``step * batch_size`` sequences).

Everything is read from local disk. Text files (and the default corpus, the Python standard
library's own ``.py`` files, split by file) are read directly; JSON, Parquet and
``save_to_disk`` folders go through Hugging Face ``datasets``, imported only then and run
offline (``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` default to 1 here).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import io
import json
import os
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nats.atomic_write import atomic_write_bytes

from .config import DATA_FORMATS
from .synthetic import Batch
from .text import stdlib_sources
from .tokenization import ByteTokenizer, Tokenizer

EXTENSIONS = {"json": (".json", ".jsonl"), "parquet": (".parquet",)}
TRAIN, VALIDATION = "train", "validation"
VALIDATION_SPLITS = ("validation", "valid", "val", "test")
"""Splits of a saved ``DatasetDict`` used, in this order, for validation."""
READ_BATCH = 64
"""Documents read and tokenized at a time."""
MEASURE_BYTES = 1 << 20
"""Validation text read to measure bytes per token of a streamed corpus."""
CACHE_VERSION = 1
MEMORY_CACHE_SIZE = 4
SKIPPED_DIRS = frozenset({"__pycache__"})


def _datasets() -> Any:
    """The ``datasets`` module, imported offline (only local files are ever read)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    return datasets


def read_text_file(path: Path) -> str:
    """One text document: UTF-8, universal newlines, undecodable bytes as U+FFFD (what
    ``datasets``' text loader with ``sample_by="document"`` gives)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def format_of(path: Path) -> str:
    """The data format ``auto`` reads ``path`` as."""
    if is_saved_dataset(path):
        return "saved"
    name = path.name.lower()
    return next((fmt for fmt, ends in EXTENSIONS.items() if name.endswith(ends)), "text")


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset``/``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or (path / "state.json").is_file())


def find_files(paths: Sequence[str | Path], glob: str, data_format: str = "auto") -> list[Path]:
    """Files named in ``paths`` and those matching ``glob`` in its folders, sorted.

    Folders skip hidden entries and ``__pycache__``; for ``json`` and ``parquet`` they also
    skip files without that format's extensions. Named files are always kept.
    """
    found: set[Path] = set()
    for path in map(Path, paths):
        if path.is_dir():
            for p in path.glob(glob):
                parts = p.relative_to(path).parts
                if (not p.is_file() or SKIPPED_DIRS.intersection(parts)
                        or any(part.startswith(".") for part in parts)):
                    continue
                if data_format in EXTENSIONS and not p.name.lower().endswith(
                        EXTENSIONS[data_format]):
                    continue
                found.add(p)
        elif path.is_file():
            found.add(path)
        else:
            raise FileNotFoundError(f"data_paths: {str(path)!r} does not exist")
    return sorted(found)


def in_validation(path: Path, val_fraction: float) -> bool:
    """Whether the file ``path`` belongs to the validation split.

    Decided by a hash of the file name and its parent, not by the file list, so the split
    of a file never changes when files are added or the corpus moves to another machine.
    """
    key = f"{path.parent.name}/{path.name}".encode()
    return zlib.crc32(key) % 10_000 < val_fraction * 10_000


def record_in_validation(text: str, val_fraction: float, seed: int = 0) -> bool:
    """Whether a record with this text belongs to the validation split (a seeded hash)."""
    key = seed.to_bytes(8, "little", signed=True) + text.encode("utf-8", errors="replace")
    return zlib.crc32(key) % 10_000 < val_fraction * 10_000


Reader = Callable[[], Iterator[list[str]]]


@dataclass(frozen=True)
class Corpus:
    """The documents of a run: where they are, how to read them and how they split.

    Empty documents (an empty file, an empty string) are skipped.
    """

    format: str
    """``text``, ``json``, ``parquet`` or ``saved``."""
    paths: tuple[Path, ...]
    """The files, or for ``saved`` the one dataset folder."""
    name: str
    """How messages refer to it."""
    text_field: str = "text"
    val_fraction: float = 0.05
    split_seed: int = 0

    def documents(self, split: str) -> Iterator[list[str]]:
        """The documents of ``split`` (``train`` or ``validation``) in order, in batches."""
        want_val = split == VALIDATION
        for read, route in self._parts():
            if route == split:
                yield from _nonempty(read())
            elif route == "hash" and self._hash_split_may_hold(want_val):
                for texts in _nonempty(read()):
                    kept = [t for t in texts if self._in_val(t) == want_val]
                    if kept:
                        yield kept

    def both(self) -> Iterator[tuple[str, list[str]]]:
        """``(split, documents)`` batches of both splits, reading the corpus once."""
        for read, route in self._parts():
            for texts in _nonempty(read()):
                if route != "hash":
                    yield route, texts
                    continue
                flags = [self._in_val(t) for t in texts]
                for split, val in ((TRAIN, False), (VALIDATION, True)):
                    kept = [t for t, f in zip(texts, flags, strict=True) if f == val]
                    if kept:
                        yield split, kept

    def fingerprint(self) -> str:
        """Changes when a file, the format, the text field or the split changes."""
        files = self.paths if self.format != "saved" else sorted(
            p for p in self.paths[0].rglob("*") if p.is_file())
        stats = [(str(f.resolve()), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]
        key = [CACHE_VERSION, self.format, self.text_field, self.val_fraction, self.split_seed,
               stats]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def _in_val(self, text: str) -> bool:
        return record_in_validation(text, self.val_fraction, self.split_seed)

    def _hash_split_may_hold(self, want_val: bool) -> bool:
        # Skip reading a whole corpus to find that a split is empty by construction.
        return self.val_fraction > 0 if want_val else self.val_fraction < 1

    def _parts(self) -> list[tuple[Reader, str]]:
        """Readers of the corpus and the split each goes to (``hash``: split per record)."""
        if self.format == "text":
            by_split: dict[str, list[Path]] = {TRAIN: [], VALIDATION: []}
            for f in self.paths:
                by_split[VALIDATION if in_validation(f, self.val_fraction) else TRAIN].append(f)
            return [(self._text_reader(files), split) for split, files in by_split.items()]
        if self.format in ("json", "parquet"):
            return [(self._record_reader(), "hash")]
        return self._saved_parts()

    def _text_reader(self, files: list[Path]) -> Reader:
        """Whole files, read directly: the default corpus must not need ``datasets``."""
        def read() -> Iterator[list[str]]:
            for i in range(0, len(files), READ_BATCH):
                yield [read_text_file(f) for f in files[i:i + READ_BATCH]]
        return read

    def _record_reader(self) -> Reader:
        def read() -> Iterator[list[str]]:
            # An empty file holds no records (``datasets`` fails on one with a traceback).
            files = [f for f in self.paths if f.stat().st_size > 0]
            if not files:
                return
            options: dict[str, Any] = {}
            if self.format == "parquet":
                import pyarrow.parquet as pq

                for f in files:
                    self._check_fields(pq.read_schema(f).names, f)
                options["columns"] = [self.text_field]
            ds = _datasets().load_dataset(
                self.format, data_files=[globlib.escape(str(f)) for f in files],
                split="train", streaming=True, **options)
            if ds.features is not None:
                self._check_fields(list(ds.features), self.paths[0])
            import pyarrow as pa

            batches = ds.iter(batch_size=READ_BATCH)
            while True:
                try:
                    batch = next(batches, None)
                except pa.ArrowInvalid as e:  # the message names no file
                    where = _json_error_at(files) if self.format == "json" else None
                    raise ValueError(f"data_paths: {where or self.name} is not valid "
                                     f"{self.format}: {e}") from e
                if batch is None:
                    return
                if self.text_field not in batch:
                    self._check_fields(list(batch), self.paths[0])
                yield self._texts(batch[self.text_field])
        return read

    def _saved_parts(self) -> list[tuple[Reader, str]]:
        datasets = _datasets()
        path = self.paths[0]
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if TRAIN not in loaded:
                raise ValueError(f"data_paths: the saved dataset {str(path)!r} has no 'train' "
                                 f"split (it has {', '.join(map(repr, loaded))})")
            val = next((s for s in VALIDATION_SPLITS if s in loaded), None)
            if val is not None:
                return [(self._dataset_reader(loaded[TRAIN], path), TRAIN),
                        (self._dataset_reader(loaded[val], path), VALIDATION)]
            loaded = loaded[TRAIN]
        return [(self._dataset_reader(loaded, path), "hash")]

    def _dataset_reader(self, ds: Any, path: Path) -> Reader:
        self._check_fields(ds.column_names, path)
        feature = ds.features[self.text_field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"text_field: {self.text_field!r} of {str(path)!r} holds "
                             f"{feature}, not text")

        def read() -> Iterator[list[str]]:
            for batch in ds.select_columns([self.text_field]).iter(batch_size=READ_BATCH):
                yield self._texts(batch[self.text_field])
        return read

    def _check_fields(self, fields: Sequence[str], where: Path) -> None:
        if self.text_field not in fields:
            raise ValueError(f"text_field: {self.text_field!r} is not a field of the records "
                             f"in {str(where)!r} (fields: {', '.join(map(repr, fields))})")

    def _texts(self, values: list[Any]) -> list[str]:
        for v in values:
            if not isinstance(v, str):
                raise ValueError(f"text_field: {self.text_field!r} holds "
                                 f"{type(v).__name__}, not text, in a record of {self.name}")
        return values


WHOLE_JSON_LIMIT = 1 << 28
"""Bytes up to which a file that is not JSON lines is tried as one JSON document."""


def _json_error_at(files: Sequence[Path]) -> str | None:
    """``'path', line N``: the first line of ``files`` that is not JSON, in a file that is
    not one JSON document either; ``None`` where every file parses. Run only after the
    reader failed, to say where."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            bad = next((n for n, line in enumerate(fh, 1)
                        if line.strip() and not _is_json(line)), None)
        if bad is None:
            continue
        if f.stat().st_size <= WHOLE_JSON_LIMIT and _is_json(read_text_file(f)):
            continue
        return f"{str(f)!r}, line {bad},"
    return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _nonempty(batches: Iterator[list[str]]) -> Iterator[list[str]]:
    """Empty documents are dropped: they would add nothing but a separator."""
    for texts in batches:
        kept = [t for t in texts if t]
        if kept:
            yield kept


def resolve_corpus(paths: Sequence[str | Path], glob: str = "**/*", data_format: str = "auto",
                   text_field: str = "text", val_fraction: float = 0.05,
                   split_seed: int = 0) -> Corpus:
    """The corpus ``paths`` name (the Python standard library when empty)."""
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format {data_format!r} is invalid: must be one of "
                         f"{', '.join(DATA_FORMATS)}")
    options = dict(text_field=text_field, val_fraction=val_fraction, split_seed=split_seed)
    if not paths:
        return Corpus("text", tuple(stdlib_sources()), "the Python standard library", **options)
    given = [Path(p) for p in paths]
    name = f"data_paths {[str(p) for p in given]}"
    for p in given:
        if not p.exists():
            raise FileNotFoundError(f"data_paths: {str(p)!r} does not exist")
    saved = [p for p in given if is_saved_dataset(p)]
    if data_format == "saved" or (data_format == "auto" and saved):
        if len(given) != 1 or not saved:
            raise ValueError(f"{name}: a dataset folder written by save_to_disk must be the "
                             "only path")
        return Corpus("saved", (given[0],), name, **options)
    files = find_files(given, glob, data_format)
    if not files:
        raise ValueError(f"{name}: no files match data_glob {glob!r}"
                         + (f" with {data_format} extensions" if data_format in EXTENSIONS
                            else ""))
    fmt = data_format
    if fmt == "auto":
        kinds = sorted({format_of(f) for f in files})
        if len(kinds) > 1:
            raise ValueError(f"{name}: mixes {' and '.join(kinds)} files; choose one with "
                             "data_format or data_glob")
        fmt = kinds[0]
        if fmt == "saved":  # a save_to_disk folder found inside a folder
            raise ValueError(f"{name}: name the save_to_disk folder itself")
    return Corpus(fmt, tuple(files), name, **options)


@dataclass(frozen=True)
class TokenSplit:
    """One split as a packed token array, with what it was made from."""

    tokens: np.ndarray
    documents: int
    byte_count: int
    """UTF-8 bytes of its documents, plus one per separator token."""

    @property
    def bytes_per_token(self) -> float:
        return self.byte_count / max(len(self.tokens), 1)


_memory_cache: OrderedDict[str, dict[str, TokenSplit]] = OrderedDict()


def cache_dir() -> Path:
    """Where tokenized corpora are kept: ``$NATS_CACHE_DIR``, else ``~/.cache/nats``."""
    if os.environ.get("NATS_CACHE_DIR"):
        return Path(os.environ["NATS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nats"


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer) -> dict[str, TokenSplit]:
    """Both splits of ``corpus`` packed into token arrays (cached; see the module doc).

    Byte-level arrays are kept per process (reading is what they cost); arrays of a
    ``tokenizers`` tokenizer are also stored on disk, keyed by the files' sizes and
    modification times, the split and the tokenizer file's hash.
    """
    key = hashlib.sha256(f"{corpus.fingerprint()}/{tokenizer.fingerprint}".encode()).hexdigest()
    if key in _memory_cache:
        _memory_cache.move_to_end(key)
        return _memory_cache[key]
    on_disk = not isinstance(tokenizer, ByteTokenizer)
    file = cache_dir() / "tokens" / f"{key}.npz"
    splits = _read_cached(file) if on_disk else None
    if splits is None:
        splits = _tokenize(corpus, tokenizer)
        if on_disk:
            _write_cached(file, splits)
    _memory_cache[key] = splits
    while len(_memory_cache) > MEMORY_CACHE_SIZE:
        _memory_cache.popitem(last=False)
    return splits


def _tokenize(corpus: Corpus, tokenizer: Tokenizer) -> dict[str, TokenSplit]:
    parts: dict[str, list[np.ndarray]] = {TRAIN: [], VALIDATION: []}
    docs, counts = dict.fromkeys(parts, 0), dict.fromkeys(parts, 0)
    for split, texts in corpus.both():
        tokens, n_bytes = tokenizer.pack(texts)
        parts[split].append(tokens)
        docs[split] += len(texts)
        counts[split] += n_bytes
    out = {}
    for split, arrays in parts.items():
        tokens = np.concatenate(arrays) if arrays else np.empty(0, dtype=tokenizer.dtype)
        out[split] = TokenSplit(tokens, docs[split], counts[split])
    return out


def _read_cached(file: Path) -> dict[str, TokenSplit] | None:
    try:
        with np.load(file, allow_pickle=False) as saved:
            meta = saved["meta"].tolist()
            return {split: TokenSplit(saved[split], meta[2 * i], meta[2 * i + 1])
                    for i, split in enumerate((TRAIN, VALIDATION))}
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        return None  # absent or unreadable: tokenize again


def _write_cached(file: Path, splits: dict[str, TokenSplit]) -> None:
    meta = np.array([v for s in (TRAIN, VALIDATION)
                     for v in (splits[s].documents, splits[s].byte_count)], dtype=np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, meta=meta, **{s: splits[s].tokens for s in (TRAIN, VALIDATION)})
    with contextlib.suppress(OSError):  # a read-only cache only costs time
        atomic_write_bytes(file, buffer.getvalue())


def require_window(corpus: Corpus, split: str, tokens: int, documents: int | None,
                   seq_len: int) -> None:
    """A one-line error when ``split`` cannot fill one ``seq_len``-token window."""
    if tokens >= seq_len:
        return
    what = f"the {split} split" + ("" if documents is None else f" ({documents} documents)")
    state = ("is empty" if tokens == 0
             else f"holds {tokens} tokens, fewer than seq_len={seq_len}")
    if corpus.format == "text" and tokens == 0 and len(corpus.paths) < 10:
        # A text file goes to one split whole, whatever val_fraction says.
        hint = (f"text files go whole into one split, chosen by a hash of their name, and "
                f"there are {len(corpus.paths)}: cut the corpus into more files, or give it "
                f"as JSON lines records (split record by record)")
    else:
        hint = "give more data or change val_fraction"
    raise ValueError(f"{corpus.name}: {what} {state}; {hint}")


@dataclass(frozen=True)
class TokenWindows:
    """Random ``seq_len``-token windows of one packed split; every position carries loss."""

    data: torch.Tensor
    seq_len: int
    bytes_per_token: float | None = None

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        starts = torch.randint(0, len(self.data) - self.seq_len + 1, (batch_size,),
                               generator=generator)
        offsets = starts[:, None] + torch.arange(self.seq_len)
        input_ids = self.data[offsets].long()
        return input_ids, input_ids.clone()


@dataclass
class StreamWindows:
    """Consecutive ``seq_len``-token windows of one split, read in order and packed on the fly.

    Window ``i`` is tokens ``i * seq_len .. (i + 1) * seq_len - 1`` of the packed stream,
    which starts over (a new epoch) when the split ends. Asking for later windows reads
    on from where the last call stopped; asking for earlier ones reads from the start.
    """

    corpus: Corpus
    split: str
    tokenizer: Tokenizer
    seq_len: int
    _windows: Iterator[np.ndarray] | None = field(default=None, init=False, repr=False)
    _next: int = field(default=0, init=False, repr=False)

    def batch(self, index: int, batch_size: int) -> Batch:
        """Windows ``index * batch_size ..`` of the stream: the batch of step ``index``."""
        start = index * batch_size
        if self._windows is None or start < self._next:
            self._windows, self._next = self._read(), 0
        try:
            for _ in range(start - self._next):
                next(self._windows)
            rows = [next(self._windows) for _ in range(batch_size)]
        except BaseException:
            self._windows = None  # a generator that raised cannot go on
            raise
        self._next = start + batch_size
        return _batch(rows)

    def first(self, count: int, batch_size: int) -> list[Batch]:
        """The first ``count`` batches, read afresh (the evaluation set)."""
        windows = self._read()
        return [_batch([next(windows) for _ in range(batch_size)]) for _ in range(count)]

    def check(self) -> None:
        """Raise the one-line error now if the split cannot fill a window."""
        next(self._read())

    @cached_property
    def bytes_per_token(self) -> float:
        """Measured on the first :data:`MEASURE_BYTES` of the split's text."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return 1.0
        tokens = n_bytes = 0
        for texts in self.corpus.documents(self.split):
            packed, b = self.tokenizer.pack(texts)
            tokens, n_bytes = tokens + len(packed), n_bytes + b
            if n_bytes >= MEASURE_BYTES:
                break
        return n_bytes / max(tokens, 1)

    def _read(self) -> Iterator[np.ndarray]:
        buffer = np.empty(0, dtype=self.tokenizer.dtype)
        epoch = 0
        while True:
            total = 0
            for texts in self.corpus.documents(self.split):
                packed, _ = self.tokenizer.pack(texts)
                total += len(packed)
                buffer = np.concatenate([buffer, packed])
                n = len(buffer) // self.seq_len
                for i in range(n):
                    yield buffer[i * self.seq_len: (i + 1) * self.seq_len]
                buffer = buffer[n * self.seq_len:]
            if epoch == 0:
                require_window(self.corpus, self.split, total, None, self.seq_len)
            epoch += 1


def _batch(rows: list[np.ndarray]) -> Batch:
    input_ids = torch.from_numpy(np.stack(rows).astype(np.int64))
    return input_ids, input_ids.clone()


def load_text_sources(corpus: Corpus, tokenizer: Tokenizer, seq_len: int, streaming: bool
                      ) -> tuple[TokenWindows | StreamWindows, TokenWindows | StreamWindows]:
    """Train and validation sources of ``corpus``; each split must fill one window."""
    if streaming:
        train = StreamWindows(corpus, TRAIN, tokenizer, seq_len)
        val = StreamWindows(corpus, VALIDATION, tokenizer, seq_len)
        train.check()
        val.check()
        return train, val
    splits = tokenize_corpus(corpus, tokenizer)
    for split, s in splits.items():
        require_window(corpus, split, len(s.tokens), s.documents, seq_len)
    # The tensors share the cached arrays' memory; windows only ever read them.
    train_split, val_split = splits[TRAIN], splits[VALIDATION]
    return (TokenWindows(torch.from_numpy(train_split.tokens), seq_len),
            TokenWindows(torch.from_numpy(val_split.tokens), seq_len,
                         val_split.bytes_per_token))
