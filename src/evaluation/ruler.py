"""RULER's single-needle retrieval (S-NIAH), generated offline: ``nats ruler``.

The prompt, needle and answer prefix are RULER's (Hsieh et al. 2024, arXiv 2404.06654,
``scripts/data/synthetic/constants.py`` and ``niah.py``: its template, made singular for
one needle as ``niah.py`` does; the noise sentences one per line, the needle at a uniformly
drawn line), and so is the length: the prompt leaves room for the 128 generated tokens.
So is the score: the share of expected values found in the greedy continuation
(``string_match_all``). The three tasks
are RULER's ``niah_single_1`` (the repeated noise sentences, a 7-digit number),
``niah_single_2`` (an essay haystack, a number) and ``niah_single_3`` (an essay haystack, a
UUID). What differs, because nothing is downloaded: the essay haystack is a window of the
Python standard library's sources (RULER uses Paul Graham's essays), and keys are
adjective-noun pairs from the short lists below (RULER draws them from wonderwords' lists).
Lengths count the model's tokens (UTF-8 bytes by default), the prompt and answer included.
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make "
            "sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
            "{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned "
            "in the provided text? The special magic {type_needle_v} for {query} mentioned "
            "in the provided text are")
"""RULER's S-NIAH template, its answer prefix included."""
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]
"""Insertion depths in per cent of the essay haystack, RULER's ``np.linspace(0, 100, 40)``."""
TOKENS_TO_GENERATE = 128
"""Generated per prompt, and kept free of the length (RULER's ``tokens_to_generate``)."""


def one_needle(template: str) -> str:
    """RULER's rewording of a template asked about one value (``niah.py``)."""
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"),
                             ("answers", "answer")):
        template = template.replace(plural, singular)
    return template

ADJECTIVES = ("abundant", "ancient", "bitter", "brave", "bright", "broad", "calm", "careful",
              "cheap", "clever", "cold", "curious", "damp", "dark", "deep", "eager", "early",
              "empty", "faint", "fancy", "fierce", "flat", "fresh", "gentle", "giant", "glad",
              "golden", "grand", "green", "hollow", "honest", "huge", "humble", "icy", "lazy",
              "little", "loud", "lucky", "mellow", "modern", "narrow", "noisy", "odd", "old",
              "pale", "plain", "polite", "proud", "quick", "quiet", "rapid", "rare", "rough",
              "round", "rusty", "silent", "silver", "smooth", "soft", "steady")
NOUNS = ("anchor", "apple", "arrow", "basket", "beacon", "bicycle", "blanket", "bottle",
         "bridge", "candle", "canyon", "castle", "cellar", "chimney", "compass", "cottage",
         "crystal", "desert", "diamond", "engine", "feather", "forest", "fountain", "garden",
         "glacier", "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern",
         "meadow", "mirror", "needle", "orchard", "pebble", "pencil", "pillow", "planet",
         "pocket", "puzzle", "quarry", "rabbit", "ribbon", "saddle", "shadow", "signal",
         "spider", "statue", "teapot", "thunder", "tunnel", "valley", "violin", "wagon",
         "whistle", "window", "winter", "zipper")


@dataclass(frozen=True)
class SniahTask:
    haystack: str
    """``noise`` (RULER's repeated sentences) or ``essay`` (words of a text)."""
    value: str
    """``numbers`` (7 digits) or ``uuids``."""


TASKS = {"niah_single_1": SniahTask("noise", "numbers"),
         "niah_single_2": SniahTask("essay", "numbers"),
         "niah_single_3": SniahTask("essay", "uuids")}


@dataclass(frozen=True)
class Sample:
    prompt: str
    """The input, ending in the answer prefix."""
    answers: tuple[str, ...]
    depth: int
    """Where the needle sits, in per cent of the haystack."""


