"""Which needles does a routed model miss: those a chunk boundary cuts, and why?

    python experiments/needle_cut.py RUN [RUN ...] [--rows 512] [--out cut.json]
    python experiments/needle_cut.py RUN --calibrate-budget 0.4   # routes more chunks

Each RUN is a needle run folder (``needle.py``'s ``OUT/runs/TAG``, or any ``nats train
--task needle`` run). On its training length, text haystack, no distractor, ``--rows``
test rows (the test stream of ``needle.py``), it prints whole answers for needles inside
one chunk and for needles cut by a boundary, the cut ones by how many of the needle's
tokens fall in its first chunk, and per routing head of every NAtS-L layer how the
needle's chunk was routed (``SM`` or ``LA``) and how the two chunks of a cut needle were
(``SM+LA``: the first to softmax, the second to linear), with the whole answers of each
pattern: are the misses the router's? A needle whose (last) chunk is a row's last, which
has no route, is left out of the patterns. ``--calibrate-budget F``
first sets each budgeted layer's routing bias so that it routes F of the chunks of 8
calibration batches of the same slice (as ``nats eval --calibrate-budget``): does a router
given more share keep both parts of a cut needle?

``--distractors D`` hides D more needles with other keys in every row (as ``needle.py``'s
test slices with distractors): each route pattern then also says how many distractors went
whole to softmax (``SM d2/2``), and the missed answers that are a distractor's value are
counted: a model that answers a distractor read a needle but matched the wrong key. A row
any of whose needles reaches its last chunk is then left out of the patterns.

Every wrong digit of a missed answer is also checked for two slips, each against the count
that wrong digits drawn at random would give: the digit that follows the answer's previous
token (the right previous digit, or the key's last token) somewhere else in the row, as
an induction head that matched the wrong occurrence would copy (with distractors: in
one of them), and a neighbour of the right digit in the needle (a slip of position).
Only digits an answer could hold count on either side (no 0 first, no other token).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

from nats.kernels import SOFTMAX
from nats.trainers import build_batches, resolve_device
from nats.trainers.evaluation import span_bounds
from nats.trainers.loop import autocast_for
from nats.trainers.route_control import calibrate_budget
from nats.trainers.sources import load_model


def _ratio(counts: list[int]) -> str:
    return f"{counts[0] / max(counts[1], 1):.3f} ({counts[0]}/{counts[1]})"


def _needles(row: list[int], filler_start: int, width: int) -> list[int]:
    """Where every needle of a row's body starts: keys and digits never occur in the
    haystack, so its non-filler tokens, in order, are the needles' ``width`` tokens each."""
    marked = [i for i, token in enumerate(row[:-width]) if token < filler_start]
    return marked[::width]


def _slips(row: list[int], answer: list[int], start: int, width: int) -> list[float]:
    """``[wrong digits, successor slips, expected by chance, neighbour slips, expected]``
    of one answer (see the module's docstring); ``start`` is where the right needle begins."""
    digits = len(answer)
    value, body = row[-digits:], row[:-width]
    out = [0.0] * 5
    for i, (got, want) in enumerate(zip(answer, value, strict=True)):
        if got == want:
            continue
        prev = row[len(row) - digits - 1 + i]  # the token the model read before digit i
        wrong = set(range(1 if i == 0 else 0, 10)) - {want}  # the first digit is not 0
        elsewhere = wrong & {body[j + 1] for j in range(len(body) - 1)
                             if body[j] == prev and not start <= j + 1 < start + width}
        neighbours = wrong & {value[k] for k in (i - 1, i + 1) if 0 <= k < digits}
        out[0] += 1
        out[1] += got in elsewhere
        out[2] += len(elsewhere) / len(wrong)
        out[3] += got in neighbours
        out[4] += len(neighbours) / len(wrong)
    return out


