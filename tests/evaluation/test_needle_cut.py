"""``experiments/needle_cut.py``: its split of needles (inside one chunk or cut by a
boundary, by the cut needle's tokens in its first chunk, by how every NAtS-L layer's
heads routed the needle's chunks and the distractors', the misses that answer a
distractor) against a plain recount of the same rows."""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from nats.kernels import SOFTMAX
from nats.trainers import build_batches, train
from nats.trainers.sources import LoadedModel, load_model

# The script's folder, as the scripts put it on the path themselves.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import common
import needle
import needle_cut

ROWS = 48


class _AnswersEvenRows(torch.nn.Module):
    """The run's model, with its logits set to the right answer on even rows (the answer is
    the row's last 7 tokens), to the value of the row's first needle on rows 1 of every 4
    (a distractor's where that needle is one) and every layer's routes drawn at random
    (seeded by the batch and the layer), so whole answers and route patterns differ between
    rows and every count is tested, not only zeros and one pattern."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, ids: torch.Tensor):
        self.grad_enabled = torch.is_grad_enabled()
        out = self.model(ids)
        logits = out.logits.clone()
        answer = ids[:, -7:].clone()
        for b in range(1, len(ids), 4):  # the row's first 7 digits (before the 10-token question)
            answer[b] = ids[b, :-10][ids[b, :-10] < 10][:7]
        right = torch.nn.functional.one_hot(answer, logits.shape[-1]).to(logits.dtype)
        logits[::2, -8:-1] = 1e4 * right[::2]
        logits[1::4, -8:-1] = 1e4 * right[1::4]
        drawn = []
        for layer, routes in enumerate(out.routes):
            routes = routes.clone()
            draw = torch.Generator().manual_seed(int(ids.sum()) + layer)
            on_softmax = torch.rand(routes.shape[:-1], generator=draw) < 0.5
            routes[..., SOFTMAX], routes[..., 1 - SOFTMAX] = on_softmax, ~on_softmax
            drawn.append(routes)
        return dataclasses.replace(out, logits=logits, routes=drawn)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("needle_cut") / "run"
    config = needle.base_config(needle.SCALES["cpu"]).replace(
        steps=2, batch_size=16, warmup_steps=1, eval_interval=2, eval_batches=1,
        checkpoint_interval=2, device="cpu", out_dir=str(out))
    train(config)
    return out


def _needle_start(row: list[int], width: int) -> int:
    """Where the question (the row's last ``width`` tokens) first occurs in the row."""
    question = row[-width:]
    return next(i for i in range(len(row) - width) if row[i:i + width] == question)


def _key_starts(row: list[int], task) -> list[int]:
    """Where a key begins in the row's body: a key token after anything but a key token."""
    keys = task.key_tokens
    body = row[:-(task.key_len + 7)]
    return [i for i, t in enumerate(body) if t in keys and (i == 0 or body[i - 1] not in keys)]


def _count_slips(slips: dict, row: list[int], answer: list[int], others: list[int],
                 width: int) -> None:
    """Add one missed answer's wrong digits to ``slips``. Keys and digits occur only in
    needles, so a token read before an answer digit recurs outside the right needle only
    in a distractor (``others``: where each starts), whose tokens are walked one by one."""
    value = row[-7:]
    for i in range(7):
        if answer[i] == value[i]:
            continue
        read = row[-8 + i]  # the key's last token, or the right digit before
        pool = [d for d in range(10) if d != value[i] and (d > 0 or i > 0)]
        after = set()
        for s in others:
            walk = row[s:s + width + 1]  # the distractor and the token after it
            after |= {walk[j + 1] for j in range(width) if walk[j] == read}
        near = {value[k] for k in range(7) if abs(k - i) == 1}
        slips["wrong"] += 1
        slips["successor"] += answer[i] in after and answer[i] in pool
        slips["successor_chance"] += sum(d in after for d in pool) / len(pool)
        slips["neighbour"] += answer[i] in near and answer[i] in pool
        slips["neighbour_chance"] += sum(d in near for d in pool) / len(pool)


def _recount(run: Path, rows: int, distractors: int) -> dict:
    loaded = load_model(run)
    model = _AnswersEvenRows(loaded.model.eval())
    config = loaded.train_config.replace(needle_distractors=distractors,
                                         needle_haystack="text",
                                         eval_seed=common.TEST_EVAL_SEED)
    task = config.synthetic_task()
    c, width = model.config.chunk_size, task.key_len + 7
    want = {"inside": [0, 0], "cut": [0, 0], "misses_answering_a_distractor": [0, 0]}
    slips = {"wrong": 0, "successor": 0, "successor_chance": 0.0, "neighbour": 0,
             "neighbour_chance": 0.0}
    tokens: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    routes = {g: defaultdict(lambda: defaultdict(lambda: [0, 0])) for g in ("inside", "cut")}
    with torch.no_grad():
        for ids, _ in build_batches(config).eval(-(-rows // config.batch_size)):
            out = model(ids)
            for b, row in enumerate(ids.tolist()):
                answer = out.logits[b, -8:-1].argmax(-1).tolist()
                ok = int(answer == row[-7:])
                first = _needle_start(row, width)
                others = [s for s in _key_starts(row, task) if s != first]
                assert len(others) == distractors
                if not ok:
                    want["misses_answering_a_distractor"][0] += any(
                        answer == row[s + width - 7:s + width] for s in others)
                    want["misses_answering_a_distractor"][1] += 1
                    _count_slips(slips, row, answer, others, width)
                chunks = sorted({first // c, (first + width - 1) // c})
                group = "inside" if len(chunks) == 1 else "cut"
                want[group][0] += ok
                want[group][1] += 1
                if group == "cut":
                    tokens[c - first % c][0] += ok
                    tokens[c - first % c][1] += 1
                for layer, r in enumerate(out.routes):
                    last = max([first, *others]) + width - 1
                    if last // c >= r.shape[1] - 1:  # the row's last chunk has no route
                        continue
                    for h in range(r.shape[2]):
                        key = "+".join("SM" if r[b, i, h, SOFTMAX] > 0.5 else "LA"
                                       for i in chunks)
                        if distractors:
                            on = sum(bool((r[b, s // c:(s + width - 1) // c + 1, h, SOFTMAX]
                                           > 0.5).all()) for s in others)
                            key += f" d{on}/{distractors}"
                        routes[group][f"layer{layer} head{h}"][key][0] += ok
                        routes[group][f"layer{layer} head{h}"][key][1] += 1
    want["cut_by_tokens_in_first_chunk"] = dict(tokens)
    want["wrong_digits"] = slips["wrong"]
    want["slips_to_a_successor_elsewhere"] = {"seen": slips["successor"],
                                              "by_chance": slips["successor_chance"]}
    want["slips_to_a_neighbour"] = {"seen": slips["neighbour"],
                                    "by_chance": slips["neighbour_chance"]}
    for group, heads in routes.items():
        want[f"{group}_routes"] = {h: dict(p) for h, p in heads.items()}
    return want


@pytest.mark.parametrize("distractors", [0, 2])
def test_the_split_of_needles_matches_a_plain_recount(run: Path, monkeypatch,
                                                      distractors: int) -> None:
    real_load = needle_cut.load_model

    models = []

    def load_answering(source, device) -> LoadedModel:
        loaded = real_load(source, device)
        models.append(_AnswersEvenRows(loaded.model))
        return dataclasses.replace(loaded, model=models[-1])

    monkeypatch.setattr(needle_cut, "load_model", load_answering)
    got = needle_cut.analyse(str(run), ROWS, None, torch.device("cpu"), distractors)
    assert models[0].grad_enabled is False  # no autograd graph kept per batch
    want = _recount(run, ROWS, distractors)
    # The rows hold both kinds of needle, both outcomes and every route, so no count is
    # vacuous and a swapped pair of chunks would show.
    assert want["inside"][1] > 0 and want["cut"][1] > 0
    assert 0 < want["inside"][0] + want["cut"][0] < ROWS
    n_layers = len(got["nats_layers"])
    assert n_layers >= 2 and len(want["inside_routes"]) == n_layers * 2  # two heads a layer
    misses = want["misses_answering_a_distractor"]
    # Some wrong digits are slips of each kind, some are not.
    assert 0 < want["slips_to_a_neighbour"]["seen"] < want["wrong_digits"]
    assert want["slips_to_a_neighbour"]["by_chance"] > 0
    if distractors:  # some misses answer a distractor, some do not
        assert 0 < misses[0] < misses[1]
        assert 0 < want["slips_to_a_successor_elsewhere"]["seen"] < want["wrong_digits"]
        assert want["slips_to_a_successor_elsewhere"]["by_chance"] > 0
        seen = {key.split()[1] for group in ("inside_routes", "cut_routes")
                for p in want[group].values() for key in p}
        assert seen == {"d0/2", "d1/2", "d2/2"}
    else:
        assert misses[0] == 0 < misses[1]
        for head in want["inside_routes"]:
            assert set(want["inside_routes"][head]) == {"SM", "LA"}
            assert set(want["cut_routes"][head]) == {"SM+SM", "SM+LA", "LA+SM", "LA+LA"}
    for key, value in want.items():
        if key.startswith("slips_"):  # the chance counts sum fractions in another order
            assert got[key] == pytest.approx(value), key
        else:
            assert got[key] == value, key
    assert got["nats_layers"] == list(range(n_layers)) and got["chunk_size"] == 16
