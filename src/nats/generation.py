"""Greedy and sampled generation on top of the hybrid inference cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import positive_finite, whole_at_least
from .cuda_graph import GraphedDecoder
from .eval_mode import eval_mode

if TYPE_CHECKING:  # the model imports this module
    from .model import NatsForCausalLM


def check_sampling(temperature: float, top_k: int | None, vocab_limit: int | None,
                   vocab_size: int) -> None:
    """Refuse sampling settings no token can be drawn with, before any work is done."""
    if not positive_finite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and not whole_at_least(top_k):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if vocab_limit is not None and not (whole_at_least(vocab_limit)
                                        and vocab_limit <= vocab_size):
        raise ValueError(f"vocab_limit must be an integer in [1, {vocab_size}] (the model's "
                         f"vocab_size) or None, got {vocab_limit!r}")


def pick_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None,
              generator: torch.Generator | None,
              vocab_limit: int | None = None) -> torch.Tensor:
    """The next token ``[B]`` from logits ``[B, V]``: argmax, or a (top-k) sample, among the
    first ``vocab_limit`` ids (all by default); settings as :func:`check_sampling` allows."""
    if vocab_limit is not None:
        logits = logits[:, :vocab_limit]
    if not do_sample:
        return logits.argmax(-1)
    # Shifted to a maximum of 0 before the division, in float64 (a temperature below
    # float32's smallest number would be 0 there): a tiny temperature then sends the others
    # to -inf instead of the largest to inf or NaN.
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: NatsForCausalLM, input_ids: torch.Tensor, max_new_tokens: int,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None,
             eos_token_id: int | None = None, cuda_graph: bool | None = None,
             max_prompt_tokens: int | None = None,
             vocab_limit: int | None = None) -> torch.Tensor:
    """Prefill the prompt once, then decode token by token against the cache.

    Returns ``[B, T + n]``; generation stops early once every row has produced
    ``eos_token_id``. Every row of ``input_ids`` is a whole prompt of ``T`` tokens: there
    is no padding mask (a padded row would continue after its padding), so prompts of
    other lengths are generated one batch per length. The model decodes in evaluation
    mode (:func:`nats.eval_mode.eval_mode`: argmax routes, its routing statistics
    untouched, its mode restored after).
    ``cuda_graph`` replays the decode steps from a CUDA graph
    (:class:`nats.cuda_graph.GraphedDecoder`); by default it does on a GPU.
    ``max_prompt_tokens`` refuses longer prompts: the prefill is one forward pass, whose
    softmax scores grow with the square of the prompt on the reference (CPU) path.
    Non-finite logits after the prefill (NaN weights, a diverged run) raise instead of
    decoding arbitrary tokens. ``vocab_limit`` keeps the generated ids below it: a tokenizer
    that knows fewer tokens than the model's vocabulary could not decode the others.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got "
                         f"{list(input_ids.shape)}")
    if not whole_at_least(max_new_tokens, 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if max_prompt_tokens is not None and not whole_at_least(max_prompt_tokens):
        raise ValueError(f"max_prompt_tokens must be an integer >= 1 or None, got "
                         f"{max_prompt_tokens!r}")
    check_sampling(temperature, top_k, vocab_limit, model.config.vocab_size)
    if max_prompt_tokens is not None and input_ids.shape[1] > max_prompt_tokens:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens, more than the limit of "
                         f"{max_prompt_tokens} (the prefill's memory grows with the square of "
                         "the prompt's length); raise the limit to go on")
    tokens = [input_ids]
    if max_new_tokens == 0:
        return input_ids
    if cuda_graph is None:
        cuda_graph = input_ids.is_cuda
    with eval_mode(model):
        logits, cache = model.prefill(input_ids)
        if not bool(torch.isfinite(logits[:, -1]).all()):
            raise ValueError("the model's logits are not finite (NaN or inf): its weights are "
                             "damaged or its training diverged")
        if cuda_graph:
            step = GraphedDecoder(model, cache)
        else:
            def step(token: torch.Tensor) -> torch.Tensor:
                return model.decode_step(token, cache)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        next_token = pick_next(logits[:, -1], do_sample, temperature, top_k, generator,
                               vocab_limit)
        for i in range(max_new_tokens):
            if eos_token_id is not None:
                next_token = next_token.masked_fill(finished, eos_token_id)
                finished |= next_token == eos_token_id
            tokens.append(next_token[:, None])
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
                break
            next_token = pick_next(step(next_token), do_sample, temperature, top_k,
                                   generator, vocab_limit)
        return torch.cat(tokens, 1)
