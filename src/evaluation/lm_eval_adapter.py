"""A nats model as an lm-evaluation-harness (``lm_eval``) model named ``"nats"``.

Importing this module registers :class:`NatsLM`; lm_eval discovers third-party models by
no other means (no entry points), so the plain ``lm_eval`` command does not know
``--model nats``. Either import this module and call ``lm_eval.simple_evaluate(model="nats",
model_args="path=RUN", ...)``, or run lm_eval's command line through this module:
``python -m nats.evaluation.lm_eval_adapter run --model nats --model_args path=RUN ...``.

Scores follow lm_eval's Hugging Face model (``HFLM``), so that numbers compare: the same
context/continuation split (``TemplateLM``), contexts cut from the left to ``max_length``,
rolling windows for perplexity, and the document separator as the token before a text
that starts from nothing. Nothing in the package imports this module, so
``nats.evaluation`` works without lm_eval installed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nats.config import whole_at_least
from nats.trainers import load_tokenizer, resolve_device
from nats.trainers.sources import load_model

try:
    # lm_eval looks its own models up lazily only while its registry is empty: registering
    # "nats" into an empty one would hide "hf" and the rest, so they are listed first.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    raise ImportError(f"nats.evaluation.lm_eval_adapter needs lm-evaluation-harness ({e}): "
                      "pip install 'lm_eval>=0.4.5,<0.5' (the lm-eval extra)") from None

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

DEFAULT_MAX_LENGTH = 2048
"""``max_length`` of a model whose training length is unknown (HFLM's default)."""
DEFAULT_MAX_GEN_TOKS = 256
"""Tokens generated when a task does not say (lm_eval's default)."""

log = logging.getLogger(__name__)

Pair = tuple[Any, list[int], list[int]]
"""``(cache key or None, context tokens, continuation tokens)``, as ``TemplateLM`` passes."""


def _positive_int(name: str, value: int | str) -> int:
    """``value`` as a whole number >= 1 (lm_eval's command line passes strings)."""
    number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if not whole_at_least(number):
        raise ValueError(f"NatsLM: {name} must be a whole number >= 1, got {value!r}")
    return number


@register_model("nats")
class NatsLM(TemplateLM):
    """A run folder, checkpoint or model folder (anything ``nats generate`` takes), tokenized
    as bytes or by ``tokenizer`` (a folder holding the ``tokenizer.json`` it was trained
    with). ``max_length`` (default: the run's training ``seq_len``, else 2048) bounds every
    forward pass; longer inputs lose tokens from the left."""

    def __init__(self, path: str, tokenizer: str | None = None, device: str = "auto",
                 batch_size: int | str = 1, max_length: int | str | None = None) -> None:
        super().__init__()
        self._device = resolve_device(str(device))
        loaded = load_model(path, self._device)
        self.model = loaded.model
        self.origin = loaded.origin
        self.tokenizer = load_tokenizer(tokenizer)
        vocab = self.model.config.vocab_size
        if self.tokenizer.vocab_size > vocab:
            raise ValueError(f"{path}: the model has vocab_size={vocab}, fewer than the "
                             f"{self.tokenizer.vocab_size} tokens of {self.tokenizer!r}: pass "
                             "tokenizer=DIR (the tokenizer.json it was trained with)")
        self.batch_size = _positive_int("batch_size", batch_size)
        if max_length is None:
            trained = loaded.train_config
            max_length = trained.seq_len if trained is not None else DEFAULT_MAX_LENGTH
        self.max_length = _positive_int("max_length", max_length)

    @property
    def eot_token_id(self) -> int:
        """The document separator: a text that starts from nothing is scored after it, as
        the model saw documents start in training."""
        if self.tokenizer.separator is None:
            raise ValueError(f"{self.tokenizer!r} has no document separator to stand before a "
                             "text with an empty context (rolling log-likelihood, empty "
                             "contexts); use a tokenizer.json with an end-of-text token")
        return self.tokenizer.separator

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """Tokens of ``string``; nats tokenizers add no special tokens."""
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        """What lm_eval writes beside the results (``results["config"]``)."""
        return {"model_origin": self.origin,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "layer_types": list(self.model.config.layer_types),
                "tokenizer": repr(self.tokenizer), "max_length": self.max_length}

    # -- scoring ---------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[Pair],
                              disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(sum of log-probabilities of the continuation, whether greedy decoding gives
        exactly it)`` per request; longest first in batches, answered in request order."""
        for _, _, continuation in requests:
            if not continuation:
                raise ValueError("NatsLM: a continuation with no tokens has nothing to score")
            if len(continuation) > self.max_length:
                raise ValueError(f"NatsLM: a continuation of {len(continuation)} tokens does "
                                 f"not fit max_length={self.max_length}")
        cut = sum(len(c) + len(t) > self.max_length + 1 for _, c, t in requests)
        if cut:
            log.warning("%d of %d requests are longer than max_length=%d: their contexts lose "
                        "tokens from the left", cut, len(requests), self.max_length)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm,
                  desc="nats loglikelihood") as bar:
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                scored = self._score([(requests[i][1], requests[i][2]) for i in rows])
                for i, answer in zip(rows, scored, strict=True):
                    answers[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(rows))
        return answers

    @torch.inference_mode()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward pass over rows padded on the right: the model is causal, so a row's
        logits do not depend on what follows it."""
        inputs = [(context + continuation)[-(self.max_length + 1):][:-1]
                  for context, continuation in pairs]
        width = max(len(ids) for ids in inputs)
        batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in inputs],
                             device=self._device)
        logits = self.model(batch).logits
        logprobs = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        answers = []
        for row, ((_, continuation), ids) in enumerate(zip(pairs, inputs, strict=True)):
            scored = logprobs[row, len(ids) - len(continuation):len(ids)]
            target = torch.tensor(continuation, device=scored.device)
            answers.append((float(scored.gather(-1, target[:, None]).sum()),
                            bool((scored.argmax(-1) == target).all())))
        return answers

    def loglikelihood_rolling(self, requests: list[Instance],
                              disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts (perplexity): HFLM's windows of ``max_length``
        tokens, each token predicted once, the first after the document separator."""
        windows: list[Pair] = []
        owners: list[int] = []
        for index, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(
                windows, disable_tqdm=disable_tqdm), strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance],
                       disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (``model.generate``) cut before the first ``until`` string
        or document separator, at most ``max_gen_toks`` tokens. Prompts of one length and
        settings decode together, as ``generate`` takes no padding; decoding goes on to
        ``max_gen_toks`` tokens unless every row of a batch ends its document. Sampling is
        refused; other generation keys (``top_p``, ...) do not change a greedy decode."""
        separator = self.tokenizer.separator
        eos = None if separator is None else self.tok_decode([separator])
        groups: dict[tuple[int, int, tuple[str, ...]], list[tuple[int, list[int]]]] = \
            defaultdict(list)
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
            if kwargs["do_sample"]:
                raise ValueError(f"NatsLM decodes greedily: sampling ({gen_kwargs}) is not "
                                 "supported")
            until = tuple(handle_stop_sequences(kwargs["until"], eos=eos))
            room = self.max_length - kwargs["max_gen_toks"]
            if room < 1:
                raise ValueError(f"NatsLM: max_gen_toks={kwargs['max_gen_toks']} leaves no room "
                                 f"for a context within max_length={self.max_length}: pass a "
                                 "larger max_length in model_args")
            prompt = (self.tok_encode(context) or [self.prefix_token_id])[-room:]
            groups[len(prompt), kwargs["max_gen_toks"], until].append((index, prompt))
        texts = [""] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="nats generate") as bar:
            for (width, max_gen_toks, until), members in groups.items():
                for start in range(0, len(members), self.batch_size):
                    rows = members[start:start + self.batch_size]
                    prompts = torch.tensor([p for _, p in rows], device=self._device)
                    out = self.model.generate(prompts, max_gen_toks, eos_token_id=separator)
                    for (index, _), tokens in zip(rows, out[:, width:].tolist(), strict=True):
                        texts[index] = postprocess_generated_text(
                            self.tok_decode(tokens), list(until), None)
                        self.cache_hook.add_partial("generate_until", requests[index].args,
                                                    texts[index])
                    bar.update(len(rows))
        return texts


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
