"""Seeded batch streams and text corpora: formats, splits, packing, streaming, tokenizers.

Expected token streams are built here by hand from the documents (UTF-8 bytes, a 0 byte
after each document), never by the code under test.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nats import ConfigError, NatsForCausalLM
from nats.trainers import build_batches, generate_text, load_tokenizer
from nats.trainers import text_data as td
from nats.trainers.data import stream_generator
from nats.trainers.text import stdlib_sources
from nats.trainers.text_data import in_validation, resolve_corpus
from nats.trainers.tokenization import ByteTokenizer

from .conftest import MicroConfig

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token caches of these tests live and die with the test."""
    monkeypatch.setenv("NATS_CACHE_DIR", str(tmp_path / "cache"))
    td._memory_cache.clear()


def _text(micro: MicroConfig, **changes) -> object:
    model = micro().model.replace(vocab_size=changes.pop("vocab_size", 256))
    return micro(task="text", model=model, **changes)


def _docs(stream: torch.Tensor | bytes) -> list[str]:
    """The documents of a byte-level packed stream (each ends with a 0 byte)."""
    data = bytes(stream.tolist()) if isinstance(stream, torch.Tensor) else stream
    assert data.endswith(b"\0")
    return [d.decode() for d in data.split(b"\0")[:-1]]


def _packed(texts: list[str]) -> bytes:
    return b"".join(t.encode() + b"\0" for t in texts)


def _records(n: int = 60) -> list[str]:
    return [f"record {i}: café ∑ {'x' * (i % 7)}\nline two of {i}" for i in range(n)]


# --- seeded streams ------------------------------------------------------------------------

def test_streams_are_reproducible_and_train_and_eval_seeds_are_separate(
        micro: MicroConfig) -> None:
    batches = build_batches(micro())
    assert torch.equal(batches.train(5)[0], build_batches(micro()).train(5)[0])
    assert not torch.equal(batches.train(5)[0], batches.train(6)[0])
    assert not torch.equal(batches.train(5)[0], build_batches(micro(seed=1)).train(5)[0])
    first, again = batches.eval(2), batches.eval(2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0][0], batches.train(0)[0])
    # Evaluation follows eval_seed alone, training follows seed alone.
    other_eval = build_batches(micro(eval_seed=7))
    assert not torch.equal(other_eval.eval(1)[0][0], first[0][0])
    assert torch.equal(other_eval.train(5)[0], batches.train(5)[0])
    assert torch.equal(build_batches(micro(seed=3)).eval(1)[0][0], first[0][0])
    # Equal seeds still give different streams.
    same = build_batches(micro(seed=4, eval_seed=4))
    assert not torch.equal(same.eval(1)[0][0], same.train(0)[0])
    a = torch.rand(3, generator=stream_generator(0, "train", 1))
    assert not torch.equal(a, torch.rand(3, generator=stream_generator(0, "eval", 1)))
    assert batches.bytes_per_token is None and not batches.streaming


def test_calibration_batches_are_the_evaluated_task_on_a_stream_of_their_own(
        micro: MicroConfig) -> None:
    # A mixture-trained MQAR run evaluates on its mqar_pairs; calibration draws that task.
    config = micro(task="mqar", seq_len=64, mqar_pairs=8, mqar_pairs_mix=(2, 4))
    batches = build_batches(config)
    calibration, evaluation = batches.calibration(3), batches.eval(3)
    assert [c[0].shape for c in calibration] == [e[0].shape for e in evaluation]
    assert not any(torch.equal(c[0], e[0]) for c in calibration for e in evaluation)
    assert torch.equal(build_batches(config).calibration(1)[0][0], calibration[0][0])
    # Every calibration sequence asks 8 pairs' worth of queries, as an evaluated one does.
    asked = [int((c[1] != -100).sum()) for c in calibration]
    assert asked == [int((e[1] != -100).sum()) for e in evaluation]


def test_generated_batches_follow_the_config(micro: MicroConfig) -> None:
    x, y = build_batches(micro(task="mqar", seq_len=32, mqar_pairs=4)).train(0)
    assert x.shape == (2, 32) and (y != -100).sum(1).tolist() == [4, 4]
    x, y = build_batches(micro(copy_symbols=3)).train(0)
    assert x.shape == (2, 33) and x.max() <= 3
    x, y = build_batches(micro(task="needle", seq_len=40, needle_key_len=2)).train(0)
    assert x.shape == (2, 40) and (y != -100).sum(1).tolist() == [7, 7]
    assert torch.equal(y[:, -7:], x[:, -7:]) and x[:, -7:].max() <= 9