@torch.no_grad()
def analyse(run: str, rows: int, budget: float | None, device: torch.device,
            distractors: int = 0) -> dict:
    loaded = load_model(run, device)
    model, config = loaded.model.eval(), loaded.train_config
    if config.task != "needle":
        raise SystemExit(f"needle_cut: {run} was trained on {config.task!r}, not the needle")
    config = config.replace(needle_distractors=distractors, needle_haystack="text",
                            eval_seed=common.TEST_EVAL_SEED)
    task, c = config.synthetic_task(), model.config.chunk_size
    width, digits = task.key_len + task.VALUE_DIGITS, task.VALUE_DIGITS
    if budget is not None:
        calibrate_budget(model, [ids.to(device) for ids, _ in
                                 build_batches(config).calibration(8)], budget)
    # Every routed layer: the layer that routes the needle differs between seeds.
    nats_layers = [i for i, t in enumerate(model.config.layer_types) if t == "nats"]
    whole = {group: [0, 0] for group in ("inside", "cut")}
    answered_distractor = [0, 0]  # misses whose answer is a distractor's value, misses
    slips = [0.0] * 5  # summed over the misses, as _slips returns them
    by_tokens: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    patterns = {group: defaultdict(lambda: defaultdict(lambda: [0, 0]))
                for group in ("inside", "cut")}
    autocast = autocast_for(config.precision, device)
    for ids, labels in build_batches(config).eval(-(-rows // config.batch_size)):
        ids, labels = ids.to(device), labels.to(device)
        with autocast:
            out = model(ids)
        answers = out.logits[:, :-1].argmax(-1)[:, -digits:]
        solved = (answers == labels[:, -digits:]).all(1).tolist()
        marked = task.relevant_positions(ids, labels)
        start, end = (bound.tolist() for bound in span_bounds(marked))
        # Per layer [B, N, H] (the last chunk has no route, so N is one short of the row's).
        sm = {i: (out.routes[i][:, :-1, :, SOFTMAX] > 0.5).tolist() for i in nats_layers}
        rows_of_batch = zip(solved, ids.tolist(), answers.tolist(), strict=True)
        for b, (ok, row, answer) in enumerate(rows_of_batch):
            c0, c1 = start[b] // c, end[b] // c
            group = "inside" if c0 == c1 else "cut"
            whole[group][0] += ok
            whole[group][1] += 1
            if c0 != c1:
                by_tokens[c - start[b] % c][0] += ok
                by_tokens[c - start[b] % c][1] += 1
            others = [s for s in _needles(row, task.filler_tokens.start, width) if s != start[b]]
            if not ok:
                values = [row[s + width - digits:s + width] for s in others]
                answered_distractor[0] += answer in values
                answered_distractor[1] += 1
                slips = [x + y for x, y in zip(slips, _slips(row, answer, start[b], width),
                                               strict=True)]
            last = max([c1] + [(s + width - 1) // c for s in others])  # the needles' last chunk
            for layer, on_sm in sm.items():
                if last >= len(on_sm[b]):
                    continue
                for h in range(len(on_sm[b][c0])):
                    key = "+".join("SM" if on_sm[b][i][h] else "LA" for i in sorted({c0, c1}))
                    if distractors:
                        whole_sm = sum(all(on_sm[b][i][h]
                                           for i in range(s // c, (s + width - 1) // c + 1))
                                       for s in others)
                        key += f" d{whole_sm}/{distractors}"
                    patterns[group][layer, h][key][0] += ok
                    patterns[group][layer, h][key][1] += 1
    return {"run": run, "calibrated_budget": budget, "distractors": distractors,
            "chunk_size": c, "seq_len": config.seq_len, **whole,
            "misses_answering_a_distractor": answered_distractor,
            "wrong_digits": int(slips[0]),
            "slips_to_a_successor_elsewhere": {"seen": int(slips[1]), "by_chance": slips[2]},
            "slips_to_a_neighbour": {"seen": int(slips[3]), "by_chance": slips[4]},
            "cut_by_tokens_in_first_chunk": dict(sorted(by_tokens.items())),
            "nats_layers": nats_layers,
            **{f"{group}_routes": {f"layer{layer} head{h}": dict(sorted(p.items()))
                                   for (layer, h), p in sorted(heads.items())}
               for group, heads in patterns.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="needle run folders")
    parser.add_argument("--rows", type=int, default=512,
                        help="test rows (rounded up to whole batches)")
    parser.add_argument("--calibrate-budget", type=float, default=None, metavar="F",
                        help="route F of the chunks in every budgeted layer, in (0, 1)")
    parser.add_argument("--distractors", type=int, default=0, metavar="D",
                        help="more needles with other keys in every row (default 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.rows < 1:
        parser.error(f"--rows must be a positive integer, got {args.rows}")
    if args.calibrate_budget is not None and not 0 < args.calibrate_budget < 1:
        parser.error(f"--calibrate-budget must be in (0, 1), got {args.calibrate_budget}")
    if args.distractors < 0:
        parser.error(f"--distractors must be 0 or more, got {args.distractors}")
    device = resolve_device(args.device)
    results = []
    for run in args.runs:
        try:
            r = analyse(run, args.rows, args.calibrate_budget, device, args.distractors)
        except (ValueError, OSError) as error:  # not a run, or a model that cannot calibrate
            raise SystemExit(f"needle_cut: {run}: {error}") from None
        results.append(r)
        print(f"{run}: inside one chunk {_ratio(r['inside'])}, cut {_ratio(r['cut'])}")
        if args.distractors:
            print("  misses answering a distractor's value: "
                  + _ratio(r["misses_answering_a_distractor"]))
        print(f"  {r['wrong_digits']} wrong digits; slips to the previous token's successor "
              "elsewhere {seen} (by chance {by_chance:.1f}), to a neighbour {n} (by chance "
              "{n_chance:.1f})".format(**r["slips_to_a_successor_elsewhere"],
                                       n=r["slips_to_a_neighbour"]["seen"],
                                       n_chance=r["slips_to_a_neighbour"]["by_chance"]))
        print("  cut, by the needle's tokens in its first chunk: " + ", ".join(
            f"{k}: {_ratio(v)}" for k, v in r["cut_by_tokens_in_first_chunk"].items()))
        for group, what in (("inside", "the needle's chunk"), ("cut", "the two chunks")):
            for head, p in r[f"{group}_routes"].items():
                print(f"  {head}, routes of {what}: "
                      + ", ".join(f"{k} {_ratio(v)}" for k, v in p.items()))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
