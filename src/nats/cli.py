"""The ``nats`` command: a thin layer over :mod:`nats.trainers`; only what works is offered.

Bad input ends with one ``nats: error: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from nats import NatsConfig, NatsForCausalLM

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
EXIT_BROKEN_PIPE = 141
"""What a shell reports for a command its pipe's reader stopped (128 + SIGPIPE)."""
_BY_HAND = ("model", "out_dir", "data_paths")
"""``TrainConfig`` fields whose ``nats train`` options are written by hand (``--out``,
``--data``; the model's fields get options of their own). Every other field of
``TrainConfig`` and ``NatsConfig`` becomes ``--field-name`` (:func:`_add_config_options`)."""
TEXT_OPTIONS = ("data_paths", "data_glob", "data_format", "text_field", "tokenizer",
                "streaming")
"""``nats train`` options that only a text run reads (a generated task ignores them)."""


def _field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal after it), read from the source,
    with a named tuple constant of the class's module (``TASKS``) spelled out."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    module = vars(sys.modules[cls.__module__])

    def spell(match: re.Match[str]) -> str:
        value = module.get(match.group(1))
        return ", ".join(map(str, value)) if isinstance(value, tuple) else match.group(0)

    return {a.target.id: re.sub(r"\b([A-Z][A-Z_]{2,})\b", spell, b.value.value)
            for a, b in itertools.pairwise(body)
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)}


_NONE = object()
"""What an optional field's option parses ``none`` to (None means "not given")."""


def _optional(kind: type) -> Any:
    def parse(text: str) -> Any:
        return _NONE if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def _add_config_options(group: Any, cls: type, skip: Sequence[str] = ()) -> list[str]:
    """One option per field of dataclass ``cls``, typed by its annotation, its help the
    first sentence of its docstring; returns the fields (the options' ``dest``). Every
    default is None: only what the user gives overrides the preset."""
    kinds = {"int": int, "float": float, "str": str}
    docs = _field_docs(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        annotation = str(f.type).replace(" ", "")
        doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", docs.get(f.name, "")).replace("``", "")
        doc = " ".join(doc.split())
        doc = doc.split(". ")[0].rstrip(".").replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        if annotation in ("bool", "bool|None"):  # not given: the preset's (or the default)
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=doc)
        elif annotation.startswith("tuple["):
            kind = kinds[annotation[len("tuple["):].split(",")[0]]
            group.add_argument(flag, type=kind, nargs="+", metavar=f.name.upper(), help=doc)
        elif annotation.endswith("|None"):
            group.add_argument(flag, type=_optional(kinds[annotation[:-len("|None")]]),
                               metavar=f.name.upper(), help=f"{doc} ('none': unset)")
        else:
            group.add_argument(flag, type=kinds[annotation], metavar=f.name.upper(), help=doc)
        names.append(f.name)
    return names


class _Parser(argparse.ArgumentParser):
    """Reports usage errors in one line, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"nats: error: {message}\n")


def _train(args: argparse.Namespace) -> int:
    from nats.trainers import run_config, train

    def given(names: Sequence[str]) -> dict[str, Any]:
        values = {name: getattr(args, name) for name in names}
        return {name: None if value is _NONE else tuple(value) if isinstance(value, list)
                else value for name, value in values.items() if value is not None}

    arch = None if args.arch is None else (args.arch, args.softmax_every)
    fields = given(args.train_fields)
    config = run_config(args.preset, fields, resume=args.resume,
                        config_path=args.config, model_overrides=given(args.model_fields),
                        arch=arch)
    text_only = [name for name in TEXT_OPTIONS if name in fields]
    if text_only and config.task != "text":
        shown = ", ".join("--data" if n == "data_paths" else f"--{n.replace('_', '-')}"
                          for n in text_only)
        raise ValueError(f"{shown}: read by task 'text' only, and this run's task is "
                         f"{config.task!r} (add --task text to train on text)")
    result = train(config, resume=args.resume)
    if result.interrupted:
        print(f"nats: interrupted at step {result.step}; continue with: "
              f"nats train --resume --out {config.out_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _load(source: str, device: str) -> NatsForCausalLM:
    """The model of a run folder, a checkpoint file, or a saved or exported model folder."""
    from nats.trainers import resolve_device
    from nats.trainers.sources import load_model

    return load_model(source, resolve_device(device)).model


def _generate(args: argparse.Namespace) -> int:
    from nats.trainers import generate_text, resolve_device
    from nats.trainers.sources import load_model, text_tokenizer

    loaded = load_model(args.model_dir, resolve_device(args.device))
    model = loaded.model
    device = model.embed.weight.device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    sampling = dict(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
                    generator=generator, max_prompt_tokens=args.max_prompt_tokens)
    if args.tokens is None:
        tokenizer = text_tokenizer(loaded, args.tokenizer, args.model_dir)
        print(args.prompt + generate_text(model, args.prompt, args.max_new_tokens, tokenizer,
                                          **sampling))
        return 0
    prompt = _token_ids(args.tokens, model.config.vocab_size)
    out = model.generate(torch.tensor([prompt], device=device), args.max_new_tokens, **sampling)
    print(" ".join(str(t) for t in out[0].tolist()))
    return 0


def _token_ids(text: str, vocab_size: int) -> list[int]:
    """Token ids from ``"3 5 7"`` or ``"3,5,7"``, each inside the model's vocabulary."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--tokens takes whole numbers separated by spaces or commas, "
                         f"got {text!r}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise ValueError(f"--tokens needs ids in 0..{vocab_size - 1}, got {text!r}")
    return ids