def make_sample(name: str, length: int, encode: Any, rng: random.Random,
                essay_words: list[str] | None = None) -> Sample:
    """A prompt of at most ``length - TOKENS_TO_GENERATE`` tokens (``len(encode(text))``),
    with the longest haystack that fits."""
    task = TASKS[name]
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    value = (str(rng.randint(1_000_000, 9_999_999)) if task.value == "numbers"
             else str(uuid.UUID(int=rng.getrandbits(128), version=4)))
    needle = NEEDLE.format(type_needle_v=task.value, key=key, value=value)
    if task.haystack == "noise":  # a line drawn uniformly, as RULER's repeated haystack
        units, start, where, sep = [NOISE], 0, rng.random(), "\n"
    else:
        if not essay_words:
            raise ValueError(f"{name} needs essay words")
        units, start, where, sep = (essay_words, rng.randrange(len(essay_words)),
                                    rng.choice(DEPTHS) / 100, " ")

    def at(n: int) -> int:
        return int(n * where) if task.haystack == "noise" else round(n * where)

    def prompt(n: int) -> str:
        hay = [units[(start + i) % len(units)] for i in range(n)]
        context = sep.join([*hay[:at(n)], needle, *hay[at(n):]])
        return one_needle(TEMPLATE).format(type_needle_v=task.value[:-1], context=context,
                                           query=key)

    budget = length - TOKENS_TO_GENERATE
    bare = len(encode(prompt(0)))
    if bare > budget:
        raise ValueError(f"length {length} is too short for {name}: the prompt alone takes "
                         f"{bare} tokens and {TOKENS_TO_GENERATE} are kept for the answer")
    low, high = 0, 1
    while len(encode(prompt(high))) <= budget:  # grow, then bisect: a few encodings
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if len(encode(prompt(mid))) <= budget else (low, mid)
    return Sample(prompt(low), (value,), round(100 * at(low) / low) if low else 0)


def string_match_all(prediction: str, answers: tuple[str, ...]) -> float:
    """RULER's score of one sample: the share of answers found in the prediction."""
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def essay_words() -> list[str]:
    """Words of the standard library's sources, the offline stand-in for RULER's essays."""
    from nats.trainers.text import stdlib_bytes

    return stdlib_bytes()[:4_000_000].numpy().tobytes().decode("utf-8", "replace").split()


def run_ruler(generate: Any, encode: Any, tasks: list[str], lengths: list[int],
              samples: int, seed: int = 0) -> dict[str, Any]:
    """Score ``generate(prompt) -> continuation`` on every task and length."""
    words = essay_words() if any(TASKS[t].haystack == "essay" for t in tasks) else None
    # Every prompt is built before the first answer: a length too short for one of them
    # fails here, not after the others were generated.
    cells = {}
    for name in tasks:
        for length in lengths:
            rng = random.Random(f"{seed}-{name}-{length}")
            cells[name, length] = [make_sample(name, length, encode, rng, words)
                                   for _ in range(samples)]
    results: dict[str, dict[str, float]] = {name: {} for name in tasks}
    with tqdm(total=len(tasks) * len(lengths) * samples, desc="ruler", unit="sample") as bar:
        for (name, length), cell in cells.items():
            scores = []
            for sample in cell:
                scores.append(string_match_all(generate(sample.prompt), sample.answers))
                bar.update(1)
            results[name][str(length)] = sum(scores) / samples
    return {"tasks": results, "samples": samples, "seed": seed}


def add_ruler_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``ruler`` to the ``nats`` sub-commands."""
    p = sub.add_parser(
        "ruler", help="RULER single-needle retrieval (S-NIAH), generated offline",
        description="Greedy answers to RULER's S-NIAH prompts, scored as RULER scores them "
                    "(share of needles' values found in the answer), per task and length.")
    p.add_argument("source", metavar="SOURCE",
                   help="a run folder, a checkpoint file or a saved/exported model folder")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], metavar="T",
                   help="prompt lengths in the model's tokens (default 1024 4096)")
    p.add_argument("--samples", type=int, default=25, help="prompts per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer.json or its folder (default: the run's, else UTF-8 bytes)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", type=Path, default=Path("ruler.json"), help="JSON results")
    p.set_defaults(func=ruler_command)
    return p


def ruler_command(args: argparse.Namespace) -> int:
    from nats.atomic_write import atomic_write_bytes, check_output_file
    from nats.trainers import generate_text, load_tokenizer, resolve_device
    from nats.trainers.sources import load_model

    if args.samples < 1 or min(args.lengths) < 1:
        raise ValueError("--samples and --lengths must be >= 1")
    check_output_file(args.out)
    device = resolve_device(args.device)
    loaded = load_model(args.source, device)
    trained = loaded.train_config.tokenizer if loaded.train_config else None
    tokenizer = load_tokenizer(args.tokenizer or trained)

    def generate(prompt: str) -> str:
        return generate_text(loaded.model, prompt, TOKENS_TO_GENERATE, tokenizer)

    report = {"source": loaded.origin, "device": str(device), "tokenizer": repr(tokenizer),
              **run_ruler(generate, tokenizer.encode, args.tasks, args.lengths, args.samples,
                          args.seed)}
    atomic_write_bytes(args.out, (json.dumps(report, indent=2) + "\n").encode())
    print(f"nats ruler: {loaded.origin}, {args.samples} samples per cell")
    for name, by_length in report["tasks"].items():
        cells = ", ".join(f"{n}: {score:.3f}" for n, score in by_length.items())
        print(f"  {name}: {cells}")
    print(f"nats ruler: wrote {args.out}")
    return 0
