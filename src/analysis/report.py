"""``nats analyze``: one self-contained HTML report of a trained model or of a search.

A model (a run folder, a checkpoint file, or a saved/exported model folder) gets: the
routing map of one input through every layer, the token-level view of that input, routing
statistics over the evaluation set (softmax fraction per layer and head, the scorer's
probabilities, task-relevant chunks against the base rate) and the cost against context
length beside all-softmax and all-linear. A search folder gets the Pareto front with the
chosen trial marked, parameter importances, the front as a table, and the model report of
the chosen trial. Pictures are also written as PNG files beside ``report.html``, which
embeds them as data URIs: the page needs no network and no other file.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from nats.atomic_write import atomic_write_bytes
from nats.config import whole_at_least
from nats.cost_model import compare_costs, fractions_from_measurement
from nats.eval_mode import eval_mode
from nats.folder_lock import LOCK_FILE, writing_into
from nats.plotting import format_si, format_tokens, histogram, save_png
from nats.trainers.evaluation import RelevantFn
from nats.trainers.routing_maps import routing_figure

from .cost_view import COST_METRICS, VARIANTS, cost_figure, cost_rows
from .route_stats import BINS, LayerRouteStats, collect_route_stats
from .token_view import TOKEN_VIEW_CSS, token_pieces, token_view_html, token_view_page

REPORT_FILE = "report.html"
MAX_TEXT_TOKENS = 1024
"""A ``--text`` input is cut to this many tokens (the token view shows every one)."""
TABLE_CONTEXTS = (1024, 4096, 16384, 65536, 262144, 1048576)
"""Context lengths of the cost table (the picture shows 1K .. 1M in powers of two)."""


def is_search_folder(path: str | os.PathLike) -> bool:
    """A search folder holds ``search.json``; anything else is a model source
    (:func:`nats.trainers.sources.load_model` says what it accepts)."""
    return (Path(path) / "search.json").is_file()


@dataclass
class ModelInput:
    """A model and the data to analyse it on."""

    model: Any
    """:class:`nats.NatsForCausalLM`."""
    origin: str
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    """Evaluation batches for the statistics."""
    description: str
    """What the batches are, for the report."""
    display: torch.Tensor
    """``[T]`` token ids of the input the routing map and the token view show."""
    display_is_first: bool = False
    """``display`` is the first sequence of ``batches`` (its routes come from that pass)."""
    tokenizer: Any = None
    """Turns ``display`` into text; ``None``: token ids are shown."""
    relevant: RelevantFn | None = None
    display_relevant: list[bool] | None = None


def _text_batches(text: str, tokenizer: Any, vocab_size: int, what: str,
                  ) -> tuple[torch.Tensor, str]:
    ids = tokenizer.encode(text)[:MAX_TEXT_TOKENS]
    if not ids:
        raise ValueError("--text holds no tokens")
    if max(ids) >= vocab_size:
        raise ValueError(f"--text: the model's vocabulary has {vocab_size} tokens, the text's "
                         f"tokens reach {max(ids)}; give the tokenizer the model was trained "
                         "with (--tokenizer)")
    return torch.tensor(ids), f"{what} ({len(ids)} tokens)"


def load_model_input(source: str | os.PathLike, *, text: str | None = None,
                     tokenizer: str | None = None, batches: int | None = None,
                     device: str = "cpu", loaded: Any = None) -> ModelInput:
    """The model of a run, checkpoint or model folder, with its evaluation data.

    Where the training run is known (a run, a checkpoint, a run's ``model/``, an export),
    the model is evaluated on the run's fixed evaluation batches (``batches`` of them,
    default the run's count) and shows the first sequence, or ``text`` when given (through
    the run's tokenizer, else UTF-8 bytes). Any other model folder has no evaluation data:
    it is analysed on ``text`` (default: a stretch of English prose from the standard
    library, for byte-level models). ``loaded``: ``source`` already loaded
    (:func:`nats.trainers.sources.load_model`)."""
    from nats.trainers import build_batches, load_tokenizer, resolve_device
    from nats.trainers.sources import load_model, text_tokenizer

    check_batches(batches)
    if is_search_folder(source):
        raise ValueError(f"{source} is a search folder; analyse it with analyze_search")
    loaded = loaded or load_model(source, resolve_device(device))
    if loaded.train_config is None:
        model = loaded.model
        tok = text_tokenizer(loaded, tokenizer, source)
        vocab = model.config.vocab_size
        if text is None:
            if vocab < 256 and tokenizer is None:
                raise ValueError(f"{source} is a model with a {vocab}-token vocabulary and "
                                 "no evaluation data: give --text with --tokenizer, or "
                                 "analyse its run folder")
            text, what = default_text(), "English prose from Python's documentation"
        else:
            what = "the given text"
        ids, described = _text_batches(text, tok, vocab, what)
        return ModelInput(model, loaded.origin,
                          [(ids[None], torch.full_like(ids[None], -100))], described, ids, True,
                          tok)
    tc = loaded.train_config
    data = build_batches(tc)
    count = tc.eval_batches if batches is None else batches
    eval_batches = data.eval(count)
    relevant = getattr(data.eval_source, "relevant_positions", None)
    described = (f"the run's first {count} evaluation batch(es) of {tc.batch_size} x "
                 f"{tc.seq_len} tokens (task {tc.task!r})")
    tok = load_tokenizer(tc.tokenizer) if tc.task == "text" else None
    if text is not None:
        tok = tok or load_tokenizer(tokenizer)
        ids, _ = _text_batches(text, tok, tc.model.vocab_size, "the given text")
        return ModelInput(loaded.model, loaded.origin, eval_batches, described, ids,
                          False, tok, relevant)
    ids, labels = eval_batches[0]
    shown = relevant(ids[:1], labels[:1])[0].tolist() if relevant is not None else None
    return ModelInput(loaded.model, loaded.origin, eval_batches, described, ids[0], True,
                      tok, relevant, shown)


def default_text() -> str:
    """English prose that every Python installation carries (``pydoc_data.topics``): the
    language reference's text on the ``with`` statement, or the first topic."""
    from pydoc_data.topics import topics

    return topics.get("with", next(iter(topics.values())))


# -- the report ------------------------------------------------------------------------------


@dataclass
class Report:
    """Sections of HTML; the PNG files are written into ``out`` beside them."""

    out: Path
    sections: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    """Machine-readable numbers, written as ``report.json``."""

    def image(self, img: Image.Image, name: str, alt: str) -> str:
        """Save ``img`` as ``out/name`` and return an ``<img>`` that embeds it."""
        return self.embed(save_png(img, self.out / name), alt)

    def embed(self, png: Path, alt: str) -> str:
        """An ``<img>`` holding the PNG file ``png`` as a data URI."""
        with Image.open(png) as img:
            width = img.width
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        return (f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" '
                f'width="{width}">')

    def add(self, title: str, *parts: str) -> None:
        self.sections.append(f"<section><h2>{html.escape(title)}</h2>{''.join(parts)}"
                             "</section>")


def html_table(columns: Sequence[str], rows: Sequence[Sequence[Any]],
               groups: Sequence[tuple[str, int]] = (), css_class: str = "") -> str:
    """An escaped table; ``groups``: an upper header row of ``(title, columns spanned)``."""
    upper = ("<tr>" + "".join(f'<th colspan="{n}">{html.escape(g)}</th>' for g, n in groups)
             + "</tr>") if groups else ""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>"
                   for r in rows)
    cls = f' class="{css_class}"' if css_class else ""
    return f"<table{cls}><thead>{upper}<tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _p(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def _rate(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def _stats_section(report: Report, stats: dict[int, LayerRouteStats], prefix: str,
                   has_relevant: bool) -> None:
    columns = ["layer", "head", "softmax fraction (tokens)", "softmax rate, all chunks"]
    if has_relevant:
        columns += ["relevant chunks", "softmax rate, relevant chunks",
                    "softmax rate, other chunks", "relevant / base"]
    rows = []
    for i, s in sorted(stats.items()):
        rel, other = s.relevant_rate, s.other_rate
        for h in range(s.heads):
            row: list[Any] = [i, h, f"{s.softmax_fraction[h]:.3f}", f"{s.base_rate[h]:.3f}"]
            if has_relevant:
                ratio = (f"{rel[h] / s.base_rate[h]:.2f}" if rel is not None and s.base_rate[h]
                         else "")
                row += [s.relevant_chunks, _rate(None if rel is None else rel[h]),
                        _rate(None if other is None else other[h]), ratio]
            rows.append(row)
    edges = [b / BINS for b in range(BINS + 1)]
    images = [report.image(histogram(edges, s.prob_hist.sum(0).tolist(),
                                     xlabel="scorer's softmax probability of a chunk",
                                     ylabel="chunks (all heads)",
                                     title=f"layer {i}: route probabilities"),
                           f"{prefix}route_probs_layer{i}.png",
                           f"histogram of layer {i}'s route probabilities")
              for i, s in sorted(stats.items())]
    relevant_note = (
        "A chunk is relevant when it holds a task-relevant position (MQAR: the pairs that "
        "are queried; needle: the needle). Its route decides whether those keys stay in the "
        "KV cache (softmax) for the later query, or are folded into the linear state. "
        "'relevant / base' above 1 means the scorer keeps relevant chunks in softmax more "
        "often than chunks in general." if has_relevant else
        "The data has no task-relevant positions (only the MQAR and needle tasks mark them).")
    report.add("Routing statistics", _p(
        "Softmax fraction: the share of tokens in chunks routed to softmax attention. "
        "Rates: the share of chunks routed to softmax. " + relevant_note),
        html_table(columns, rows), '<div class="row">', *images, "</div>")
    report.data[f"{prefix}route_stats"] = [
        {"layer": i, "softmax_fraction": s.softmax_fraction.tolist(),
         "base_rate": s.base_rate.tolist(), "relevant_chunks": s.relevant_chunks,
         "relevant_rate": None if s.relevant_rate is None else s.relevant_rate.tolist(),
         "other_rate": None if s.other_rate is None else s.other_rate.tolist(),
         "chunks": s.chunks, "prob_hist": s.prob_hist.tolist()}
        for i, s in sorted(stats.items())]