def _bench(args: argparse.Namespace) -> int:
    from nats.kernels.bench import BenchShape, run_benchmark

    shape = BenchShape(tokens=args.tokens, seq_lens=tuple(args.seq_lens),
                       fractions=tuple(args.fractions), chunk_size=args.chunk_size)
    if not torch.cuda.is_available():
        raise ValueError("nats bench kernels needs a CUDA GPU: kernel timings under the CPU "
                         "interpreter mean nothing")
    run_benchmark(shape, args.out)
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    from nats.evaluation.decode_benchmark import run_decode_benchmark

    run_decode_benchmark(tuple(args.context), tuple(args.fractions), args.steps, args.out)
    return 0


def _bench_model(args: argparse.Namespace) -> int:
    from nats.evaluation.model_bench import (
        default_config,
        hybrid_ratio_table,
        ratio_table,
        run_model_benchmark,
    )

    config = default_config(
        args.device, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        head_dim=args.head_dim, vocab_size=args.vocab_size, chunk_size=args.chunk_size,
        fractions=args.fractions, layer_hybrid_shares=args.layer_hybrid_shares,
        train_lens=args.train_lens, train_tokens=args.train_tokens,
        prefill_lens=args.prefill_lens, decode_contexts=args.decode_contexts,
        decode_steps=args.decode_steps, repeats=args.repeats, compile=args.compile,
        cuda_graph=args.cuda_graph)
    report = run_model_benchmark(config, args.out)
    print(ratio_table(report))
    if any(r["variant"].startswith("nats@") for r in report["rows"]):
        print()
        print(hybrid_ratio_table(report))
    print(f"nats: wrote {args.out}")
    return 0


