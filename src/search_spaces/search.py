"""The search engine: Ray Tune runs the trials, Optuna (through ``OptunaSearch``) picks them.

A search folder ``DIR`` holds ``search.json`` (the settings, space and base config: all a
resume needs), ``trials/<trial_id>/`` (each trial's run folder: TensorBoard events,
checkpoints, the model, and ``search_trial.json``, its parameters and latest metrics),
``tune/`` (Ray Tune's experiment state, for ``Tuner.restore``), the Optuna study
(``optuna_study.journal`` unless ``--optuna-storage`` names another place), and at the end
``results.csv``, ``pareto.json``, ``pareto.png`` and ``export/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.atomic_write import atomic_write_bytes
from nats.config import nonnegative_finite, positive_finite, whole_at_least
from nats.folder_lock import exclusive
from nats.model import read_json_object
from nats.trainers import TrainConfig

from . import tune_state
from .objectives import COSTS, MEASURED_COSTS, QUALITY, cost_metrics, objective_keys
from .spaces import DefineByRun, SearchSpace, check_space_fits, space_from_dict

SETTINGS_FILE = "search.json"
TRIAL_FILE = "search_trial.json"
TUNE_NAME = "tune"
STUDY_FILE = "optuna_study.journal"
"""The Optuna study's journal file in the search folder when ``--optuna-storage`` is not
given: kept so that ``nats analyze`` can read parameter importances afterwards."""
SAMPLERS = ("tpe", "nsga2")


@dataclass(frozen=True)
class SearchSettings:
    """Everything a search is, saved as ``DIR/search.json``."""

    space: dict[str, Any]
    """The space mapping (``SearchSpace.source``) with its ``name``."""
    base: dict[str, Any]
    """The base ``TrainConfig.to_dict()``."""
    quality: str = "loss"
    cost: str = "flops"
    objective: str = "pareto"
    context: int = 8192
    latency_len: int = 2048
    """Tokens of the forward pass that ``--cost latency`` times (evaluation data, batch 1)."""
    num_trials: int = 8
    max_concurrent: int = 2
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    time_budget_s: float | None = None
    seed: int = 0
    sampler: str = "tpe"
    asha: bool = False
    max_failures: int = 2
    optuna_storage: str | None = None
    """A database URL or an Optuna journal file; a relative file path is relative to the
    search folder (``run_search`` stores a file inside the folder that way, so that a copy
    of the folder keeps its own study)."""
    study_name: str = "nats-search"
    baselines: bool = True
    """Train the space's pure forms first (``SearchSpace.baseline_points``)."""

    def __post_init__(self) -> None:
        objective_keys(self.objective, self.quality, self.cost)
        for name in ("asha", "baselines"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} {getattr(self, name)!r}: must be true or false")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler {self.sampler!r}: must be one of {SAMPLERS}")
        for name in ("context", "latency_len", "num_trials", "max_concurrent"):
            value = getattr(self, name)
            if not whole_at_least(value):
                raise ValueError(f"--{name.replace('_', '-')} {value!r}: must be an "
                                 "integer >= 1")
        if not whole_at_least(self.max_failures, 0):
            raise ValueError(f"--max-failures {self.max_failures!r}: must be an integer >= 0")
        if not positive_finite(self.cpus_per_trial):
            raise ValueError(f"--cpus-per-trial {self.cpus_per_trial!r}: must be > 0")
        if not nonnegative_finite(self.gpus_per_trial):
            raise ValueError(f"--gpus-per-trial {self.gpus_per_trial!r}: must be >= 0")
        if self.time_budget_s is not None and not positive_finite(self.time_budget_s):
            raise ValueError(f"--time-budget {self.time_budget_s!r}: must be > 0 seconds")
        if self.quality == "bpb" and self.base.get("task") != "text":
            raise ValueError("--metric bpb needs task 'text' (bits per byte of a corpus)")
        if self.asha and self.search_space().dim("steps") is not None:
            # ASHA stops every trial at the base's steps (its max_t): a longer trial
            # would never finish, and never reach the front.
            raise ValueError(f"--asha cannot search 'steps' (space {self.space.get('name')!r}): "
                             "ASHA stops every trial at the base's steps; fix the steps in "
                             "the base or search without --asha")

    def search_space(self) -> SearchSpace:
        return space_from_dict(self.space, where=f"space {self.space.get('name')!r}")

    def base_config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.base)

    @property
    def keys_and_modes(self) -> tuple[list[str], list[str]]:
        return objective_keys(self.objective, self.quality, self.cost)

    @property
    def quality_key(self) -> tuple[str, str]:
        return QUALITY[self.quality]

    @property
    def cost_key(self) -> tuple[str, str]:
        return COSTS[self.cost]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        if data.get("extra") == {}:  # an unused field that earlier versions wrote empty
            data = {k: v for k, v in data.items() if k != "extra"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"search settings: unknown key(s) {unknown}")
        for name in ("space", "base"):
            if not isinstance(data.get(name), dict):
                raise ValueError(f"search settings: {name!r} must be a JSON object, got "
                                 f"{type(data.get(name)).__name__}")
        return cls(**data)

    def save(self, out: Path) -> None:
        atomic_write_bytes(out / SETTINGS_FILE, json.dumps(self.to_dict(), indent=2).encode())

    @classmethod
    def load(cls, out: Path) -> SearchSettings:
        path = out / SETTINGS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{out} holds no search ({SETTINGS_FILE} is missing)")
        return cls.from_dict(read_json_object(path))