def _cost_section(report: Report, config: Any, fractions: tuple[float | None, ...],
                  prefix: str) -> None:
    curves = compare_costs(config, fractions)
    img = report.image(cost_figure(curves), f"{prefix}cost.png", "cost against context length")
    table_curves = compare_costs(config, fractions, contexts=TABLE_CONTEXTS)
    rows = cost_rows(table_curves)
    columns = ["context"] + [v for _ in COST_METRICS for v in VARIANTS]
    groups = [("", 1)] + [(m.title.split(" (")[0], len(VARIANTS)) for m in COST_METRICS]
    body = [[format_tokens(r["context"])] + [format_si(r[f"{v}/{m.key}"]) for m in COST_METRICS
                                             for v in VARIANTS] for r in rows]
    shown = ", ".join(f"layer {i}: {f:.3f}" for i, f in enumerate(fractions) if f is not None)
    report.add("Cost against context length", _p(
        "Token-mixer cost of this architecture with the measured softmax fractions "
        f"({shown or 'no NAtS-L layer'}), beside the same model with every layer plain "
        f"softmax attention or plain {config.linear_op_name} (batch 1, bf16 KV cache, fp32 "
        "state; formulas in nats.cost_model). FLOPs are per token, averaged over a sequence "
        "of the context length; KV cache and state are what decoding holds after it."),
        img, html_table(columns, body, groups))
    report.data[f"{prefix}cost"] = cost_rows(curves)


