"""What a training run is: the typed, validated :class:`TrainConfig` and its named presets.

Everything a run needs to be reproduced lives here (the model's :class:`NatsConfig`
included), so a config saved beside the checkpoints is enough to resume or repeat it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from nats.config import (
    ConfigError,
    NatsConfig,
    fail,
    nonnegative_finite,
    positive_finite,
    reject_unknown_fields,
    whole_at_least,
)
from nats.model import read_json_object

from .checkpoint import newest_readable
from .synthetic import CopyTask, MQARTask, NeedleTask, SyntheticTask, TaskMixture

TRAIN_CONFIG_FILE = "train_config.json"
"""A run folder's config (it marks the folder as a run)."""
TUPLE_FIELDS = ("data_paths", "mqar_pairs_mix")
"""``TrainConfig`` fields that are tuples, which JSON and argparse hand over as lists."""

TASKS = ("copy", "mqar", "needle", "text")
"""``copy``, ``mqar`` and ``needle`` are generated; ``text`` is a local corpus (default: the
Python standard library's sources), byte-level unless ``tokenizer`` names one."""
DATA_FORMATS = ("auto", "text", "json", "parquet", "saved")
"""How ``data_paths`` are read; ``auto`` goes by extension (see ``trainers.text_data``)."""

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DEVICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
PRECISIONS = ("auto", "fp32", "bf16")
"""``auto``: bf16 autocast on a GPU that supports it, fp32 otherwise."""


def _fail(name: str, value: Any, allowed: str) -> NoReturn:
    fail("TrainConfig", name, value, allowed)