def _bench_attention(args: argparse.Namespace) -> int:
    from nats.evaluation.attention_bench import default_config, run_attention_benchmark
    from nats.trainers import resolve_device

    config = default_config(
        str(resolve_device(args.device)), seq_lens=args.seq_lens, runs=args.runs,
        recurrent_runs=args.recurrent_runs, recurrent_max_len=args.recurrent_max_len,
        decode_contexts=args.decode_contexts,
        warmup=args.warmup, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        chunk_size=args.chunk_size, dtype=args.dtype, ops=args.ops)
    run_attention_benchmark(config, args.out)
    print(f"nats: wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def _info(args: argparse.Namespace) -> int:
    model = _load(args.model_dir, "cpu")
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()),
                      "layer_types": list(model.config.layer_types),
                      "config": model.config.to_dict()}, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from nats.trainers.export import export_architecture

    result = export_architecture(args.source, args.out, weights=not args.no_weights,
                                 plain_layers=args.plain_layers, eval_batches=args.eval_batches,
                                 device=args.device, force=args.force)
    print(f"nats: exported {result.origin}")
    for i, trained in enumerate(result.trained_layer_types):
        f = result.fractions.get(i)
        kind = result.config.layer_types[i]
        measured = (f"softmax fraction {f.overall:.3f} (heads "
                    f"{' '.join(f'{x:.3f}' for x in f.per_head)}), {f.kind}" if f else "")
        became = f" -> {kind} (mixer freshly initialised)" if i in result.converted else ""
        print(f"  layer {i}: {trained}{became}" + (f", {measured}" if measured else ""))
    print(f"nats: wrote {', '.join(p.name for p in result.files)} to {result.out_dir}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from nats.official import model_from_official, save_official
    from nats.trainers.export import check_out_dir

    out = Path(args.out)
    check_out_dir(out, args.force)
    if args.direction == "from-official":
        model = model_from_official(args.source)
        model.save_pretrained(out)
    else:
        model = _load(args.source, "cpu")
        save_official(model, out)
        if model.config.chunk_size < 64:
            print(f"nats: warning: chunk_size {model.config.chunk_size}: the official kernels "
                  "assert routing blocks of at least 64 tokens on Hopper GPUs (in training, "
                  "and in inference past 32 tokens); this folder loads here, and may not "
                  "run there", file=sys.stderr)
    kinds = ", ".join(f"{n} {k}" for k, n in
                      sorted({k: model.config.layer_types.count(k)
                              for k in model.config.layer_types}.items()))
    print(f"nats: wrote {out} ({args.direction}: {model.config.n_layers} layers, {kinds}; "
          f"{sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from nats.analysis.report import analyze

    text = None
    if args.text is not None:
        try:
            text = Path(args.text).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ValueError(f"--text {args.text}: {e.strerror or e}") from None
    path, files = analyze(args.source, args.out, text=text, tokenizer=args.tokenizer,
                          batches=args.batches, device=args.device)
    beside = sorted(f.name for f in files if f != path)
    print(f"nats: wrote the report to {path}" + (f" (beside it: {', '.join(beside)})"
                                                 if beside else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from nats.kernels.bench import BenchShape
    from nats.trainers import PRESETS, TrainConfig
    from nats.trainers.config import ARCHITECTURES

    parser = _Parser(prog="nats", description="NAtS-L: token-level hybrid attention search.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model from a preset (resumable)")
    train.add_argument("--preset", choices=PRESETS,
                       help="named configuration (default: tiny)")
    train.add_argument("--config", metavar="JSON",
                       help="a model's config.json (replaces the preset's model) or a run's "
                            "train_config.json (replaces the whole preset)")
    train.add_argument("--arch", choices=ARCHITECTURES,
                       help="replace the preset's mixers by a baseline's (same width, depth)")
    train.add_argument("--softmax-every", type=int, default=2, metavar="K",
                       help="layer-hybrid / natsl: softmax (NAtS-L) in every K-th layer")
    train.add_argument("--out", dest="out_dir", help="run folder: logs, checkpoints, model/")
    train.add_argument("--data", dest="data_paths", nargs="+", metavar="PATH",
                       help="files, folders or a save_to_disk folder for task 'text' "
                            "(default: the Python stdlib)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in the run folder")
    train_fields = _add_config_options(
        train.add_argument_group("training (TrainConfig; default: the preset's)"), TrainConfig,
        skip=_BY_HAND)
    model_fields = _add_config_options(
        train.add_argument_group("model (NatsConfig; default: the preset's)"), NatsConfig)
    train.set_defaults(func=_train, train_fields=[*train_fields, "out_dir", "data_paths"],
                       model_fields=model_fields)

    gen = sub.add_parser("generate", help="continue a prompt with a saved model")
    gen.add_argument("model_dir", metavar="SOURCE",
                     help="a run folder, a checkpoint file, or a saved or exported model folder")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="def ",
                        help="text, as UTF-8 bytes or through --tokenizer")
    prompt.add_argument("--tokens", help="token ids, e.g. '3 9 4 0' (any model)")
    gen.add_argument("--tokenizer", metavar="DIR",
                     help="the tokenizer.json the model was trained with (default: a text "
                          "run's own; bytes for a byte-level model)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--max-prompt-tokens", type=int, default=4096,
                     help="refuse longer prompts (the prefill's memory grows with the "
                          "square of the prompt)")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    gen.set_defaults(func=_generate)

    info = sub.add_parser("info", help="describe a saved model")
    info.add_argument("model_dir", metavar="SOURCE",
                      help="a run folder, a checkpoint file, or a model folder")
    info.set_defaults(func=_info)

    export = sub.add_parser(
        "export", help="write a run's architecture, weights and a README to a model folder")
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                        help="a run folder (its model/, else, or when the run was resumed "
                             "past it, its newest checkpoint) or a checkpoint file")
    export.add_argument("--out", required=True, help="folder to write (absent or empty)")
    export.add_argument("--no-weights", action="store_true",
                        help="write config.json and README.md only")
    export.add_argument("--plain-layers", action="store_true",
                        help="export NAtS-L layers routed all-softmax / all-linear on the "
                             "evaluation data as plain softmax / linear (linear_op) layers "
                             "(their mixers freshly initialised)")
    export.add_argument("--eval-batches", type=int,
                        help="evaluation batches to measure routes on (default: the run's; "
                             "0: do not measure)")
    export.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    export.add_argument("--force", action="store_true",
                        help="write into a non-empty --out, replacing the exported files")
    export.set_defaults(func=_export)

    convert = sub.add_parser(
        "convert", help="official NAtS-L checkpoints (automl/NeuralAttentionSearchLinear) "
                        "to a model folder, and back")
    convert.add_argument("direction", choices=("from-official", "to-official"),
                         help="from-official: an official model folder (config.json, "
                              "safetensors) to ours; to-official: ours to that layout")
    convert.add_argument("source", metavar="SOURCE",
                         help="the official model folder; for to-official a run folder, "
                              "checkpoint file or model folder")
    convert.add_argument("--out", required=True, help="folder to write (absent or empty)")
    convert.add_argument("--force", action="store_true",
                         help="write into a non-empty --out, replacing config.json and "
                              "model.safetensors")
    convert.set_defaults(func=_convert)

    analyze = sub.add_parser(
        "analyze", help="an HTML report of a model's routes and costs, or of a search")
    analyze.add_argument("source", metavar="RUN_OR_SEARCH_DIR",
                         help="a run folder, checkpoint file, saved/exported model folder or "
                              "search folder")
    analyze.add_argument("--out", required=True, help="folder for report.html and its pictures")
    analyze.add_argument("--text", metavar="FILE",
                         help="a text file to show routes on (default: the run's first "
                              "evaluation sequence; for a model folder, stdlib prose)")
    analyze.add_argument("--tokenizer", metavar="DIR",
                         help="tokenizer.json for --text when the model is not byte-level "
                              "(a text run's own tokenizer is used without it)")
    analyze.add_argument("--batches", type=int,
                         help="evaluation batches for the statistics (default: the run's)")
    analyze.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    analyze.set_defaults(func=_analyze)

    from nats.search_spaces.cli import add_search_parser

    add_search_parser(sub)

    from nats.evaluation.cli import add_eval_parser
    from nats.evaluation.ruler import add_ruler_parser

    add_eval_parser(sub)
    add_ruler_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (kernels and decode need a GPU)")
    bench_sub = bench.add_subparsers(dest="bench_target", required=True, metavar="TARGET")
    kernels = bench_sub.add_parser(
        "kernels", help="the mixed operator vs SDPA, FlexAttention and fla (needs a GPU)")
    default = BenchShape()
    kernels.add_argument("--seq-lens", type=int, nargs="+", default=list(default.seq_lens))
    kernels.add_argument("--fractions", type=float, nargs="+", default=list(default.fractions),
                         help="softmax fractions of the routes")
    kernels.add_argument("--tokens", type=int, default=default.tokens, help="B*T per shape")
    kernels.add_argument("--chunk-size", type=int, default=default.chunk_size)
    kernels.add_argument("--out", type=Path, default=Path("bench/kernels.json"),
                         help="JSON file of every timing")
    kernels.set_defaults(func=_bench)
    decode = bench_sub.add_parser(
        "decode", help="ms per token against a long hybrid cache vs a full KV cache (GPU)")
    decode.add_argument("--context", type=int, nargs="+", default=[8192, 32768],
                        help="prefilled tokens (one run per length)")
    decode.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 1.0])
    decode.add_argument("--steps", type=int, default=200,
                        help="timed decode steps (several chunk ends)")
    decode.add_argument("--out", type=Path, default=Path("bench/decode.json"))
    decode.set_defaults(func=_bench_decode)
    _add_bench_attention(bench_sub)
    _add_bench_model(bench_sub)
    return parser