def model_sections(report: Report, inp: ModelInput, prefix: str = "",
                   progress: bool = True) -> None:
    """The model part of a report: architecture, routing map, token view, statistics,
    cost. ``prefix`` names its files apart (a search's chosen trial)."""
    cfg = inp.model.config
    arch = [["layers", ", ".join(f"{i}: {t}" for i, t in enumerate(cfg.layer_types))],
            ["chunk size", cfg.chunk_size],
            ["routing heads", f"{cfg.n_heads} per layer, each 1 linear head (d_k "
                              f"{cfg.head_dim_k}, d_v {cfg.head_dim_v}) and "
                              f"{cfg.softmax_heads_per_head} softmax heads"],
            ["d_model / vocabulary", f"{cfg.d_model} / {cfg.vocab_size}"],
            ["analysed on", inp.description]]
    report.add("Model", _p(f"From {inp.origin}."),
               html_table(["", ""], arch, css_class="plain"))
    if not cfg.layers_of("nats"):
        report.add("Routing", _p("This model has no NAtS-L layer: there are no routes to "
                                 "show. Its cost is below."))
        _cost_section(report, cfg, (None,) * cfg.n_layers, prefix)
        return
    first: list[Any] = []
    stats = collect_route_stats(inp.model, inp.batches, inp.relevant, progress=progress,
                                on_output=lambda n, o: first.append(o) if n == 0 else None)
    if inp.display_is_first:
        out = first[0]
        routes = [r[:1] if r is not None else None for r in out.routes]
        probs = [p[:1] if p is not None else None for p in out.probs]
    else:
        with eval_mode(inp.model), torch.no_grad():
            out = inp.model(inp.display[None].to(inp.model.embed.weight.device))
        routes, probs = out.routes, out.probs
    seq_len = inp.display.numel()
    fig = routing_figure(routes, cfg.layer_types, cfg.chunk_size, seq_len,
                         title=f"routes of the shown input ({seq_len} tokens)")
    report.add("Routing map", _p(
        "One input through every layer: each cell is a chunk of one routing head. Softmax "
        "chunks stay in the KV cache for the queries after them; linear chunks are written "
        "into the recurrent state. The bars give each layer's softmax fraction on this "
        "input."), report.image(fig, f"{prefix}routing_map.png", "routing map"))
    pieces = token_pieces(inp.display.tolist(), inp.tokenizer)
    routes = [r[0] if r is not None else None for r in routes]
    probs = [p[0] if p is not None else None for p in probs]
    view = token_view_html(pieces, routes, cfg.chunk_size, probs, inp.display_relevant,
                           view_id=f"{prefix}tv")
    page = token_view_page(pieces, routes, cfg.chunk_size, probs, inp.display_relevant,
                           title=f"Token routes: {inp.origin}")
    atomic_write_bytes(report.out / f"{prefix}tokens.html", page.encode("utf-8"))
    shown = "its text" if inp.tokenizer is not None else "its token ids"
    report.add("Token view", _p(f"The same input, {shown}, each chunk coloured by its route "
                                "in the chosen layer and routing head."), view)
    _stats_section(report, stats, prefix, inp.relevant is not None)
    measured = {i: float(s.softmax_tokens.sum()) / (s.tokens * s.heads)
                for i, s in stats.items()}
    _cost_section(report, cfg, fractions_from_measurement(cfg, measured), prefix)


