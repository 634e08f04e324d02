"""Token-level view: a text with every chunk coloured by its route, as self-contained HTML.

One view per (layer, routing head), chosen with a selector; hovering a chunk lists its
route in every layer and head with the scorer's softmax probability. Task-relevant tokens
(a needle, MQAR's pairs) can be underlined, to read whether the model keeps them in
softmax attention. All text is HTML-escaped; the page loads nothing from the network.
"""

from __future__ import annotations

import codecs
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nats.kernels import SOFTMAX
from nats.trainers.routing_maps import LINEAR_RGB, SOFTMAX_RGB

TOKEN_VIEW_CSS = f"""
.tv-text {{ font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 14px;
  white-space: pre-wrap; word-break: break-all; line-height: 1.9; border: 1px solid #ccc;
  padding: 8px; max-height: 480px; overflow-y: auto; }}
.tv-text .chunk {{ border-radius: 3px; padding: 1px 0; margin-right: 1px; }}
.tv-text .sm {{ background: rgb{SOFTMAX_RGB}; color: #000; }}
.tv-text .la {{ background: rgb{LINEAR_RGB}; color: #fff; }}
.tv-text .rel {{ text-decoration: underline 3px #d00; font-weight: bold; }}
.tv-legend span {{ padding: 2px 8px; margin-right: 8px; border-radius: 3px; }}
"""


def token_pieces(ids: Sequence[int], tokenizer: object | None) -> list[str]:
    """What each token position shows: its text, or its id when ``tokenizer`` is ``None``
    (generated tasks have no text). Byte-level text: a multi-byte character shows at the
    position of its last byte (the others show nothing); other tokenizers: the text that
    token adds to the decoded prefix."""
    from nats.trainers import ByteTokenizer

    ids = [int(t) for t in ids]
    if tokenizer is None:
        return [f"{t} " for t in ids]
    if isinstance(tokenizer, ByteTokenizer):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return [decoder.decode(bytes([t])) for t in ids]
    pieces, prefix = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1])  # type: ignore[attr-defined]
        pieces.append(text[len(prefix):] if text.startswith(prefix)
                      else tokenizer.decode(ids[i: i + 1]))  # type: ignore[attr-defined]
        prefix = text
    return pieces


def _visible(text: str) -> str:
    """Control characters other than newline and tab as their visible symbols (U+2400..)."""
    return "".join(chr(0x2400 + ord(c)) if ord(c) < 32 and c not in "\n\t" else c
                   for c in text)


@dataclass(frozen=True)
class _View:
    key: str
    label: str
    softmax: list[bool]
    """Per chunk."""