# --- text: formats and splits --------------------------------------------------------------

def _text_files(root: Path, n: int = 40) -> dict[Path, str]:
    files = {}
    for i in range(n):
        path = root / f"pkg{i % 3}" / f"mod{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        files[path] = f"# module {i} é\nVALUE = {i * 7}\n" * 3
        path.write_text(files[path], encoding="utf-8")
    (root / ".hidden.txt").write_text("hidden")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_text("cache")
    return files


def test_text_files_are_documents_split_by_file_name(micro: MicroConfig, tmp_path: Path) -> None:
    files = _text_files(tmp_path)
    batches = build_batches(_text(micro, data_paths=(str(tmp_path),), val_fraction=0.25,
                                  seq_len=8))
    in_val = [p for p in sorted(files) if in_validation(p, 0.25)]
    assert 0 < len(in_val) < len(files)
    train_files = [p for p in sorted(files) if p not in in_val]
    assert bytes(batches.eval_source.data.tolist()) == _packed([files[p] for p in in_val])
    assert bytes(batches.train_source.data.tolist()) == _packed([files[p] for p in train_files])
    assert batches.bytes_per_token == 1.0
    x, y = batches.train(0)
    assert x.shape == (2, 8) and torch.equal(x, y)
    # Calibration fits to what evaluation does not read: text has no second held-out
    # split, so the training windows serve.
    assert all(torch.equal(c[0], batches.train(i)[0])
               for i, c in enumerate(batches.calibration(3)))
    stream = bytes(batches.train_source.data.tolist())
    assert all(bytes(row) in stream for row in x.tolist())
    # The split of a file depends on its name only, not on the other files.
    (tmp_path / "pkg0" / "extra.txt").write_text("another file")
    more = build_batches(_text(micro, data_paths=(str(tmp_path),), val_fraction=0.25,
                               seq_len=8))
    assert set(_docs(batches.eval_source.data)) <= set(_docs(more.eval_source.data))


def test_text_files_read_without_datasets_give_the_windows_datasets_gave(
        micro: MicroConfig, tmp_path: Path) -> None:
    """Text files are now read directly; the reference is the ``datasets`` text loader that
    read them before (whole files, UTF-8 with replacement, universal newlines)."""
    import datasets

    _text_files(tmp_path, n=70)  # more than one read batch (READ_BATCH = 64)
    odd = {"crlf.txt": b"a\r\nb\rc\n", "bad.txt": b"ok \xff\xfe end", "bom.txt":
           b"\xef\xbb\xbfbom", "empty.txt": b""}
    for name, data in odd.items():
        (tmp_path / name).write_bytes(data)
    corpus = resolve_corpus([tmp_path], val_fraction=0.25)
    for split in (td.TRAIN, td.VALIDATION):
        chosen = [f for f in corpus.paths if in_validation(f, 0.25) == (split == td.VALIDATION)]
        ds = datasets.load_dataset("text", data_files=[str(f) for f in chosen], split="train",
                                   sample_by="document", encoding_errors="replace")
        expected = [t for t in ds["text"] if t]
        assert [t for batch in corpus.documents(split) for t in batch] == expected
        assert len(expected) > 10
    assert td.read_text_file(tmp_path / "crlf.txt") == "a\nb\nc\n"
    assert td.read_text_file(tmp_path / "bad.txt") == "ok \ufffd\ufffd end"
    for streaming in (False, True):  # same windows in memory and streamed
        config = _text(micro, data_paths=(str(tmp_path),), val_fraction=0.25, seq_len=8,
                       streaming=streaming)
        batches = build_batches(config)
        ds = datasets.load_dataset(
            "text", split="train", sample_by="document", encoding_errors="replace",
            data_files=[str(f) for f in corpus.paths if not in_validation(f, 0.25)])
        stream = _packed([t for t in ds["text"] if t])
        x, _ = batches.train(3)
        if streaming:  # step 3 of batch 2: windows 6 and 7 of the packed stream
            assert [bytes(r) for r in x.tolist()] == [stream[48:56], stream[56:64]]
        else:
            assert bytes(batches.train_source.data.tolist()) == stream