def search_sections(report: Report, source: Path) -> str | None:
    """The search part of a report; returns the chosen trial's id (``None``: no trial
    finished)."""
    from .search_view import front_figure, front_table, importance_figure, load_search_view

    view = load_search_view(source)
    r = view.results
    done = sum(row["status"] == "done" for row in r.rows)
    report.add("Search", _p(
        f"{len(r.rows)} trials ({done} finished) of space {r.settings.space.get('name')!r}, "
        f"objectives {' and '.join(f'{k} ({m})' for k, m in zip(r.keys, r.modes, strict=True))}"
        f", cost at {r.settings.context} tokens."))
    failed = [row for row in r.rows if row["status"] == "error"]
    if failed:
        report.add("Failed trials", _p("; ".join(
            f"{row['trial_id']}: {row.get('error', '')}" for row in failed)))
    if r.front:
        embedded = report.embed(front_figure(view, report.out / "pareto.png"), "Pareto front")
        columns, rows = front_table(view)
        report.add("Pareto front", _p("Every finished trial; the front joined and numbered "
                                      "as in the table; * and the red ring: the chosen "
                                      "trial (the knee of the front), analysed below."),
                   embedded, html_table(columns, rows))
    else:
        report.add("Pareto front", _p("No trial finished with both objectives measured."))
    imp = importance_figure(view)
    if imp is not None:
        report.add("Parameter importance", _p(
            "Optuna's parameter importances (its default evaluator) over the completed "
            "trials of the study, per objective."),
            report.image(imp, "importance.png", "parameter importance"))
    else:
        report.add("Parameter importance", _p(f"Not available: {view.importance_note}."))
    report.data["front"] = view.front_rows
    report.data["importances"] = view.importances
    return None if view.chosen is None else r.rows[view.chosen]["trial_id"]


