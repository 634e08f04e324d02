"""The lm-evaluation-harness model (``nats.evaluation.lm_eval_adapter``): its three request
types against an independent computation from the native model's logits, its settings,
and a whole ``lm_eval.simple_evaluate`` run on local task files (no network)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval
import pytest
import torch
import yaml
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from nats import NatsConfig, NatsForCausalLM
from nats.evaluation.lm_eval_adapter import NatsLM
from nats.trainers import TrainConfig

SEPARATOR = 0  # the byte tokenizer's document separator (NUL)


def _byte_model(vocab_size: int = 256) -> NatsForCausalLM:
    torch.manual_seed(0)
    config = NatsConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2,
                        softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                        layer_types=("nats", "linear"))
    model = NatsForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.nats_layers:  # spread the scorer's logits: both routes occur
            layer.scorer.proj.weight.normal_(0, 1.0)
        # Greedy text stays ASCII, so that a greedy continuation can be written as a string
        # (the embeddings are tied: bytes >= 128, absent from the tests' text, embed to 0).
        model.lm_head.weight[128:] = 0
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NatsForCausalLM]:
    """A saved byte-level model folder and the native model read back from it."""
    path = tmp_path_factory.mktemp("lm_eval") / "model"
    _byte_model().save_pretrained(path)
    return path, NatsForCausalLM.from_pretrained(path).eval()


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _score(model: NatsForCausalLM, tokens: list[int], scored: int,
           max_length: int) -> tuple[float, bool]:
    """Log-probability of the last ``scored`` of ``tokens`` given the ones before, in one
    forward pass over at most ``max_length`` inputs, and whether each is the argmax."""
    window = tokens[-(max_length + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([window[:-1]])).logits[0, -scored:]
    target = torch.tensor(window[-scored:])
    logprobs = torch.log_softmax(logits, -1).gather(-1, target[:, None])
    return float(logprobs.sum()), bool((logits.argmax(-1) == target).all())


def _greedy(model: NatsForCausalLM, text: str, n: int) -> str:
    out = model.generate(torch.tensor([list(text.encode())]), n)
    return bytes(out[0, len(text.encode()):].tolist()).decode()


def test_loglikelihood_matches_the_native_logits(saved: tuple[Path, NatsForCausalLM]) -> None:
    path, model = saved
    lm = NatsLM(str(path), max_length=40, batch_size=2)
    greedy = _greedy(model, "print(", 3)
    long_context = "x=[1,2,3];" * 9  # 90 bytes: cut from the left to max_length
    pairs = [("def f(x):", " return x"), ("print(", greedy), ("", "hello"),
             ("a b ", "c"), (long_context, "y = x"), ("print(", "zzz")]
    # (tokens, scored tokens) as lm_eval splits them: an empty context is the document
    # separator, and a context's trailing space belongs to the continuation.
    expected = [_score(model, tokens, scored, 40) for tokens, scored in [
        (list(b"def f(x): return x"), 9), (list(b"print(" + greedy.encode()), 3),
        ([SEPARATOR, *b"hello"], 5), (list(b"a b c"), 2),
        (list(long_context.encode() + b"y = x"), 5), (list(b"print(zzz"), 3)]]
    got = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    for (logprob, is_greedy), (want, want_greedy) in zip(got, expected, strict=True):
        assert logprob == pytest.approx(want, abs=1e-5)
        assert is_greedy == want_greedy
    assert got[1][1] and not got[5][1]


def test_rolling_loglikelihood_matches_sliding_windows(
        saved: tuple[Path, NatsForCausalLM]) -> None:
    path, model = saved
    max_length = 24
    lm = NatsLM(str(path), max_length=max_length, batch_size=3)
    texts = ["def add(a, b):\n    return a + b\n" * 3, "short text"]
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]),
                                   disable_tqdm=True)
    for text, total in zip(texts, got, strict=True):
        tokens = [SEPARATOR, *text.encode()]  # tokens[i + 1] is the text's i-th byte
        want, done, n = 0.0, 0, len(tokens) - 1
        while done < n:  # predict bytes done..end from the max_length tokens before `end`
            end = min(done + max_length, n)
            want += _score(model, tokens[max(0, end - max_length):end + 1], end - done,
                           max_length)[0]
            done = end
        assert total == pytest.approx(want, abs=1e-4)
    assert len(texts[0]) > 3 * max_length


def test_generate_until_is_the_greedy_decode_cut_at_a_stop(
        saved: tuple[Path, NatsForCausalLM]) -> None:
    path, model = saved
    lm = NatsLM(str(path), max_length=64, batch_size=2)
    contexts = ["def f(x):", "import os", "x = 1 +"]  # the first two decode as one batch
    full = [_greedy(model, c, 12) for c in contexts]
    stop = full[0][4]  # cuts the first continuation after at most 4 characters
    kwargs = {"until": [stop], "max_gen_toks": 12, "do_sample": False}
    got = lm.generate_until(_requests("generate_until", [(c, kwargs) for c in contexts]),
                            disable_tqdm=True)
    assert got == [f.split(stop)[0].split("\0")[0] for f in full]
    assert len(got[0]) <= 4


def test_settings_and_one_line_errors(saved: tuple[Path, NatsForCausalLM],
                                      tmp_path: Path) -> None:
    path, model = saved
    assert NatsLM(str(path)).max_length == 2048  # no run config: HFLM's default
    run = tmp_path / "run"
    model.save_pretrained(run / "model")
    config = TrainConfig(model=model.config, task="text", seq_len=48, device="cpu")
    (run / "train_config.json").write_text(json.dumps(config.to_dict()))
    assert NatsLM(str(run), batch_size="4").max_length == 48  # the training length
    assert NatsLM(str(run), max_length=96).max_length == 96

    small = tmp_path / "small"
    _byte_model(vocab_size=50).save_pretrained(small)
    with pytest.raises(ValueError, match=r"vocab_size=50.*pass tokenizer=DIR") as info:
        NatsLM(str(small))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="batch_size must be a whole number"):
        NatsLM(str(path), batch_size="auto")
    lm = NatsLM(str(path), max_length=8)
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until(_requests("generate_until", [("a", {"do_sample": True})]))
    with pytest.raises(ValueError, match="larger max_length"):
        lm.generate_until(_requests("generate_until", [("a", {"max_gen_toks": 8})]))


def _write_tasks(folder: Path) -> None:
    """A multiple-choice, a generation and a perplexity task over local JSON lines."""
    rows = [{"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a + b + 1}", " 0"],
             "answer": 0, "target": f" {a + b}"} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"dataset_path": "json", "validation_split": "validation",
              "dataset_kwargs": {"data_files": {"validation": str(data)},
                                 "cache_dir": str(folder / "hf_cache")},
              "doc_to_text": "{{question}}", "metadata": {"version": 1.0}}
    tasks = {
        "sums_mc": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
                    "doc_to_target": "{{answer}}",
                    "metric_list": [{"metric": "acc", "aggregation": "mean",
                                     "higher_is_better": True}]},
        "sums_gen": {"output_type": "generate_until", "doc_to_target": "{{target}}",
                     "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4,
                                           "do_sample": False},
                     "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                                      "higher_is_better": True}]},
        "sums_ppl": {"output_type": "loglikelihood_rolling", "doc_to_target": "{{question}}",
                     "metric_list": [{"metric": "bits_per_byte"}]},
    }
    for name, task in tasks.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **common, **task}))


def test_simple_evaluate_runs_local_tasks(saved: tuple[Path, NatsForCausalLM],
                                          tmp_path: Path) -> None:
    path, _ = saved
    _write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="nats", model_args=f"path={path},max_length=64", tasks=["sums_mc", "sums_gen",
                                                                      "sums_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        batch_size=2, device="cpu", bootstrap_iters=0, log_samples=False)
    scores = results["results"]
    assert 0 <= scores["sums_mc"]["acc,none"] <= 1
    assert 0 <= scores["sums_gen"]["exact_match,none"] <= 1
    assert math.isfinite(scores["sums_ppl"]["bits_per_byte,none"])
    assert scores["sums_ppl"]["bits_per_byte,none"] > 0
    assert results["config"]["model_origin"] == f"model folder {path}"