@dataclass(frozen=True)
class TrainConfig:
    """One training run; a bad value raises ``ConfigError`` (a ``ValueError``) naming it."""

    model: NatsConfig
    task: str = "copy"
    """What to learn: a synthetic task or ``text`` (``TASKS``)."""
    steps: int = 1000
    """Optimizer steps of the whole run (a resumed run counts from its start)."""
    batch_size: int = 16
    """Sequences per optimizer step: the global batch, over processes and accumulation steps."""
    seq_len: int = 128
    """Training sequence length in tokens."""
    lr: float = 3e-3
    """Peak learning rate (AdamW), after a linear warm-up, then cosine decay."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at this fraction of ``lr``."""
    warmup_steps: int = 50
    """Steps of the linear learning-rate warm-up."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (norm gains, biases and the scorers take none)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""
    reg_start: float = 0.0
    """Fraction of the steps trained before the routing cost term (``reg_lambda``) applies:
    until then the scorers learn from the task alone, so the cost cannot push every chunk
    to linear attention before the task shows which chunks need softmax."""
    route_explore: float = 0.0
    """Fraction of the steps over which routes explore: Gumbel noise on the routing logits,
    annealed from 1 to 0 (see :func:`trainers.route_control.exploration_noise`)."""
    budget_anneal: float = 0.0
    """Fraction of the steps over which the budget's target falls linearly from 1 (every
    chunk on softmax) to ``model.softmax_target``: the softmax branch first learns on every
    chunk, as a transformer's would, before the router must choose which chunks keep it."""
    budget_rate: float = 0.05
    """Step size of the controller that holds ``model.softmax_target`` (logit units per unit
    of fraction error per step)."""
    router_lr_scale: float = 1.0
    """The scorers' learning rate as a multiple of ``lr`` (they never take weight decay)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (they split ``batch_size``)."""
    precision: str = "auto"
    """``auto`` (bf16 autocast on GPUs that have it, else fp32), ``bf16`` or ``fp32``."""
    compile: bool = False
    """``torch.compile`` the model."""
    cuda_graph: bool | None = None
    """Replay each step's GPU work from a CUDA graph; by default (``None``) wherever it can
    record (one process on a CUDA GPU, no ``compile``, no route exploration), else eager.
    A NAtS-L step is bound by Python and kernel launches, not by the GPU
    (``src/trainers/step.py``). Recording needs batches of one shape and no route exploration
    (its noise scale is read on the host); ``True`` refuses a run where it cannot record."""
    init_from: str | None = None
    """A saved model folder (``save_pretrained``/``nats export``) whose weights start the run."""
    eval_interval: int = 100
    """Steps between evaluations."""
    eval_batches: int = 2
    """Batches of each evaluation."""
    log_interval: int = 10
    """Steps between TensorBoard scalars and console lines."""
    checkpoint_interval: int = 500
    """Steps between checkpoints."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in the run folder."""
    seed: int = 0
    """Seed of the weights and the training stream."""
    device: str = "auto"
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    out_dir: str = "runs/default"
    """The run folder: config, logs, checkpoints and ``model/``."""
    copy_symbols: int = 16
    """Symbols to copy in task ``copy``."""
    mqar_pairs: int = 8
    """Key-value pairs of task ``mqar`` (and of its evaluation)."""
    mqar_placement: str = "start"
    """Where MQAR's pairs sit (:class:`MQARTask`)."""
    mqar_filler: str = "random"
    """What fills MQAR's sequences between pairs and queries (:class:`MQARTask`)."""
    mqar_queries: str = "power-law"
    """MQAR layout knobs (see :class:`MQARTask`); the defaults are Zoology's layout."""
    mqar_pairs_mix: tuple[int, ...] = ()
    """Pair counts that training batches draw from, one count per batch, uniformly (Zoology's
    mixture of difficulties, e.g. ``(4, 8, 16, 32, 64)``); the layout knobs and ``seq_len``
    stay. Empty: every batch has ``mqar_pairs``. Evaluation always uses ``mqar_pairs``."""
    needle_key_len: int = 3
    """Tokens of a needle's key."""
    needle_distractors: int = 0
    """Distractor needles of task ``needle`` (:class:`NeedleTask`)."""
    needle_haystack: str = "random"
    """Needle knobs (see :class:`NeedleTask`): distractor needles and the haystack."""
    eval_seed: int = 1
    """Seed of the evaluation stream (training uses ``seed``)."""
    data_paths: tuple[str, ...] = field(default_factory=tuple)
    """Files, folders or a ``save_to_disk`` folder for task ``text`` (empty: the Python stdlib)."""
    data_glob: str = "**/*"
    """Which files of a ``data_paths`` folder are read."""
    val_fraction: float = 0.05
    """Share of the text held out for evaluation."""
    data_format: str = "auto"
    """How ``data_paths`` are read (``DATA_FORMATS``; ``auto``: by extension)."""
    text_field: str = "text"
    """The text column of JSON / Parquet / saved-dataset records."""
    tokenizer: str | None = None
    """A folder holding ``tokenizer.json`` (``None``: UTF-8 bytes, vocabulary 256)."""
    streaming: bool = False
    """Read text in order and pack it on the fly instead of loading it into memory."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, NatsConfig):
            _fail("model", type(self.model).__name__, "a NatsConfig")
        if self.task not in TASKS:
            _fail("task", self.task, f"one of {TASKS}")
        for name in ("steps", "batch_size", "seq_len", "eval_interval", "eval_batches",
                     "log_interval", "checkpoint_interval", "keep_checkpoints", "copy_symbols",
                     "mqar_pairs", "grad_accum_steps", "needle_key_len"):
            value = getattr(self, name)
            if not whole_at_least(value):
                _fail(name, value, "an integer >= 1")
        for name in ("warmup_steps", "seed", "eval_seed", "needle_distractors"):
            value = getattr(self, name)
            if not whole_at_least(value, 0):
                _fail(name, value, "an integer >= 0")
        for name in ("lr", "grad_clip", "budget_rate", "router_lr_scale"):
            value = getattr(self, name)
            if not positive_finite(value):
                _fail(name, value, "a finite number > 0")
        if not nonnegative_finite(self.weight_decay):
            _fail("weight_decay", self.weight_decay, "a finite number >= 0")
        for name in ("min_lr_ratio", "val_fraction", "reg_start", "route_explore",
                     "budget_anneal"):
            value = getattr(self, name)
            if not nonnegative_finite(value) or value > 1:
                _fail(name, value, "a number in [0, 1]")
        if not isinstance(self.device, str) or not DEVICE_PATTERN.match(self.device):
            _fail("device", self.device, DEVICES)
        if self.batch_size % self.grad_accum_steps:
            _fail("grad_accum_steps", self.grad_accum_steps,
                  f"a divisor of batch_size={self.batch_size} (the batch is split into them)")
        if self.precision not in PRECISIONS:
            _fail("precision", self.precision, f"one of {PRECISIONS}")
        for name in ("compile", "streaming"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            _fail("cuda_graph", self.cuda_graph, "true, false or null (wherever it can record)")
        if self.cuda_graph and self.compile:
            _fail("cuda_graph", self.cuda_graph, "false with compile = true (give one: the "
                  "compiled model is not recorded)")
        if self.cuda_graph and self.route_explore > 0:
            _fail("cuda_graph", self.cuda_graph, f"false with route_explore = "
                  f"{self.route_explore} (a recorded step cannot change its noise scale)")
        if self.cuda_graph and self.device == "cpu":
            _fail("cuda_graph", self.cuda_graph, "false on device cpu (CUDA graphs need a GPU)")
        for name, allowed in (("init_from", "null or a saved model folder"),
                              ("tokenizer", "null (bytes) or a folder with tokenizer.json")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(name, value, allowed)
        if not isinstance(self.out_dir, str) or not self.out_dir:
            _fail("out_dir", self.out_dir, "a non-empty path")
        if not isinstance(self.data_paths, tuple) or not all(
                isinstance(p, str) and p for p in self.data_paths):
            _fail("data_paths", self.data_paths, "a tuple of file or directory paths")
        self._check_text_fields()
        for name, allowed in (("mqar_placement", MQARTask.PLACEMENTS),
                              ("mqar_filler", MQARTask.FILLERS),
                              ("mqar_queries", MQARTask.QUERIES),
                              ("needle_haystack", NeedleTask.HAYSTACKS)):
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), f"one of {allowed}")
        self._check_task_fits_model()

    def _check_text_fields(self) -> None:
        for name in ("data_glob", "text_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                _fail(name, getattr(self, name), "a non-empty string")
        if self.data_format not in DATA_FORMATS:
            _fail("data_format", self.data_format, f"one of {DATA_FORMATS}")

    def _check_task_fits_model(self) -> None:
        vocab = self.model.vocab_size
        if self.task == "text" and self.tokenizer is None and vocab < 256:
            _fail("model.vocab_size", vocab, "at least 256 for byte-level task 'text'")
        if self.task == "needle":
            if vocab < NeedleTask.MIN_VOCAB:
                _fail("model.vocab_size", vocab, f"at least {NeedleTask.MIN_VOCAB} for task "
                      "'needle' (10 digits, then key and filler tokens)")
            least = NeedleTask.min_seq_len(self.needle_key_len)
            if self.seq_len < least:
                _fail("seq_len", self.seq_len, f"at least 2 * (needle_key_len + "
                      f"{NeedleTask.VALUE_DIGITS}) + 1 = {least} for task 'needle'")
        if self.task == "copy":
            if self.seq_len < 3:
                _fail("seq_len", self.seq_len, "at least 3 for task 'copy'")
            if self.copy_symbols > vocab - 1:
                _fail("copy_symbols", self.copy_symbols,
                      f"1 .. model.vocab_size - 1 = {vocab - 1} (token 0 is the separator)")
        if self.task == "mqar":
            if self.mqar_pairs > vocab // 2 - 1:
                _fail("mqar_pairs", self.mqar_pairs,
                      f"1 .. model.vocab_size // 2 - 1 = {vocab // 2 - 1} (distinct keys)")
            if 4 * self.mqar_pairs > self.seq_len:
                _fail("seq_len", self.seq_len,
                      f"at least 4 * mqar_pairs = {4 * self.mqar_pairs} for task 'mqar'")
        try:
            task = self.synthetic_task()
        except ConfigError as e:
            raise ConfigError(f"TrainConfig task {self.task!r}: {e}") from None
        self._check_mqar_pairs_mix(task)

    def _check_mqar_pairs_mix(self, task: SyntheticTask | None) -> None:
        mix = self.mqar_pairs_mix
        if not isinstance(mix, tuple) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mix):
            _fail("mqar_pairs_mix", mix, "a tuple of pair counts, integers >= 1")
        if not mix:
            return
        if not isinstance(task, MQARTask):
            _fail("mqar_pairs_mix", mix, f"() unless task is 'mqar' (task is {self.task!r})")
        if max(mix) > task.half - 1:
            _fail("mqar_pairs_mix", mix, f"pair counts in 1 .. {task.half - 1} (distinct "
                  f"keys 1 .. h - 1, h = {task.half} for model.vocab_size={task.vocab_size})")
        if 4 * max(mix) > self.seq_len:
            _fail("mqar_pairs_mix", mix, f"pair counts in 1 .. seq_len // 4 = "
                  f"{self.seq_len // 4} (seq_len >= 4 * pairs)")

    def synthetic_task(self) -> CopyTask | MQARTask | NeedleTask | None:
        """The generated task this run evaluates on, and trains on unless ``mqar_pairs_mix``
        is set (``None`` for text)."""
        vocab = self.model.vocab_size
        if self.task == "copy":
            return CopyTask(self.seq_len, self.copy_symbols)
        if self.task == "mqar":
            return MQARTask(vocab, self.seq_len, self.mqar_pairs, placement=self.mqar_placement,
                            filler=self.mqar_filler, queries=self.mqar_queries)
        if self.task == "needle":
            return NeedleTask(vocab, self.seq_len, self.needle_key_len,
                              distractors=self.needle_distractors, haystack=self.needle_haystack)
        return None

    def training_task(self) -> SyntheticTask | TaskMixture | None:
        """The generated task training batches come from: :meth:`synthetic_task`, or with
        ``mqar_pairs_mix`` one MQAR task per pair count, drawn per batch."""
        task = self.synthetic_task()
        if not self.mqar_pairs_mix or not isinstance(task, MQARTask):
            return task
        return TaskMixture(tuple(dataclasses.replace(task, pairs=n) for n in self.mqar_pairs_mix))

    def reads_stdlib(self) -> bool:
        """Whether this task's data is this interpreter's standard library (the default
        text corpus, the needle's text haystacks)."""
        return (self.task == "text" and not self.data_paths) or \
            (self.task == "needle" and self.needle_haystack == "text")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, the inverse of :meth:`from_dict`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = self.model.to_dict()
        out.update({name: list(getattr(self, name)) for name in TUPLE_FIELDS})
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from :meth:`to_dict` output; unknown keys are an error, not ignored."""
        reject_unknown_fields(cls, data)
        if not isinstance(data.get("model"), dict):
            _fail("model", data.get("model"), "a NatsConfig dict")
        values = dict(data)
        values["model"] = NatsConfig.from_dict(values["model"])
        for name in TUPLE_FIELDS:
            if isinstance(values.get(name), list):  # JSON has no tuples
                values[name] = tuple(values[name])
        return cls(**values)


def _tiny_model() -> NatsConfig:
    # Rotary positions let the tiny model find the copy's offset within ~100 steps.
    return NatsConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=2,
                      softmax_heads_per_head=2, head_dim_k=32, head_dim_v=32, chunk_size=16,
                      layer_types=("nats", "nats"), sampler="argmax", reg_lambda=0.0,
                      rope=True)


def _mqar_tiny_model() -> NatsConfig:
    # Plain softmax attention: the model every recall task is measured against.
    return NatsConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=2,
                      softmax_heads_per_head=2, head_dim_k=32, head_dim_v=32, chunk_size=16,
                      layer_types=("softmax", "softmax"), rope=True)


def _small_model() -> NatsConfig:
    return NatsConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4,
                      softmax_heads_per_head=2, head_dim_k=64, head_dim_v=64, chunk_size=32,
                      layer_types=("nats",) * 4, sampler="argmax", reg_lambda=0.0)


def _presets() -> dict[str, TrainConfig]:
    return {
        # Trains on a laptop CPU in well under a minute and learns to copy 8 symbols.
        "tiny": TrainConfig(model=_tiny_model(), task="copy", steps=300, batch_size=32,
                            seq_len=17, lr=1e-2, warmup_steps=10, eval_interval=100,
                            log_interval=5, checkpoint_interval=60, out_dir="runs/tiny"),
        # Recall on a CPU: small enough that a 2-layer softmax model learns the 4 key-value
        # queries well within its steps.
        "mqar-tiny": TrainConfig(model=_mqar_tiny_model(), task="mqar", steps=600,
                                 batch_size=64, seq_len=32, mqar_pairs=4, lr=3e-3,
                                 warmup_steps=50, eval_interval=100, eval_batches=4,
                                 checkpoint_interval=200, out_dir="runs/mqar-tiny"),
        # Multi-query associative recall, the classic test of what a fixed state can hold.
        "mqar-small": TrainConfig(model=_small_model(), task="mqar", steps=2000,
                                  batch_size=32, seq_len=256, lr=1e-3, warmup_steps=100,
                                  mqar_pairs=16, out_dir="runs/mqar-small"),
        # Byte-level language model on the Python standard library's sources. The softmax
        # output merged at its running RMS times a learned gain started small: on byte-level
        # LM that beat the other norms, Gated DeltaNet and the layer hybrid at the same share
        # (docs/RESULTS.md, "A learned gain on the softmax output"). Another norm on the
        # command line keeps the gain: add --softmax-gain-init none to drop it.
        "bytes-small": TrainConfig(model=_small_model().replace(branch_norm="scaled",
                                                                softmax_gain_init=0.05),
                                   task="text", steps=5000,
                                   batch_size=16, seq_len=512, lr=1e-3, warmup_steps=200,
                                   eval_interval=250, checkpoint_interval=1000,
                                   out_dir="runs/bytes-small"),
    }


PRESETS: tuple[str, ...] = tuple(_presets())

ARCHITECTURES = ("transformer", "gdn", "layer-hybrid", "natsl", "natsl-all")
"""The baselines a preset's model can be swapped for (``nats train --arch``): the same
width, depth, heads and trainer, only the mixers differ (see :func:`architecture_layers`)."""


def architecture_layers(arch: str, n_layers: int, softmax_every: int = 2) -> tuple[str, ...]:
    """Layer types of baseline ``arch`` with ``n_layers`` layers.

    ``transformer``: all softmax; ``gdn``: all linear (Gated DeltaNet unless the model's
    ``linear_op`` says otherwise); ``layer-hybrid``: softmax in
    every ``softmax_every``-th layer (layers ``k-1, 2k-1, ..``), Gated DeltaNet elsewhere;
    ``natsl``: NAtS-L where the layer hybrid puts softmax, Gated DeltaNet elsewhere, so the
    searched layers can only save cost against it; ``natsl-all``: NAtS-L everywhere.
    """
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {arch!r}: must be one of "
                          f"{', '.join(ARCHITECTURES)}")
    if not whole_at_least(n_layers):
        raise ConfigError(f"NatsConfig.n_layers = {n_layers!r} is invalid: must be an integer "
                          ">= 1")
    uniform = {"transformer": "softmax", "gdn": "linear", "natsl-all": "nats"}
    if arch in uniform:  # softmax_every does not apply
        return (uniform[arch],) * n_layers
    if not (whole_at_least(softmax_every) and softmax_every <= n_layers):
        raise ConfigError(f"softmax_every = {softmax_every!r} is invalid: must be an integer "
                          f"in 1 .. n_layers = {n_layers}")
    hybrid = "softmax" if arch == "layer-hybrid" else "nats"
    return tuple(hybrid if (i + 1) % softmax_every == 0 else "linear"
                 for i in range(n_layers))


def with_architecture(config: TrainConfig, arch: str, softmax_every: int = 2) -> TrainConfig:
    """``config`` with its model's mixers replaced by baseline ``arch``'s."""
    layers = architecture_layers(arch, config.model.n_layers, softmax_every)
    return config.replace(model=config.model.replace(layer_types=layers))


def preset(name: str) -> TrainConfig:
    """The named preset; an unknown name raises ``ValueError`` listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: must be one of {', '.join(PRESETS)}")
    return _presets()[name]


def config_from_file(path: str | Path, base: TrainConfig) -> TrainConfig:
    """A run config from a JSON file: a whole run (``train_config.json``, with a ``model``
    key) or a model alone (``config.json`` of a saved or exported model), which replaces
    ``base``'s model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: {str(path)!r} is not a file")
    try:
        data = read_json_object(path)
    except ValueError as e:
        raise ConfigError(f"--config: {e}") from None
    if "model" in data:
        return TrainConfig.from_dict(data)
    return base.replace(model=NatsConfig.from_dict(data))


DEFAULT_PRESET = "tiny"
"""The preset of ``nats train`` without ``--preset``."""


def run_config(preset_name: str | None, overrides: dict[str, Any], resume: bool,
               config_path: str | None = None, model_overrides: dict[str, Any] | None = None,
               arch: tuple[str, int] | None = None) -> TrainConfig:
    """The config of a run started or resumed from the command line.

    A new run is the preset (its model replaced or its whole config replaced by
    ``config_path``, see :func:`config_from_file`) with ``overrides``. Resuming takes the
    config saved in the newest checkpoint of the output folder (``overrides["out_dir"]``
    or the preset's), or its ``train_config.json`` if it stopped before its first
    checkpoint, so the preset need not be repeated, then applies ``overrides`` (e.g. more
    ``steps``). ``arch`` (a baseline architecture and its ``softmax_every``) gives the
    model's mixers for its depth after ``model_overrides``, whose ``layer_types`` win.
    ``preset_name`` ``None`` is the default preset, not named by the user: a resumed run
    ignores that without a word, and a named preset or ``config_path`` with a warning.
    """
    base = preset(preset_name or DEFAULT_PRESET)
    if config_path is not None:
        base = config_from_file(config_path, base)
    out_dir = Path(overrides.get("out_dir", base.out_dir))
    found = newest_readable(out_dir) if resume else None
    if found is not None:
        base = TrainConfig.from_dict(found[1]["config"])
        named = [f"--{o} {v}" for o, v in (("preset", preset_name), ("config", config_path))
                 if v is not None]
        if named:
            print(f"nats: warning: {' and '.join(named)} ignored: a resumed run keeps the "
                  "settings of its checkpoint (change one with its own option, e.g. --lr)",
                  file=sys.stderr)
    elif resume and (out_dir / TRAIN_CONFIG_FILE).is_file():
        # Stopped before its first checkpoint: start over with the run's own config.
        base = config_from_file(out_dir / TRAIN_CONFIG_FILE, base)
    model_overrides = dict(model_overrides or {})
    if arch is not None and "layer_types" not in model_overrides:
        # As deep as the run will be: ``--n-layers`` given beside ``--arch`` counts.
        model_overrides["layer_types"] = architecture_layers(
            arch[0], model_overrides.get("n_layers", base.model.n_layers), arch[1])
    # Model and run overrides at once: a run field may only be valid with the new model
    # (a text task with a larger vocabulary).
    config = base.replace(model=base.model.replace(**model_overrides), **overrides)
    if found is not None:
        _say_changes(base, config)
    return config


def _say_changes(saved: TrainConfig, now: TrainConfig) -> None:
    """A resumed run whose settings differ from its checkpoint's goes on with the new ones
    (more steps, another learning rate): said once, so that a mix is never silent."""
    before, after = saved.to_dict(), now.to_dict()
    changed = [f"{key} {before[key]!r} -> {after[key]!r}" for key in after
               if key != "model" and before.get(key) != after[key]]
    if not changed:
        return
    note = ("; the learning-rate schedule and the routing cost's start follow the new "
            "steps" if before.get("steps") != after["steps"] else "")
    print(f"nats: warning: resuming with changed settings: {', '.join(changed)}{note}",
          file=sys.stderr)