def check_batches(batches: int | None) -> None:
    """``--batches``: ``None`` (the run's own count) or a count."""
    if batches is not None and not whole_at_least(batches):
        raise ValueError(f"--batches {batches!r}: must be an integer >= 1")


def analyze(source: str | os.PathLike, out_dir: str | os.PathLike, *, text: str | None = None,
            tokenizer: str | None = None, batches: int | None = None, device: str = "cpu",
            progress: bool = True) -> tuple[Path, list[Path]]:
    """Write ``out_dir/report.html`` (and its pictures, ``tokens.html``, ``report.json``)
    for a model or a search; returns the report's path and every file written.

    ``out_dir`` must be new, empty or an earlier report's folder, whose files the new
    report replaces (also those it does not write again); it is held for the analysis
    (:func:`nats.folder_lock.writing_into`), so a second one into it is refused. The report
    is written into a staging folder inside ``out_dir`` and moved in at the end,
    ``report.html`` last: an analysis cut short leaves the earlier page whole, and a failed
    one leaves no new folders."""
    from nats.trainers import load_tokenizer, resolve_device

    out = Path(out_dir)
    if not Path(source).exists():
        raise FileNotFoundError(f"{source} does not exist: give a run folder, a checkpoint "
                                "file, a saved or exported model folder, or a search folder")
    # The options first: a search's chosen trial must not fail on them after the search
    # part is drawn (nor be reported as unloadable for them).
    check_batches(batches)
    resolve_device(device)
    load_tokenizer(tokenizer)
    _check_report_folder(out)
    with writing_into(out, "report folder"):  # a second analysis into it is refused
        written = _write_report(out, source, text=text, tokenizer=tokenizer,
                                batches=batches, device=device, progress=progress)
    return out / REPORT_FILE, [out / name for name in written]


def _write_report(out: Path, source: str | os.PathLike, *, progress: bool,
                  **options: Any) -> list[str]:
    """The report, staged inside ``out`` (held) and moved in, ``report.html`` last; the
    names of the files written. What an analysis killed outright left is cleared first."""
    for path in out.iterdir():
        if _leftover(path):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    stage = out / f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    stage.mkdir()
    try:
        report = Report(stage)
        title = f"nats analysis of {source}"
        if is_search_folder(source):
            trial = search_sections(report, Path(source))
            if trial is not None:
                _chosen_trial_sections(report, Path(source) / "trials" / trial, trial,
                                       progress=progress, **options)
        else:
            model_sections(report, load_model_input(source, **options), progress=progress)
        atomic_write_bytes(stage / "report.json", json.dumps(
            _plain(report.data), indent=2, allow_nan=False).encode())
        atomic_write_bytes(stage / REPORT_FILE,
                           render_page(title, report.sections).encode("utf-8"))
        written = [*sorted(p.name for p in stage.iterdir() if p.name != REPORT_FILE),
                   REPORT_FILE]
        stale = [p for p in _report_files(out) if p.name not in written]
        for name in written:
            os.replace(stage / name, out / name)
        for path in stale:
            path.unlink()
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return written