def token_view_html(pieces: Sequence[str], routes: Sequence[torch.Tensor | None],
                    chunk_size: int, probs: Sequence[torch.Tensor | None] | None = None,
                    relevant: Sequence[bool] | None = None, view_id: str = "tv") -> str:
    """An HTML fragment (style in :data:`TOKEN_VIEW_CSS`): a selector over the NAtS-L
    layers' routing heads and, per choice, the text with one ``<span class="chunk sm|la">``
    per chunk.

    ``routes[i]``/``probs[i]``: layer ``i``'s ``[N, H, 2]`` for this sequence (``None``:
    not NAtS-L); ``relevant``: per token, underline it."""
    n_tokens = len(pieces)
    n_chunks = -(-n_tokens // chunk_size)
    probs = probs if probs is not None else [None] * len(routes)
    if relevant is not None and len(relevant) != n_tokens:
        raise ValueError(f"relevant marks {len(relevant)} positions for {n_tokens} tokens")
    views: list[_View] = []
    hover = [[f"chunk {c}: tokens {c * chunk_size}..{min((c + 1) * chunk_size, n_tokens) - 1}"]
             for c in range(n_chunks)]
    for i, (r, p) in enumerate(zip(routes, probs, strict=True)):
        if r is None:
            continue
        if r.dim() != 3 or r.shape[0] != n_chunks:
            raise ValueError(f"layer {i}: routes {list(r.shape)} are not [{n_chunks}, H, 2]")
        sm = (r[..., SOFTMAX] > 0.5).cpu()
        for h in range(sm.shape[1]):
            frac = sum(min((c + 1) * chunk_size, n_tokens) - c * chunk_size
                       for c in range(n_chunks) if sm[c, h]) / n_tokens
            views.append(_View(f"l{i}h{h}", f"layer {i}, head {h} (softmax fraction "
                                            f"{frac:.2f})", sm[:, h].tolist()))
            for c in range(n_chunks):
                prob = f", p(softmax) {float(p[c, h, SOFTMAX]):.2f}" if p is not None else ""
                hover[c].append(f"layer {i} head {h}: {'softmax' if sm[c, h] else 'linear'}"
                                f"{prob}")
    if not views:
        raise ValueError("the model has no NAtS-L layer: no routes to show")
    chunks_html = []
    for c in range(n_chunks):
        parts = []
        for t in range(c * chunk_size, min((c + 1) * chunk_size, n_tokens)):
            text = html.escape(_visible(pieces[t]))
            parts.append(f'<span class="rel">{text}</span>' if relevant is not None
                         and relevant[t] and text else text)
        chunks_html.append("".join(parts))
    # The hover text (every layer and head of a chunk) once, read by the script: as a
    # title on every chunk of every view it made the page grow with (layers x heads)^2.
    hover_json = json.dumps(["\n".join(h) for h in hover]).replace("<", "\\u003c")
    options = "".join(f'<option value="{v.key}">{html.escape(v.label)}</option>'
                      for v in views)
    blocks = []
    for n, v in enumerate(views):
        spans = "".join(f'<span class="chunk {"sm" if s else "la"}" data-chunk="{c}">'
                        f'{chunks_html[c]}</span>' for c, s in enumerate(v.softmax))
        hidden = "" if n == 0 else " hidden"
        blocks.append(f'<div class="tv-text" id="{view_id}-{v.key}"{hidden}>{spans}</div>')
    script = (f"document.getElementById('{view_id}-select').addEventListener('change', e => "
              f"{{ document.querySelectorAll('#{view_id} .tv-text').forEach(d => "
              f"{{ d.hidden = d.id !== '{view_id}-' + e.target.value; }}); }});"
              f"const hover = JSON.parse(document.getElementById('{view_id}-hover')"
              f".textContent);"
              f"document.getElementById('{view_id}').addEventListener('mouseover', e => {{ "
              f"const c = e.target.closest('.chunk'); if (c && !c.title) "
              f"c.title = hover[Number(c.dataset.chunk)]; }});")
    legend = ('<p class="tv-legend"><span class="sm" style="background: rgb'
              f'{SOFTMAX_RGB}">softmax: kept in the KV cache</span><span class="la" '
              f'style="background: rgb{LINEAR_RGB}; color: #fff">linear: written into the '
              'state</span>'
              + ('<span class="rel" style="text-decoration: underline 3px #d00">'
                 'task-relevant token</span>' if relevant is not None else "")
              + " Hover a chunk for its route in every layer and head.</p>")
    return (f'<div class="token-view" id="{view_id}"><label>Routes of '
            f'<select id="{view_id}-select">{options}</select></label>{legend}'
            f'{"".join(blocks)}<script type="application/json" id="{view_id}-hover">'
            f'{hover_json}</script><script>{{ {script} }}</script></div>')


def token_view_page(pieces: Sequence[str], routes: Sequence[torch.Tensor | None],
                    chunk_size: int, probs: Sequence[torch.Tensor | None] | None = None,
                    relevant: Sequence[bool] | None = None, title: str = "Token routes",
                    ) -> str:
    """:func:`token_view_html` as a whole HTML page."""
    body = token_view_html(pieces, routes, chunk_size, probs, relevant)
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title><style>body {{ font-family: sans-serif; margin: 24px; }}{TOKEN_VIEW_CSS}"
            f"</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")
