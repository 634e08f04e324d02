"""RULER S-NIAH prompts: RULER's format, the length asked for, scored as RULER scores."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.cli import main
from nats.evaluation.ruler import (
    NOISE,
    TASKS,
    TOKENS_TO_GENERATE,
    essay_words,
    make_sample,
    run_ruler,
    string_match_all,
)
from nats.trainers import ByteTokenizer

ENCODE = ByteTokenizer().encode
VALUE = {"numbers": r"[1-9]\d{6}",
         "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"}


@pytest.fixture(scope="module")
def words() -> list[str]:
    return essay_words()


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("length", [600, 1000, 4096])
def test_prompt_fills_the_length_with_one_needle(name: str, length: int,
                                                 words: list[str]) -> None:
    task = TASKS[name]
    for seed in range(5):
        s = make_sample(name, length, ENCODE, random.Random(seed), words)
        (value,) = s.answers
        assert re.fullmatch(VALUE[task.value], value)
        needles = re.findall(rf"One of the special magic {task.value} for ([a-z]+-[a-z]+) "
                             rf"is: {re.escape(value)}\.", s.prompt)
        assert len(needles) == 1
        one = task.value[:-1]  # RULER's wording for one value: "A special magic number is"
        assert s.prompt.startswith(f"A special magic {one} is hidden within the following "
                                   f"text. Make sure to memorize it. I will quiz you about "
                                   f"the {one} afterwards.\n")
        assert s.prompt.endswith(f"\nWhat is the special magic {one} for {needles[0]} "
                                 "mentioned in the provided text? The special magic "
                                 f"{one} for {needles[0]} mentioned in the provided text is")
        used = len(ENCODE(s.prompt)) + TOKENS_TO_GENERATE
        unit = len(ENCODE(NOISE)) + 1 if task.haystack == "noise" else 100
        assert length - unit < used <= length  # the longest haystack that fits
        # The needle sits at its depth, counted in haystack units (lines, words).
        context = s.prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat is the", 1)[0]
        at = context.index("One of the special magic")
        if task.haystack == "noise":
            lines = context.split("\n")
            assert set(lines) - {NOISE} == {needles_line := lines[context[:at].count("\n")]}
            assert needles_line.startswith("One of the special magic")
            before, total = context[:at].count(NOISE), context.count(NOISE)
        else:
            needle_words = len(f"One of the special magic {task.value} for k is: v.".split())
            before = len(context[:at].split())
            total = len(context.split()) - needle_words
        assert before == round(total * s.depth / 100)


def test_same_seed_same_prompts_and_too_short_is_refused() -> None:
    a = make_sample("niah_single_1", 600, ENCODE, random.Random(3))
    assert a == make_sample("niah_single_1", 600, ENCODE, random.Random(3))
    assert a != make_sample("niah_single_1", 600, ENCODE, random.Random(4))
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah_single_1", 100, ENCODE, random.Random(0))


def test_string_match_all() -> None:
    assert string_match_all(" 1234567.", ("1234567",)) == 1.0
    assert string_match_all("ABC-def and 7", ("abc-DEF", "8")) == 0.5
    assert string_match_all("123456", ("1234567",)) == 0.0


def test_an_oracle_scores_one_and_a_guess_zero() -> None:
    def oracle(prompt: str) -> str:
        query = re.search(r"magic \w+ for (\S+) mentioned in the provided text is$",
                          prompt).group(1)
        return " " + re.search(rf"for {query} is: (\S+)\.", prompt).group(1) + "."

    tasks, lengths = ["niah_single_1", "niah_single_3"], [600, 900]
    assert run_ruler(oracle, ENCODE, tasks, lengths, samples=4)["tasks"] == \
        {t: {"600": 1.0, "900": 1.0} for t in tasks}
    assert run_ruler(lambda p: " 1234567.", ENCODE, tasks, lengths, samples=4)["tasks"] == \
        {t: {"600": 0.0, "900": 0.0} for t in tasks}


def test_command_writes_scores_of_a_byte_model(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    model = NatsForCausalLM(NatsConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2,
                                       softmax_heads_per_head=1, head_dim_k=16,
                                       head_dim_v=16, chunk_size=16))
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "ruler.json"
    assert main(["ruler", str(tmp_path / "model"), "--tasks", "niah_single_1", "--lengths",
                 "600", "--samples", "2", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["tasks"]) == {"niah_single_1"}
    assert 0.0 <= report["tasks"]["niah_single_1"]["600"] <= 1.0
    assert "niah_single_1: 600:" in capsys.readouterr().out
    assert main(["ruler", str(tmp_path / "model"), "--lengths", "50", "--device", "cpu",
                 "--out", str(out)]) == 2
    assert "too short" in capsys.readouterr().err


def test_every_length_is_checked_before_the_first_answer(tmp_path: Path, capsys) -> None:
    def never(prompt: str) -> str:
        raise AssertionError("generated before the lengths were checked")

    with pytest.raises(ValueError, match="length 50 is too short"):
        run_ruler(never, ENCODE, ["niah_single_1"], [600, 50], samples=2)
    assert main(["ruler", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