def test_text_corpora_do_not_import_datasets(tmp_path: Path) -> None:
    """The GPU image has no ``datasets``: the stdlib corpus and .txt files must not need it."""
    import subprocess
    import sys

    _text_files(tmp_path, n=5)
    code = f"""
import sys
sys.modules["datasets"] = None  # any import of it now fails
from nats.trainers.text_data import TRAIN, load_text_sources, resolve_corpus
from nats.trainers.tokenization import ByteTokenizer
assert next(resolve_corpus((), val_fraction=0.5).documents(TRAIN))  # the stdlib
corpus = resolve_corpus(({str(tmp_path)!r},), val_fraction=0.5)
for streaming in (False, True):
    train, _ = load_text_sources(corpus, ByteTokenizer(), 8, streaming)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_jsonl_records_split_disjointly_and_pack_in_order(micro: MicroConfig,
                                                           tmp_path: Path) -> None:
    records = _records()
    for part in range(2):
        with open(tmp_path / f"part{part}.jsonl", "w", encoding="utf-8") as f:
            for i, text in enumerate(records[part * 30:(part + 1) * 30]):
                f.write(json.dumps({"id": i, "body": text}) + "\n")
    batches = build_batches(_text(micro, data_paths=(str(tmp_path),), text_field="body",
                                  val_fraction=0.3, seq_len=16))
    train, val = _docs(batches.train_source.data), _docs(batches.eval_source.data)
    assert train and val and not set(train) & set(val)
    assert [r for r in records if r in set(val)] == val  # file order kept in each split
    assert [r for r in records if r not in set(val)] == train
    assert 5 < len(val) < 35
    # The split is a property of a record, not of its position.
    (tmp_path / "part0.jsonl").unlink()
    again = build_batches(_text(micro, data_paths=(str(tmp_path / "part1.jsonl"),),
                                text_field="body", val_fraction=0.3, seq_len=16))
    assert set(_docs(again.eval_source.data)) == set(val) & set(records[30:])


def test_parquet_records_pack_to_their_text(micro: MicroConfig, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _records(40)
    pq.write_table(pa.table({"text": records, "n": list(range(40))}), tmp_path / "a.parquet")
    batches = build_batches(_text(micro, data_paths=(str(tmp_path / "a.parquet"),),
                                  val_fraction=0.3, seq_len=16))
    train, val = _docs(batches.train_source.data), _docs(batches.eval_source.data)
    assert sorted(train + val) == sorted(records) and not set(train) & set(val)
    assert bytes(batches.train_source.data.tolist()) == _packed(
        [r for r in records if r in set(train)])


def test_saved_datasets_use_their_validation_split(micro: MicroConfig, tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    records = _records(30)
    DatasetDict({"train": Dataset.from_dict({"text": records[:20]}),
                 "test": Dataset.from_dict({"text": records[20:]})}).save_to_disk(
        str(tmp_path / "dict"))
    batches = build_batches(_text(micro, data_paths=(str(tmp_path / "dict"),), seq_len=16))
    assert bytes(batches.train_source.data.tolist()) == _packed(records[:20])
    assert bytes(batches.eval_source.data.tolist()) == _packed(records[20:])

    Dataset.from_dict({"text": records, "n": list(range(30))}).save_to_disk(
        str(tmp_path / "one"))
    one = build_batches(_text(micro, data_paths=(str(tmp_path / "one"),), data_format="saved",
                              val_fraction=0.3, seq_len=16))
    train, val = _docs(one.train_source.data), _docs(one.eval_source.data)
    assert train + val != records and sorted(train + val) == sorted(records)
    assert val and not set(train) & set(val)


def test_default_corpus_is_the_standard_library_and_loads_quickly(micro: MicroConfig) -> None:
    sources = stdlib_sources()
    assert Path(os.__file__) in sources
    assert not any("site-packages" in p.parts for p in sources)
    started = time.perf_counter()
    batches = build_batches(_text(micro, seq_len=64))
    assert time.perf_counter() - started < 15  # ~2 s on 2 cores; a cached reload ~0.1 s
    first = next(p for p in sources if not in_validation(p, 0.05))
    text = first.read_text(encoding="utf-8", errors="replace")  # universal newlines, as read
    assert bytes(batches.train_source.data[:len(text.encode()) + 1].tolist()) == \
        text.encode() + b"\0"
    val_files = [p for p in sources if in_validation(p, 0.05)]
    assert 0 < len(val_files) < len(sources) / 10
    assert batches.eval_source.data.count_nonzero() < len(batches.eval_source.data)
    started = time.perf_counter()
    build_batches(_text(micro, seq_len=64))
    assert time.perf_counter() - started < 2


# --- streaming -----------------------------------------------------------------------------

def test_streaming_reads_the_packed_stream_in_order_and_resumes_exactly(
        micro: MicroConfig, tmp_path: Path) -> None:
    files = _text_files(tmp_path, n=12)
    config = _text(micro, data_paths=(str(tmp_path),), val_fraction=0.25, seq_len=16,
                   batch_size=3, streaming=True)
    batches = build_batches(config)
    assert batches.streaming and batches.bytes_per_token == 1.0
    # An independent reading: train files in order, cycled, cut into 16-byte windows.
    train = [p for p in sorted(files) if not in_validation(p, 0.25)]
    epoch = _packed([files[p] for p in train])
    steps = 2 * len(epoch) // (16 * 3) + 3  # well into the second epoch
    stream = np.frombuffer(epoch * 3, dtype=np.uint8).copy()
    expected = [torch.from_numpy(stream[16 * 3 * s: 16 * 3 * (s + 1)].reshape(3, 16)).long()
                for s in range(steps)]
    seen = [batches.train(s) for s in range(steps)]
    for s in range(steps):
        assert torch.equal(seen[s][0], expected[s]) and torch.equal(seen[s][1], expected[s])
    # A resumed run starts at its step; an earlier step restarts the stream.
    resumed = build_batches(config)
    for s in (7, 8, 3, steps - 1):
        assert torch.equal(resumed.train(s)[0], expected[s])
    # Evaluation is the start of the validation stream, the same every time.
    val = _packed([files[p] for p in sorted(files) if in_validation(p, 0.25)])
    x, _ = batches.eval(2)[1]
    assert bytes(x.flatten().tolist()) == (val * 2)[48:96]
    assert torch.equal(batches.eval(2)[1][0], x)


def test_streaming_records_match_the_in_memory_split(micro: MicroConfig, tmp_path: Path) -> None:
    records = _records(50)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    config = _text(micro, data_paths=(str(tmp_path),), val_fraction=0.3, seq_len=8,
                   batch_size=2)
    memory = build_batches(config)
    streamed = build_batches(config.replace(streaming=True))
    stream = memory.train_source.data
    for s in (0, 1, 5):
        assert torch.equal(streamed.train(s)[0], stream[16 * s: 16 * (s + 1)].view(2, 8).long())


# --- tokenizers ----------------------------------------------------------------------------

def _train_tokenizer(folder: Path, texts: list[str]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_local_tokenizer_round_trips_and_packs(micro: MicroConfig, tmp_path: Path) -> None:
    records = _records(40)
    folder = _train_tokenizer(tmp_path / "tok", records)
    tokenizer = load_tokenizer(folder)
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = reference.token_to_id("<|endoftext|>")
    assert tokenizer.separator == eos and tokenizer.vocab_size == reference.get_vocab_size()
    for text in ("def f(x):\n    return 'é→∑'\n", records[3]):
        ids, n_bytes = tokenizer.pack([text])
        assert ids.tolist() == [*reference.encode(text).ids, eos]
        assert n_bytes == len(text.encode()) + 1
        assert tokenizer.decode(ids[:-1].tolist()) == text
        assert tokenizer.encode(text) == reference.encode(text).ids

    # Generation encodes the prompt and decodes the continuation with the same tokenizer,
    # drawing only ids it can decode (the model's vocabulary is larger). Seeded: whether an
    # unlimited argmax lands past the tokenizer's ids depends on the weights.
    torch.manual_seed(0)
    model = NatsForCausalLM(micro().model.replace(vocab_size=512)).eval()
    prompt = "def f(x):"
    prompt_ids = torch.tensor([reference.encode(prompt).ids])
    continuation = model.generate(prompt_ids, 6, vocab_limit=tokenizer.vocab_size)[
        0, prompt_ids.shape[1]:].tolist()
    assert max(continuation) < tokenizer.vocab_size
    assert generate_text(model, prompt, 6, tokenizer) == reference.decode(continuation)
    with pytest.raises(ValueError, match="--tokenizer"):
        small = micro().model.replace(vocab_size=tokenizer.vocab_size - 1)
        generate_text(NatsForCausalLM(small), prompt, 1, tokenizer)

    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"text": r}) + "\n" for r in records))
    config = _text(micro, data_paths=(str(tmp_path / "data.jsonl"),), tokenizer=str(folder),
                   vocab_size=512, val_fraction=0.3, seq_len=8)
    batches = build_batches(config)
    plain = build_batches(config.replace(tokenizer=None))
    val_docs = _docs(plain.eval_source.data)
    expected = [i for d in val_docs for i in (*reference.encode(d).ids, eos)]
    assert batches.eval_source.data.tolist() == expected
    assert batches.bytes_per_token == pytest.approx(
        sum(len(d.encode()) + 1 for d in val_docs) / len(expected))
    assert batches.bytes_per_token > 1.5  # BPE merges bytes
    assert batches.train(0)[0].max() < tokenizer.vocab_size
    # The tokenized corpus is cached on disk and read back unchanged.
    (cached,) = (Path(os.environ["NATS_CACHE_DIR"]) / "tokens").glob("*.npz")
    td._memory_cache.clear()
    assert build_batches(config).eval_source.data.tolist() == expected
    # A damaged cache file is tokenized again, not a traceback.
    cached.write_bytes(cached.read_bytes()[:2000])
    td._memory_cache.clear()
    assert build_batches(config).eval_source.data.tolist() == expected
    streamed = build_batches(config.replace(streaming=True))
    assert streamed.bytes_per_token == pytest.approx(batches.bytes_per_token)
    assert streamed.train(0)[0].flatten().tolist() == \
        batches.train_source.data[:16].tolist()


# --- errors --------------------------------------------------------------------------------

def _one_line_error(micro: MicroConfig, error: type[Exception], match: str, **changes) -> None:
    with pytest.raises(error, match=match) as caught:
        build_batches(_text(micro, **changes))
    assert "\n" not in str(caught.value), str(caught.value)


def test_bad_text_inputs_are_one_line_errors(micro: MicroConfig, tmp_path: Path) -> None:
    _one_line_error(micro, FileNotFoundError, "does not exist",
                    data_paths=(str(tmp_path / "missing"),))
    (tmp_path / "empty").mkdir()
    _one_line_error(micro, ValueError, "no files match", data_paths=(str(tmp_path / "empty"),))
    blank = tmp_path / "blank"
    blank.mkdir()
    for i in range(20):
        (blank / f"{i}.txt").write_text("")
    (blank / "20.txt").write_text("a few bytes")
    _one_line_error(micro, ValueError, r"the train split \(1 documents\) holds 12 tokens",
                    data_paths=(str(blank),), val_fraction=0.0)
    _one_line_error(micro, ValueError, r"the validation split \(0 documents\) is empty",
                    data_paths=(str(blank),), val_fraction=0.0, seq_len=4)
    # One text file goes to one split whole: val_fraction cannot help, and the message
    # says what can (it told the user to change val_fraction).
    (tmp_path / "one.txt").write_text("a document of a few words " * 40)
    _one_line_error(micro, ValueError, r"(train|validation) split \(0 documents\) is empty; "
                    r"text files go whole into one split, chosen by a hash of their name, and "
                    r"there are 1: cut the corpus into more files",
                    data_paths=(str(tmp_path / "one.txt"),))
    _text_files(tmp_path / "small", n=4)
    _one_line_error(micro, ValueError, "fewer than seq_len=100000",
                    data_paths=(str(tmp_path / "small"),), val_fraction=0.5, seq_len=100_000)
    _one_line_error(micro, ValueError, "fewer than seq_len=100000",
                    data_paths=(str(tmp_path / "small"),), val_fraction=0.5, seq_len=100_000,
                    streaming=True)

    (tmp_path / "none.jsonl").write_text("")
    for streaming in (False, True):
        _one_line_error(micro, ValueError, r"the train split( \(0 documents\))? is empty",
                        data_paths=(str(tmp_path / "none.jsonl"),), streaming=streaming)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"body": r, "n": 1}) + "\n" for r in _records(20)))
    _one_line_error(micro, ValueError, "text_field: 'text' is not a field.*'body', 'n'",
                    data_paths=(str(rows),))
    _one_line_error(micro, ValueError, "text_field: 'n' holds int, not text",
                    data_paths=(str(rows),), text_field="n")
    # A broken record names its file and line (pyarrow's own message names neither); a
    # pretty-printed JSON document beside it is not blamed.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "a.json").write_text(json.dumps([{"text": "fine"}], indent=2))
    (tmp_path / "broken" / "b.jsonl").write_text('{"text": "ok"}\n\n{"text": oops}\n')
    for streaming in (False, True):
        _one_line_error(micro, ValueError, r"'[^']*b\.jsonl', line 3, is not valid json",
                        data_paths=(str(tmp_path / "broken"),), streaming=streaming)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "t.parquet")
    _one_line_error(micro, ValueError, "text_field: 'text' is not a field",
                    data_paths=(str(tmp_path / "t.parquet"),))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("text")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "json"}\n')
    _one_line_error(micro, ValueError, "mixes json and text files",
                    data_paths=(str(tmp_path / "mixed"),))
    _one_line_error(micro, ValueError, "save_to_disk", data_paths=(str(rows),),
                    data_format="saved")

    _one_line_error(micro, FileNotFoundError, "holds no tokenizer.json",
                    tokenizer=str(tmp_path / "empty"))
    _one_line_error(micro, FileNotFoundError, "tokenizer: .* does not exist",
                    tokenizer=str(tmp_path / "nowhere"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    pytest.importorskip("tokenizers")
    _one_line_error(micro, ValueError, "not a valid tokenizer.json", tokenizer=str(
        tmp_path / "bad"))
    folder = _train_tokenizer(tmp_path / "tok", _records(20))
    _one_line_error(micro, ValueError, r"has \d+ tokens, more than model.vocab_size=256",
                    tokenizer=str(folder))
    with pytest.raises(ConfigError, match=r"TrainConfig\.task = 'poems'"):
        micro(task="poems")


def test_text_is_read_without_the_network(micro: MicroConfig, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("no network connection may be opened")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"text": r}) + "\n"
                                              for r in _records(30)))
    _text_files(tmp_path / "t", n=10)
    for path in (tmp_path / "r.jsonl", tmp_path / "t"):
        build_batches(_text(micro, data_paths=(str(path),), val_fraction=0.5, seq_len=8))


def test_file_names_are_not_glob_patterns(tmp_path: Path) -> None:
    (tmp_path / "a[1].txt").write_text("brackets")
    (tmp_path / "a1.txt").write_text("plain")
    corpus = resolve_corpus([tmp_path / "a[1].txt"], val_fraction=0.0)
    assert [t for _, batch in corpus.both() for t in batch] == ["brackets"]
    assert ByteTokenizer().pack(["ab", ""])[0].tolist() == [97, 98, 0, 0]


def test_bytes_round_trip() -> None:
    text = "def f(x):\n    return 'é→∑'\n"
    ids = ByteTokenizer().encode(text)
    assert ids == list(text.encode()) and max(ids) < 256
    assert ByteTokenizer().decode(ids) == text
    assert ByteTokenizer().decode([0xFF]) == "\ufffd"


def test_text_for_a_model_goes_through_its_runs_tokenizer(tmp_path: Path, capsys) -> None:
    """``nats generate`` fed a text run's prompt to it as raw bytes, ignoring the run's
    tokenizer (a 300-token BPE model printed "the catttttt"); a model of a large
    vocabulary without its run is refused, not fed bytes."""
    from types import SimpleNamespace

    from nats import NatsConfig, NatsForCausalLM
    from nats.cli import main
    from nats.trainers.sources import LoadedModel, text_tokenizer
    from nats.trainers.tokenization import ByteTokenizer, FileTokenizer

    folder = _train_tokenizer(tmp_path / "tok", _records(40))
    model = NatsForCausalLM(NatsConfig(vocab_size=600, d_model=32, n_layers=2, n_heads=2,
                                       head_dim_k=16, head_dim_v=16, chunk_size=16))
    text_run = SimpleNamespace(task="text", tokenizer=str(folder))
    chosen = text_tokenizer(LoadedModel(model, text_run, "a run"), None, "a run")
    assert isinstance(chosen, FileTokenizer) and chosen.vocab_size == 300
    mqar_run = SimpleNamespace(task="mqar", tokenizer=None)
    with pytest.raises(ValueError, match="600-token vocabulary, not of UTF-8 bytes"):
        text_tokenizer(LoadedModel(model, mqar_run, "a run"), None, "a run")
    given = text_tokenizer(LoadedModel(model, None, "a folder"), str(folder), "a folder")
    assert isinstance(given, FileTokenizer)
    small = NatsForCausalLM(model.config.replace(vocab_size=266))
    assert isinstance(text_tokenizer(LoadedModel(small, None, "x"), None, "x"), ByteTokenizer)

    model.save_pretrained(tmp_path / "bpe")
    assert main(["generate", str(tmp_path / "bpe"), "--prompt", "the cat"]) == 2
    err = capsys.readouterr().err
    assert "600-token vocabulary, not of UTF-8 bytes" in err and err.count("\n") == 1
    assert main(["generate", str(tmp_path / "bpe"), "--prompt", "the cat", "--tokenizer",
                 str(folder), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