def _add_bench_model(bench_sub: argparse._SubParsersAction) -> None:
    from nats.evaluation.model_bench import CPU_CHECK, ModelBenchConfig

    d = ModelBenchConfig()

    def shown(name: str) -> str:
        gpu, cpu = getattr(d, name), CPU_CHECK.get(name, getattr(d, name))
        return f"default {gpu}" + ("" if cpu == gpu else f"; with --device cpu {cpu}")

    model = bench_sub.add_parser(
        "model", help="a 12-layer model: training tokens/s, memory, prefill and decode of "
                      "the transformer, all-linear, NAtS-L at forced fractions, layer hybrids")
    for name in ("d_model", "n_layers", "n_heads", "head_dim", "vocab_size", "chunk_size",
                 "train_tokens", "decode_steps", "repeats"):
        model.add_argument(f"--{name.replace('_', '-')}", type=int, help=shown(name))
    for name in ("fractions", "layer_hybrid_shares"):
        model.add_argument(f"--{name.replace('_', '-')}", type=float, nargs="+",
                           help=shown(name))
    for name in ("train_lens", "prefill_lens", "decode_contexts"):
        model.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="*",
                           help=f"none: skip this measure ({shown(name)})")
    model.add_argument("--compile", action="store_true",
                       help="torch.compile each model's training forward, as nats train "
                            "--compile does")
    model.add_argument("--cuda-graph", action="store_true",
                       help="replay each training step and each prefill from a CUDA graph "
                            "(captured in the warm-up): without Python and launch overhead")
    model.add_argument("--device", default=d.device,
                       help="cuda (the figures) or cpu (a check of the command, on a small "
                            "model unless sizes are given)")
    model.add_argument("--out", type=Path, default=Path("bench/model.json"))
    model.set_defaults(func=_bench_model)