def make_settings(space: SearchSpace, base: TrainConfig, **options: Any) -> SearchSettings:
    """Settings for a new search of ``space`` around ``base``; the space is sampled against
    the base first, so a space that cannot fit fails now and not in a trial."""
    check_space_fits(space, base)
    return SearchSettings(space={**space.source, "name": space.name}, base=base.to_dict(),
                          **options)


# --- one trial (runs inside a Ray worker) ------------------------------------------------


def trial_config(settings: SearchSettings, params: dict[str, Any], out_dir: Path) -> TrainConfig:
    """The trial's run config: the base with the suggested ``params``, writing to
    ``out_dir``, on a GPU when the trial has one, checkpointed at every evaluation."""
    import optuna

    base = settings.base_config()
    config = settings.search_space().sample(optuna.trial.FixedTrial(params), base)
    device = "cuda" if settings.gpus_per_trial > 0 else "cpu"
    return config.replace(out_dir=str(out_dir), device=device,
                          checkpoint_interval=min(config.eval_interval,
                                                  config.checkpoint_interval))


def _latency_timer(settings: SearchSettings, config: TrainConfig) -> Any:
    """For ``--cost latency``: a function timing a model's forward pass over
    ``latency_len`` tokens of the trial's evaluation data (as it is routed at that step);
    ``None`` when the cost is computed, not measured."""
    if settings.cost not in MEASURED_COSTS:
        return None
    from nats.latency import prefill_latency_ms
    from nats.trainers.data import build_batches
    from nats.trainers.distributed import resolve_device
    from nats.trainers.loop import autocast_for

    input_ids = build_batches(config).eval(1)[0][0]
    autocast = autocast_for(config.precision, resolve_device(config.device))
    return lambda model: prefill_latency_ms(model, input_ids, settings.latency_len, autocast)


def _write_trial(out_dir: Path, record: dict[str, Any]) -> None:
    atomic_write_bytes(out_dir / TRIAL_FILE, json.dumps(record, indent=2).encode())


