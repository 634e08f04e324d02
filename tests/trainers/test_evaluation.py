"""Evaluation metrics against a position-by-position recount."""

from __future__ import annotations

import math

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.model import IGNORE_INDEX
from nats.trainers import evaluate
from nats.trainers.evaluation import SpanPosition
from nats.trainers.synthetic import MQARTask, NeedleTask


@torch.no_grad()
def _recount(model: NatsForCausalLM, batches) -> dict[str, float]:
    """Loss, accuracy and exact-sequence accuracy by looping over every label."""
    nll, tokens, correct, sequences, solved = 0.0, 0, 0, 0, 0
    for input_ids, labels in batches:
        logits = model(input_ids).logits.double()
        for b in range(len(input_ids)):
            right = []
            for t in range(1, input_ids.shape[1]):
                label = int(labels[b, t])
                if label == IGNORE_INDEX:
                    continue
                row = logits[b, t - 1]
                nll -= float(row[label] - torch.logsumexp(row, 0))
                right.append(int(row.argmax()) == label)
            tokens += len(right)
            correct += sum(right)
            if right:
                sequences += 1
                solved += all(right)
    return {"ce": nll / tokens, "acc": correct / tokens, "seq_acc": solved / sequences}


def test_metrics_match_a_recount_over_labelled_positions() -> None:
    torch.manual_seed(0)
    config = NatsConfig(vocab_size=8, d_model=16, n_layers=2, n_heads=2, head_dim_k=8,
                        head_dim_v=8, chunk_size=16, layer_types=("nats", "softmax"))
    model = NatsForCausalLM(config).eval()
    batches = []
    for n_labels in (5, 1):  # batches with different numbers of labelled tokens
        input_ids = torch.randint(0, 8, (3, 20))
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:2, -n_labels:] = input_ids[:2, -n_labels:]  # the last row has no labels
        batches.append((input_ids, labels))
    # A model that is always right on one sequence makes seq_acc non-trivial.
    with torch.no_grad():
        batches[1][1][0, -1] = model(batches[1][0]).logits[0, -2].argmax()

    metrics = evaluate(model, batches, torch.device("cpu"), bytes_per_token=2.0).metrics
    want = _recount(model, batches)
    assert metrics["eval/ce"] == pytest.approx(want["ce"], rel=1e-5)
    assert metrics["eval/ppl"] == pytest.approx(math.exp(want["ce"]), rel=1e-5)
    assert metrics["eval/bpb"] == pytest.approx(want["ce"] / math.log(2) / 2.0, rel=1e-5)
    assert metrics["eval/acc"] == pytest.approx(want["acc"])
    assert metrics["eval/seq_acc"] == pytest.approx(want["seq_acc"])
    assert want["seq_acc"] > 0
    # Softmax fractions: only layer 0 is NAtS-L; the overall mean is that layer's.
    assert "eval/attn_frac/layer1" not in metrics
    assert metrics["eval/attn_frac"] == metrics["eval/attn_frac/layer0"] == pytest.approx(
        (metrics["eval/attn_frac/layer0/head0"] + metrics["eval/attn_frac/layer0/head1"]) / 2)


def test_evaluation_leaves_training_mode_as_it_was() -> None:
    config = NatsConfig(vocab_size=8, d_model=16, n_heads=2, head_dim_k=8, head_dim_v=8,
                        chunk_size=16)
    model = NatsForCausalLM(config).train()
    x = torch.randint(0, 8, (1, 8))
    evaluate(model, [(x, x)], torch.device("cpu"))
    assert model.training


def test_labels_without_a_loss_position_are_an_error_not_a_number() -> None:
    """An all -100 batch used to give a NaN loss (model) or loss 0 and perplexity 1
    (evaluate): numbers that look fine and are wrong."""
    model = NatsForCausalLM(NatsConfig(vocab_size=50, d_model=32, head_dim_k=16,
                                       head_dim_v=16, chunk_size=16))
    x = torch.randint(0, 50, (2, 20))
    masked = torch.full_like(x, -100)
    with pytest.raises(ValueError, match="no position with a loss"):
        model(x, labels=masked)
    with pytest.raises(ValueError, match="hold no labelled token"):
        evaluate(model, [(x, masked)], torch.device("cpu"))


def test_layer_fractions_read_back_what_frac_scalars_wrote() -> None:
    from nats.trainers.evaluation import frac_scalars, layer_fractions
    metrics = frac_scalars("eval", [torch.tensor([0.25, 0.75]), None, torch.tensor([1.0])])
    assert layer_fractions(("nats", "linear", "nats"), metrics) == [0.5, None, 1.0]
    with pytest.raises(ValueError, match="eval/attn_frac/layer1"):
        layer_fractions(("softmax", "nats"), metrics)



@torch.no_grad()
def test_needle_accuracy_by_position_matches_a_row_by_row_recount() -> None:
    """Whole answers by the needle's depth and by whether it crosses a chunk boundary,
    against a loop that finds each row's needle by hand; MQAR (many spans) has none."""
    torch.manual_seed(0)
    task = NeedleTask(vocab_size=64, seq_len=90, haystack="random")
    config = NatsConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, head_dim_k=8,
                        head_dim_v=8, chunk_size=16, layer_types=("nats",))
    model = NatsForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [task.sample(16, generator) for _ in range(3)]
    n = task.key_len + task.VALUE_DIGITS
    want: dict[str, list[bool]] = {}
    for input_ids, labels in batches:
        guess = model(input_ids).logits[:, :-1].argmax(-1)
        labels[::2, -7:] = guess[::2, -7:]  # every other row answered as the model does
        for row, g, label in zip(input_ids.tolist(), guess, labels[:, 1:], strict=True):
            solved = bool((g[-7:] == label[-7:]).all())
            start = next(i for i in range(len(row) - n) if row[i:i + n] == row[-n:])
            lo = 20 * min(5 * start // 90, 4)
            want.setdefault(f"depth_{lo}-{lo + 20}", []).append(solved)
            one_chunk = start // 16 == (start + n - 1) // 16
            want.setdefault("in_one_chunk" if one_chunk else "across_chunks", []).append(solved)

    metrics = evaluate(model, batches, torch.device("cpu"), task=task).metrics
    got = {k.removeprefix("eval/seq_acc/"): v for k, v in metrics.items()
           if k.startswith("eval/seq_acc/")}
    assert got == pytest.approx({k: sum(v) / len(v) for k, v in want.items()})
    assert 0 < metrics["eval/seq_acc"] < 1 and len(want) >= 6
    by_hand = SpanPosition()  # rows of 90 tokens, chunks of 16, spans of 10
    marked = torch.zeros(3, 90, dtype=torch.bool)
    for row, start in enumerate((17, 10, 72)):
        marked[row, start:start + 10] = True
    by_hand.add(marked, torch.tensor([True, False, True]), 16)
    assert by_hand.metrics() == {"eval/seq_acc/depth_0-20": 0.5, "eval/seq_acc/depth_80-100": 1.0,
                                 "eval/seq_acc/in_one_chunk": 1.0,
                                 "eval/seq_acc/across_chunks": 0.5}
    mqar = MQARTask(vocab_size=64, seq_len=64, pairs=4)
    plain = evaluate(model, [mqar.sample(4, generator)], torch.device("cpu"), task=mqar).metrics
    assert not any(k.startswith("eval/seq_acc/") for k in plain)
    assert "eval/route_informative" in plain  # MQAR's positions do reach the precision