def _add_bench_attention(bench_sub: argparse._SubParsersAction) -> None:
    from nats.config import LINEAR_OPS

    attention = bench_sub.add_parser(
        "attention", help="one softmax layer vs one linear-attention layer: forward time "
                          "against T, decoding latency and memory against context (CPU or GPU)")
    attention.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    attention.add_argument("--seq-lens", type=int, nargs="+",
                           help="forward lengths (default: GPU 128 .. 65536, CPU 128 .. 512)")
    attention.add_argument("--runs", type=int, help="timed runs per point (GPU 100, CPU 3)")
    attention.add_argument("--recurrent-runs", type=int,
                           help="timed runs of the token-by-token forms (GPU 10, CPU 2)")
    attention.add_argument("--recurrent-max-len", type=int,
                           help="longest T for the token-by-token forms (GPU 1024, CPU 256)")
    attention.add_argument("--decode-contexts", type=int, nargs="+",
                           help="context lengths of the decode step (GPU to 1M, CPU to 8192)")
    attention.add_argument("--warmup", type=int, help="untimed runs first (GPU 5, CPU 1)")
    attention.add_argument("--batch", type=int, help="batch size (default 32)")
    attention.add_argument("--heads", type=int, help="heads (default 1)")
    attention.add_argument("--head-dim", type=int, help="d_k = d_v (default 64)")
    attention.add_argument("--chunk-size", type=int, help="chunk of the chunked forms (64)")
    attention.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                           help="inputs (GPU bfloat16, CPU float32); states are float32")
    attention.add_argument("--ops", nargs="+", choices=LINEAR_OPS,
                           help="linear operators to compare (default: all)")
    attention.add_argument("--out", type=Path, default=Path("bench/attention.json"),
                           help="JSON file; the plot goes beside it (.png)")
    attention.set_defaults(func=_bench_attention)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nats`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader stopped (``nats info ... | head``): not an error
        # Python would complain again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split())
        print(f"nats: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"nats: error: out of memory ({reason}); use a smaller batch, sequence or model",
              file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("nats: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed (on the CPU or a GPU), which the
    sizes a user gave cause, rather than a defect."""
    text = str(error)
    return isinstance(error, MemoryError) or "out of memory" in text \
        or "can't allocate memory" in text


if __name__ == "__main__":
    sys.exit(main())