STAGING_PREFIX = ".nats-analyze-"
REPORT_NAMES = re.compile(r"(report\.html|report\.json|(chosen_)?tokens\.html|(chosen_)?"
                          r"(routing_map|cost|route_probs_layer\d+)\.png|pareto\.png"
                          r"|importance\.png)")
"""The files a report writes: what an earlier report's folder may hold."""


def _report_files(out: Path) -> list[Path]:
    return [p for p in out.iterdir() if p.is_file() and REPORT_NAMES.fullmatch(p.name)]


def _leftover(path: Path) -> bool:
    """What an analysis killed outright may leave (besides its lock file): its staging
    folder, or the temporary file of a report file's write cut short (``.NAME.*.tmp``)."""
    if path.name.startswith(STAGING_PREFIX):
        return True
    parts = path.name.split(".")
    return path.name.startswith(".") and path.name.endswith(".tmp") and len(parts) > 3 \
        and REPORT_NAMES.fullmatch(".".join(parts[1:-2])) is not None


def _check_report_folder(out: Path) -> None:
    """``out`` is absent, empty or an earlier report's: nothing else is overwritten (an
    export's routing map, a search's Pareto front). Leftovers of a killed analysis are
    cleared once the folder is held (:func:`_write_report`)."""
    if out.is_symlink() and not out.exists():
        raise FileNotFoundError(f"--out {out} is a link to {os.readlink(out)}, which does "
                                "not exist")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    if not out.is_dir():
        return
    others = sorted(p.name for p in out.iterdir()
                    if not ((p.is_file() and REPORT_NAMES.fullmatch(p.name))
                            or p.name == LOCK_FILE or _leftover(p)))
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise FileExistsError(f"--out {out} holds files that are not a report's ({shown}): "
                              "give a new or empty folder, or an earlier report's")


def _chosen_trial_sections(report: Report, folder: Path, trial: str, *, device: str,
                           progress: bool, **options: Any) -> None:
    """The model part of a search report for its chosen trial; a trial that cannot be
    loaded (deleted, damaged) is said in the report instead of losing the search part."""
    from nats.trainers import resolve_device
    from nats.trainers.sources import load_model

    report.sections.append(f"<h1>Chosen trial {html.escape(trial)}</h1>")
    try:
        loaded = load_model(folder, resolve_device(device))
    except (ValueError, OSError) as e:
        report.add("Not analysed", _p(f"The chosen trial's model could not be loaded: {e}"))
        report.data["chosen_error"] = str(e)
        return
    inp = load_model_input(folder, device=device, loaded=loaded, **options)
    model_sections(report, inp, prefix="chosen_", progress=progress)


def _plain(v: Any) -> Any:
    """``v`` as standard JSON holds it: arrays as lists, a non-finite number as ``null``
    (``NaN`` is not JSON: browsers' ``JSON.parse`` refuses it), anything else as text."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


PAGE_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 24px auto;
  max-width: 1100px; padding: 0 16px; color: #222; }
h1 { font-size: 24px; } h2 { font-size: 19px; border-bottom: 1px solid #ddd; padding: 4px 0; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
table.plain td { text-align: left; } table.plain thead { display: none; }
img { max-width: 100%; height: auto; display: block; margin: 8px 0; }
.row { display: flex; flex-wrap: wrap; gap: 12px; } .row img { max-width: 48%; }
section { margin-bottom: 28px; overflow-x: auto; }
"""


def render_page(title: str, sections: Sequence[str]) -> str:
    """The whole report page: inline CSS, the sections, nothing fetched."""
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title><style>{PAGE_CSS}{TOKEN_VIEW_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>\n")