def _read_trial(out_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((out_dir / TRIAL_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _checkpoint_step(path: Path | None) -> int:
    """The step a trial (re)starts from: its newest checkpoint's, 0 for a fresh start."""
    from nats.trainers.checkpoint import read_checkpoint_meta

    return 0 if path is None else int(read_checkpoint_meta(path)["step"])


def _restore_tune_checkpoint(out_dir: Path) -> None:
    """A retried trial: if Tune holds a newer trainer checkpoint than the run folder (say the
    folder was on a node that died), put it back so that the trainer resumes from it."""
    from ray import tune

    from nats.trainers import latest_checkpoint
    from nats.trainers.checkpoint import checkpoint_dir, list_checkpoints

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return
    have = list_checkpoints(out_dir)
    with checkpoint.as_directory() as d:
        files = sorted(Path(d).glob("step_*.safetensors"))
        if not files:
            return
        newest = files[-1]
        if latest_checkpoint(out_dir) is None or newest.name > have[-1][1].name:
            checkpoint_dir(out_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy2(newest, checkpoint_dir(out_dir) / newest.name)


def _twin(trials_dir: Path, trial_id: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The record of an earlier trial with the same parameters, once it is done (waiting
    while it trains in a live process of this machine); ``None`` if there is none to reuse.
    The sampler proposes a small categorical space's configurations again, and a trial is
    deterministic given them."""
    while True:
        twins = [r for path in sorted(trials_dir.glob(f"*/{TRIAL_FILE}"))
                 if (r := _read_trial(path.parent)).get("params") == params
                 and r.get("trial_id") != trial_id and r.get("status") != "duplicate"]
        if any(r["status"] == "done" for r in twins):
            return next(r for r in twins if r["status"] == "done")
        if not any(r["status"] == "running" and r.get("node") == platform.node()
                   and _alive(int(r.get("pid", 0))) for r in twins):
            return None
        time.sleep(2.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return pid > 0


def run_trial(params: dict[str, Any], *, settings: SearchSettings, trials_dir: str) -> None:
    """Ray Tune function trainable: train the trial's config, report after every
    evaluation (quality, cost, softmax fractions, and the newest trainer checkpoint).

    The last evaluation is reported after the trainer returns, with the model saved: a
    scheduler that stops the trial at that report (ASHA at ``max_t``, or a rung at the
    last step) then stops a finished trial. A trial whose parameters an earlier trial
    had reports that trial's result instead of training again (status ``duplicate``)."""
    import torch
    from ray import tune

    from nats.trainers import latest_checkpoint, train
    from nats.trainers.config import TRAIN_CONFIG_FILE

    # Tune logs every report's checkpoint at INFO: a line per report and trial.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    trial_id = tune.get_context().get_trial_id()
    out_dir = Path(trials_dir) / trial_id
    config = trial_config(settings, params, out_dir)
    timer = _latency_timer(settings, config)
    torch.set_num_threads(max(1, int(settings.cpus_per_trial)))
    out_dir.mkdir(parents=True, exist_ok=True)
    _restore_tune_checkpoint(out_dir)
    start = latest_checkpoint(out_dir)
    previous = _read_trial(out_dir)  # a retried trial: its last evaluation so far
    record: dict[str, Any] = {"trial_id": trial_id, "params": params, "status": "running",
                              "step": previous.get("step", 0), "steps": config.steps,
                              "metrics": previous.get("metrics", {}),
                              "model": config.model.to_dict(), "pid": os.getpid(),
                              "node": platform.node(),
                              "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                              "started_at": time.time(),
                              "resumed_from": _checkpoint_step(start)}
    twin = _twin(Path(trials_dir), trial_id, params)
    if twin is not None:
        record.update(status="duplicate", duplicate_of=twin["trial_id"], step=twin["step"],
                      metrics=twin["metrics"], ended_at=time.time())
        _write_trial(out_dir, record)
        tune.report({**twin["metrics"], "step": twin["step"]})
        return
    _write_trial(out_dir, record)
    reported = [latest_checkpoint(out_dir)]

    # Tune's live table shows the first four metrics of a report: the objectives first.
    first = [settings.quality_key[0], settings.cost_key[0], "eval/acc", "eval/attn_frac"]

    def report(values: dict[str, float]) -> None:
        values = {**{k: values[k] for k in first if k in values}, **values}
        newest = latest_checkpoint(out_dir)
        if newest is None or newest == reported[0]:
            tune.report(values)
            return
        reported[0] = newest
        with tempfile.TemporaryDirectory() as d:
            shutil.copy2(newest, Path(d) / newest.name)
            tune.report(values, checkpoint=tune.Checkpoint.from_directory(d))

    def on_eval(step: int, metrics: dict[str, float], model: Any) -> None:
        values = {k: v for k, v in metrics.items() if "/head" not in k}
        values.update(cost_metrics(config.model, metrics, settings.context))
        if timer is not None:
            values["cost/latency_ms"] = timer(model)
        values["step"] = step
        record.update(step=step, metrics=values)
        _write_trial(out_dir, record)
        if step < config.steps:
            report(values)

    # A retried trial that died before its first checkpoint starts over in its folder.
    retried = start is not None or (out_dir / TRAIN_CONFIG_FILE).is_file()
    result = train(config, resume=retried, on_eval=on_eval)
    record.update(status="interrupted" if result.interrupted else "done", step=result.step,
                  ended_at=time.time())
    _write_trial(out_dir, record)
    if not result.interrupted:
        report({**record["metrics"], "step": result.step})


# --- the driver --------------------------------------------------------------------------


def _optuna_storage(url: str, folder: Path | None = None) -> Any:
    """An Optuna storage from a database URL (``sqlite:///f.db``, ``postgresql://...``) or a
    file path, used as a journal file (safe for parallel use). A journal file inside
    ``folder`` is kept by its path in the folder, so that the searcher Tune pickles follows
    a copied or moved folder (:class:`.folder_state.FolderJournal`)."""
    import optuna

    if "://" in url:
        return optuna.storages.RDBStorage(url)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = Path(url).resolve()
    if folder is not None and path.is_relative_to(folder):
        from .folder_state import FolderJournal

        return JournalStorage(FolderJournal(folder, path.relative_to(folder).as_posix()))
    return JournalStorage(JournalFileBackend(str(path)))


def _check_storage(settings: SearchSettings, out: Path) -> None:
    """Open the Optuna storage before Ray starts, so that a bad ``--optuna-storage`` is one
    line and leaves no half-made search behind."""
    if settings.optuna_storage is None:
        return
    where = study_storage(settings, out)
    if "://" not in where and Path(where).is_relative_to(out):
        Path(where).parent.mkdir(parents=True, exist_ok=True)  # a part of the search folder
    if "://" not in where and not _journal_or_new(Path(where)):
        # Optuna's reader skips a bad last line: a one-line file of anything else opened
        # fine, then had the study appended to it and failed the search after Ray started.
        raise ValueError(f"--optuna-storage {where!r} is not an Optuna journal file; give a "
                         "new file, a journal, or a database URL")
    try:
        _optuna_storage(where)
    except Exception as e:  # SQLAlchemy, drivers and Optuna each have their own errors
        reason = " ".join(str(e).split())[:200]
        raise ValueError(f"--optuna-storage {where!r} cannot be opened "
                         f"({type(e).__name__}: {reason})") from None


def _journal_or_new(path: Path) -> bool:
    """``path`` is absent, empty, or an Optuna journal: JSON lines of operations."""
    if not path.is_file() or path.stat().st_size == 0:
        return not path.exists() or path.is_file()
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def study_storage(settings: SearchSettings, out: Path) -> str:
    """Where the search in ``out`` keeps its Optuna study: ``--optuna-storage`` (a relative
    file path is relative to ``out``), else the journal file :data:`STUDY_FILE` in ``out``."""
    where = settings.optuna_storage or STUDY_FILE
    return where if "://" in where else str(Path(out).resolve() / where)


def _storage_in_folder(settings: SearchSettings, out: Path) -> SearchSettings:
    """``settings`` with a ``--optuna-storage`` journal file named relative to ``out`` when
    it lies inside, else absolute: a copy of the folder then keeps its own study."""
    where = settings.optuna_storage
    if where is None or "://" in where:
        return settings
    path = (out / where).resolve()
    name = path.relative_to(out).as_posix() if path.is_relative_to(out) else str(path)
    return dataclasses.replace(settings, optuna_storage=name)


def load_study(out: str | Path) -> Any:
    """The Optuna study of the search in ``out``; ``FileNotFoundError`` when it was not kept
    (a search from before studies were kept by default, without ``--optuna-storage``)."""
    import optuna

    out = Path(out)
    settings = SearchSettings.load(out)
    where = study_storage(settings, out)
    if "://" not in where and not Path(where).is_file():
        raise FileNotFoundError(f"{out} kept no Optuna study ({where} is missing)")
    return optuna.load_study(study_name=settings.study_name, storage=_optuna_storage(where))


class _PicklableLock:
    """A thread lock that pickles as a new, free one. Optuna 5.1's genetic samplers keep a
    ``threading.Lock`` (``_thread_lock``), and Ray Tune pickles its search algorithm, the
    sampler in it, when a search starts: a plain lock makes every NSGA-II search fail."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lock = threading.Lock()


def _sampler(settings: SearchSettings) -> Any:
    import optuna

    if settings.sampler == "nsga2":
        population = max(2, min(50, settings.num_trials // 2))
        sampler = optuna.samplers.NSGAIISampler(seed=settings.seed, population_size=population)
        if hasattr(sampler, "_thread_lock"):  # Optuna >= 5.1
            sampler._thread_lock = _PicklableLock()
        return sampler
    # Multivariate TPE over groups of parameters that appear together (conditional spaces);
    # half the trials (at most 10) are random before the model takes over.
    return optuna.samplers.TPESampler(seed=settings.seed, multivariate=True, group=True,
                                      n_startup_trials=max(1, min(10, settings.num_trials // 2)))


def _trainable(settings: SearchSettings, out: Path) -> Any:
    from ray import tune

    fn = tune.with_parameters(run_trial, settings=settings, trials_dir=str(out / "trials"))
    resources = {"cpu": settings.cpus_per_trial, "gpu": settings.gpus_per_trial}
    return tune.with_resources(fn, resources)


def _tuner(settings: SearchSettings, out: Path, first: list[dict[str, Any]] | None = None,
           ) -> Any:
    """The Tune experiment; ``first``: Optuna parameters to try before the sampler's."""
    import warnings

    import optuna
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch

    from .folder_state import FolderSearch

    metrics, modes = settings.keys_and_modes
    base = settings.base_config()
    # Keeping one Tune checkpoint a trial forces a state snapshot per report; at a report
    # every few seconds Tune warns about that on every trial. It is cheap here.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Trials write their own TensorBoard events under DIR/trials; Tune's loggers would add
    # a second copy in its staging folder and point the console there.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # ... so its result grid finds no result files of theirs, and would warn about each trial.
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    searcher = OptunaSearch(DefineByRun(settings.search_space(), base),
                            metric=metrics if len(metrics) > 1 else metrics[0],
                            mode=modes if len(modes) > 1 else modes[0],
                            sampler=_sampler(settings), points_to_evaluate=first or None,
                            storage=_optuna_storage(study_storage(settings, out), out),
                            study_name=settings.study_name)
    # What Tune would wrap the searcher in for `max_concurrent_trials`, made here so that
    # the generator is ours: it follows the folder on a restore.
    search = FolderSearch(ConcurrencyLimiter(searcher, max_concurrent=settings.max_concurrent))
    scheduler = None
    if settings.asha:
        key, mode = settings.quality_key
        scheduler = ASHAScheduler(metric=key, mode=mode, time_attr="step", max_t=base.steps,
                                  grace_period=min(base.eval_interval, base.steps),
                                  reduction_factor=2)
    return tune.Tuner(
        _trainable(settings, out),
        tune_config=tune.TuneConfig(search_alg=search, scheduler=scheduler,
                                    num_samples=settings.num_trials,
                                    time_budget_s=settings.time_budget_s),
        run_config=tune.RunConfig(
            name=TUNE_NAME, storage_path=str(out),
            failure_config=tune.FailureConfig(max_failures=settings.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1), verbose=1))


def plain_ray_console() -> None:
    """Ray's console as a log, not a terminal: no colour codes when the output is not a
    terminal, and no merging of similar lines from different trials (two trials' metric
    lines differ in their numbers, which Ray's de-duplication drops). Call it before Ray is
    imported: Ray reads the de-duplication switch then."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _ray_init(address: str | None) -> bool:
    """Connect to ``address`` (or ``RAY_ADDRESS``), else start a local Ray that listens on
    the loopback interface only; ``True`` when this call started it (and so should shut it
    down, or disconnect)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address)
        except ConnectionError as e:
            hint = ""
            if os.environ.get("RAY_AUTH_MODE") != "token":
                hint = ("; a cluster with token authentication (`ray start` turns it on "
                        "where a token exists) refuses clients without the token: set "
                        "RAY_AUTH_MODE=token here too (the token comes from RAY_AUTH_TOKEN, "
                        "the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token)")
            raise ConnectionError(f"{e}{hint}") from e
    else:
        _start_local_ray()
    return True


def _start_local_ray(**options: Any) -> None:
    """A new Ray of this machine alone (never one that ``ray start`` left running), whose
    processes listen on 127.0.0.1 only; ``options`` go to ``ray.init`` (tests keep their
    Ray small and quiet).

    Ray's servers listen on the node's IP address when it is a loopback address, else on
    every interface (the runtime-env agent on the node's address). On Linux the node's
    address is the machine's routable one unless multi-node clusters are off
    (``ENABLE_RAY_CLUSTER``, read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when Ray is
    imported, so setting the variable here is too late): then it is 127.0.0.1, as on macOS
    and Windows. ``ray.init`` swaps a loopback ``_node_ip_address`` for the routable
    address, so that argument cannot do it either.
    """
    import ray
    from ray._private import ray_constants

    clusters = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", include_dashboard=False, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters


def _with_ray(address: str | None, fit: Any) -> Any:
    """Run ``fit`` on a Ray session (started here unless one is running).

    SIGTERM (``kill``, ``timeout``, a cluster's scheduler) stops the search as Ctrl-C does:
    Tune then saves its state with the running trials in it. Under Ray's own handler (exit
    at once) Tune's last saved state predated the running trial, which ``--resume`` then
    dropped while calling the search complete. Tune installs its own SIGINT handler and
    leaves it behind; the caller's handlers are put back, so Ctrl-C in a later training
    run (same process) reaches the trainer again.
    """
    import ray

    main_thread = threading.current_thread() is threading.main_thread()
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    started = _ray_init(address)
    if main_thread:
        signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)
    try:
        return fit()
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, sigint)
            signal.signal(signal.SIGTERM, sigterm)
        if started:
            ray.shutdown()


def _stop_as_on_ctrl_c(signum: int, frame: Any) -> None:
    signal.raise_signal(signal.SIGINT)  # whatever handles Ctrl-C now: Tune's, or Python's


@dataclass(frozen=True)
class FitOutcome:
    errors: dict[str, str]
    """Trial id -> one-line error of every trial that failed after its retries."""
    complete: bool
    """Every trial ended (or the time budget did); ``False``: the search was interrupted
    (Ctrl-C) and ``nats search --resume`` continues it."""


TIME_FILE = "search_time.json"
"""Seconds the search's Tune runs have taken, summed over ``--resume``: Tune keeps its time
budget across a restore, so this says whether the budget or a Ctrl-C ended a run."""


def _timed_fit(out: Path, settings: SearchSettings, fit: Any, *, fresh: bool) -> FitOutcome:
    """``fit()`` (a Tune run) and its outcome; ``fresh``: a run that starts Tune's budget
    anew (a new search, or one restarted from its settings)."""
    path = out / TIME_FILE
    used = 0.0 if fresh or not path.is_file() else float(json.loads(path.read_text())["seconds"])
    started = time.monotonic()
    grid = fit()
    used += time.monotonic() - started
    atomic_write_bytes(path, json.dumps({"seconds": round(used, 3)}).encode())
    return _outcome(grid, settings, used)


def _outcome(grid: Any, settings: SearchSettings, used_s: float) -> FitOutcome:
    errors = {}
    for result in grid:
        if result.error is not None:
            trial_id = (result.metrics or {}).get("trial_id") or Path(result.path).name
            errors[str(trial_id)] = " ".join(str(result.error).split())[:300]
    ended = len(grid) >= settings.num_trials and \
        grid.num_terminated + grid.num_errors == len(grid)
    # Tune returns alike when its time budget runs out and on Ctrl-C: only the time taken
    # (Tune counts from its first check, after the start, so never more) tells them apart.
    budget_spent = settings.time_budget_s is not None and used_s >= settings.time_budget_s
    return FitOutcome(errors, ended or budget_spent)


def run_search(settings: SearchSettings, out: str | Path, *,
               address: str | None = None) -> FitOutcome:
    """Run a new search into ``out`` (absent or empty)."""
    out = Path(out).resolve()
    if (out / SETTINGS_FILE).exists():
        raise FileExistsError(f"{out} already holds a search; continue it with `nats search "
                              f"--resume {out}`, show it with `nats search show {out}`, or "
                              "choose another --out")
    if out.is_file():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        # The Tune state signed at the end covers every file in the folder: nothing may be
        # there that this search did not write.
        raise FileExistsError(f"--out {out} is not empty; choose a new or empty folder")
    settings = _storage_in_folder(settings, out)
    _check_storage(settings, out)
    from .folder_state import searching  # imports Ray and Optuna: after the quick checks

    with exclusive(out, "search folder"):
        (out / "trials").mkdir(parents=True, exist_ok=True)
        settings.save(out)
        try:
            # Queued in a new study only: a restarted one has them already.
            first = (settings.search_space().baseline_points(settings.base_config())
                     if settings.baselines else [])
            with searching(out):
                return _with_ray(address, lambda: _timed_fit(
                    out, settings, _tuner(settings, out, first).fit, fresh=True))
        finally:
            tune_state.sign(out / TUNE_NAME, out)


def resume_search(out: str | Path, *, address: str | None = None,
                  trust_tune_state: bool = False) -> FitOutcome:
    """Continue the search in ``out`` (``Tuner.restore``): finished trials are kept,
    unfinished ones resume from their checkpoints, errored ones are retried. The Tune
    state is restored only if it carries this user's signature (:mod:`.tune_state`) or
    ``trust_tune_state`` says to trust it. ``out`` may be a copy of the folder the search
    was made in, or that folder moved: it is the only folder written
    (:mod:`.folder_state`)."""
    from ray import tune

    from .folder_state import searching

    out = Path(out).resolve()
    settings = SearchSettings.load(out)
    path = out / TUNE_NAME

    def fit() -> FitOutcome:
        if not restorable:
            # Killed before Ray saved anything: start again from the saved settings (the
            # trials of the first start, if any, never reported and are not counted).
            print(f"nats: {out} holds no Ray Tune state yet: starting the search again "
                  "from its settings")
            return _timed_fit(out, settings, _tuner(settings, out).fit, fresh=True)
        tuner = tune.Tuner.restore(str(path), trainable=_trainable(settings, out),
                                   resume_unfinished=True, resume_errored=True)
        return _timed_fit(out, settings, tuner.fit, fresh=False)

    _check_storage(settings, out)
    with exclusive(out, "search folder"):
        restorable = tune.Tuner.can_restore(str(path))
        if restorable and not trust_tune_state:
            tune_state.verify(path, out)  # before the try: refused state is never signed
        try:
            with searching(out):
                return _with_ray(address, fit)
        finally:
            tune_state.sign(path, out)
