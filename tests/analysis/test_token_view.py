"""The token view: escaped text, one span per chunk with its route, per layer and head."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nats.analysis.token_view import token_pieces, token_view_html, token_view_page
from nats.trainers import ByteTokenizer

from ..routes import routes_from_choices


def _views(page: str) -> dict[str, list[tuple[str, str]]]:
    """View id -> [(route class, inner html)] of its chunk spans, in order."""
    out = {}
    for key, body in re.findall(r'<div class="tv-text" id="tv-(l\d+h\d+)"[^>]*>(.*?)</div>',
                                page, flags=re.S):
        out[key] = re.findall(r'<span class="chunk (sm|la)" data-chunk="\d+">'
                              r'(.*?)</span>(?=<span class="chunk|$)', body, flags=re.S)
    return out


def _hover(page: str) -> list[str]:
    """The hover text of every chunk, as the page's script reads it."""
    (block,) = re.findall(r'<script type="application/json" id="tv-hover">(.*?)</script>',
                          page, flags=re.S)
    return json.loads(block)


def test_one_span_per_chunk_with_its_route_and_escaped_text() -> None:
    text = "<b>&'x\" y\nz!"  # 12 characters, one byte each: chunks of 4
    pieces = token_pieces(ByteTokenizer().encode(text), ByteTokenizer())
    layer0 = routes_from_choices([[1, 0], [0, 0], [0, 1]])
    layer2 = routes_from_choices([[0], [1], [1]])
    page = token_view_html(pieces, [layer0, None, layer2], chunk_size=4)
    views = _views(page)
    assert list(views) == ["l0h0", "l0h1", "l2h0"]
    assert [c for c, _ in views["l0h0"]] == ["sm", "la", "la"]
    assert [c for c, _ in views["l0h1"]] == ["la", "la", "sm"]
    assert [c for c, _ in views["l2h0"]] == ["la", "sm", "sm"]
    assert [t for _, t in views["l0h0"]] == ["&lt;b&gt;&amp;", "&#x27;x&quot; ",
                                                "y\nz!"]
    assert "<b>" not in page
    # The selector lists every view, the first shown and the others hidden.
    assert re.findall(r'<option value="(l\d+h\d+)">', page) == ["l0h0", "l0h1", "l2h0"]
    assert page.count(" hidden>") == 2


def test_partial_last_chunk_hover_and_relevant_tokens() -> None:
    pieces = [f"{t} " for t in range(6)]  # 6 tokens, chunks of 4: the last holds 2
    probs = torch.tensor([[[0.9, 0.1]], [[0.2, 0.8]]])
    page = token_view_html(pieces, [routes_from_choices([[1], [0]])], chunk_size=4, probs=[probs],
                           relevant=[False, True, False, False, False, True])
    spans = _views(page)["l0h0"]
    assert [c for c, _ in spans] == ["sm", "la"]
    assert spans[0][1] == '0 <span class="rel">1 </span>2 3 '
    assert spans[1][1] == '4 <span class="rel">5 </span>'
    assert _hover(page) == ["chunk 0: tokens 0..3\nlayer 0 head 0: softmax, p(softmax) 0.90",
                            "chunk 1: tokens 4..5\nlayer 0 head 0: linear, p(softmax) 0.20"]


def test_the_page_grows_linearly_with_the_heads() -> None:
    """Each chunk's hover text is on the page once, not on every view's copy of the chunk
    (which grew with the square of layers x heads)."""
    pieces = ["</script>x"] * 64

    def size(heads: int) -> int:
        routes = routes_from_choices([[c % 2] * heads for c in range(4)])
        return len(token_view_html(pieces, [routes] * 4, chunk_size=16))

    small, large = size(4), size(16)
    assert large < 4.5 * small  # 4x the views: a little over 4x the page, not 16x
    page = token_view_html(pieces, [routes_from_choices([[1], [0], [1], [0]])], chunk_size=16,
                           probs=[torch.full((4, 1, 2), 0.5)])
    assert len(_hover(page)) == 4 and "&lt;/script&gt;x" in page


def test_pieces_of_bytes_tokenizers_and_ids() -> None:
    ids = ByteTokenizer().encode("aé€")  # 1 + 2 + 3 bytes
    assert token_pieces(ids, ByteTokenizer()) == ["a", "", "é", "", "", "€"]
    assert token_pieces([3, 14], None) == ["3 ", "14 "]


def test_page_is_self_contained_and_rejects_bad_input() -> None:
    page = token_view_page(["a", "b"], [routes_from_choices([[1]])], chunk_size=2, title="t <1>")
    assert page.startswith("<!DOCTYPE html>") and "t &lt;1&gt;" in page
    assert "http" not in page and "src=" not in page
    with pytest.raises(ValueError, match="no NAtS-L layer"):
        token_view_html(["a"], [None], chunk_size=2)
    with pytest.raises(ValueError, match=r"not \[2, H, 2\]"):
        token_view_html(["a"] * 3, [routes_from_choices([[1]])], chunk_size=2)
