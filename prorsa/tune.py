"""Tune a policy's parameters on simulated rollouts with Optuna.

A study lives in an Optuna storage (SQLite by default) and may be run by several workers at
once (Ray tasks, local or on a cluster) and resumed after an interruption:

- **No repeated parameter sets.** The sampler is re-created for every trial with the seed
  ``sampler_seed + trial number`` (:class:`PerTrialSeedSampler`). Trial numbers are handed
  out by the storage, unique within a study, so no two trials - concurrent, or before and
  after a resume - draw from the same random stream. (Before, every run restarted the
  sampler at its seed and re-proposed the parameters of the study's first trials.)
- **Exact budget.** ``trials`` counts finished (complete or pruned) and running trials. A
  worker stops when the budget is reached, and a trial that finds, at its start, that the
  trials numbered before it already fill the budget ends as FAIL marked ``over_budget``
  before it samples anything - so concurrent workers never overshoot.
- **Interrupted trials.** Workers send heartbeats; a trial whose worker was killed is
  failed once it goes stale (``2 x heartbeat_s``) and its slot in the budget is run again.
  On Ctrl-C / SIGTERM the trials of this run are failed at once.
- **Comparable resumes.** Every setting that changes the objective (workload, mode,
  engines, trajectories, profile, cluster overrides, fixed parameters, seeds, objectives)
  is stored as the study's ``settings`` attribute; resuming with different settings is
  refused. The default study name carries a hash of them.
- **Defaults first.** A new study's first trial runs the policy's defaults (with the fixed
  parameters applied; :func:`default_trial_params`), so the best trial is never worse
  than them on the tuning seeds.

Tuning uses workload seeds ``seed_offset ..`` (1000 by default), apart from the seeds
``0 ..`` that ``prorsa compare`` evaluates on, so tuned parameters are compared on
samples they were not tuned on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell
from prorsa.io import check_output
from prorsa.policy import POLICIES
from prorsa.policy.params import (
    check_count,
    check_interval_s,
    check_policy_params,
    check_storage_url,
)

logger = logging.getLogger(__name__)

OBJECTIVES = ("objective", "switches")  # objective: makespan (sync) or s/trajectory (async)
SETTINGS_ATTR = "settings"


@dataclass
class TuneConfig:
    """What to tune, on which workload, and how the study runs."""

    policy: str
    # Workload, cluster, control loop and fixed policy parameters (base.control); the
    # policy, the parameters drawn and the seed are set per evaluation.
    base: Cell
    trials: int = 20  # budget of the whole study, across runs and workers
    seeds: int = 2  # workload samples per trial
    storage: str = "sqlite:///out/tune/optuna.db"
    study_name: str | None = None  # default: policy, workload, mode, engines, settings hash
    sampler_seed: int = 0  # trial n samples with seed sampler_seed + n
    objectives: tuple[str, ...] = ("objective",)  # ("objective", "switches"): Pareto front
    seed_offset: int = 1000  # first workload seed (compare evaluates on 0..seeds-1)
    workers: int = 1  # concurrent trials; 1 without address runs in this process
    address: str | None = None  # Ray cluster to join; None starts local Ray if workers > 1
    heartbeat_s: int = 10  # a killed worker's trial is failed after 2x this
    extra_settings: dict = field(default_factory=dict)  # anything else the caller varies

    def validate(self) -> None:
        """Raise :class:`ConfigError` for settings that cannot run, before any trial does."""
        POLICIES.get(self.policy)
        check_count(self.trials, "trials")
        check_count(self.seeds, "seeds")
        check_count(self.workers, "workers")
        check_policy_params(self.policy, self.base.control.policy_params)
        check_interval_s(self.base.control.interval_s)
        work = self.base.work
        work.validate()
        if work.trace is not None and not Path(work.trace).is_file():
            raise ConfigError(f"trace not found: {work.trace}", hint="give an imported .parquet")
        self.base.cluster.validate()
        self.base.control.validate()
        if self.heartbeat_s < 1:
            raise ConfigError(f"heartbeat_s must be >= 1 s, got {self.heartbeat_s}")
        if not self.objectives or self.objectives[0] != "objective":
            raise ConfigError(
                f"objectives must start with 'objective', got {list(self.objectives)}",
                hint="use ('objective',) or ('objective', 'switches')",
            )
        unknown = [o for o in self.objectives if o not in OBJECTIVES]
        if unknown or len(set(self.objectives)) != len(self.objectives):
            raise ConfigError(f"bad objectives {list(self.objectives)}", hint=f"from {OBJECTIVES}")
        _check_storage(self.storage)

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1


def study_settings(cfg: TuneConfig) -> dict:
    """Every setting that changes a trial's objective, as plain JSON values."""
    cell = cfg.base.to_dict()
    # Set per evaluation: not settings of the study.
    del cell["work"]["seed"], cell["control"]["policy"], cell["series"]
    # What the trials read besides (simulator, trained models, the trace's content): a
    # study scored by other code or models is another study.
    inputs = dataclasses.replace(
        cfg.base, control=dataclasses.replace(cfg.base.control, policy=cfg.policy)
    ).inputs()
    settings = {
        "policy": cfg.policy,
        "cell": cell,
        "inputs": inputs,
        "seeds": cfg.seeds,
        "seed_offset": cfg.seed_offset,
        "objectives": list(cfg.objectives),
        **({"extra": cfg.extra_settings} if cfg.extra_settings else {}),
    }
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def default_study_name(cfg: TuneConfig) -> str:
    """``policy-workload-mode-Ne-hash``: the hash covers every objective-changing setting."""
    digest = hashlib.sha256(json.dumps(study_settings(cfg), sort_keys=True).encode()).hexdigest()[
        :8
    ]
    workload = cfg.base.workload
    if "/" in workload or workload.endswith(".parquet"):
        workload = Path(workload).name.split(".")[0]
    return f"{cfg.policy}-{workload}-{cfg.base.mode}-{cfg.base.cluster.num_slots}e-{digest}"


def fixed_params(settings: dict) -> dict:
    """The fixed policy parameters of a study's stored settings (nested by config, or
    the flat cell of studies created before the run configs were shared)."""
    cell = settings.get("cell", {})
    return dict(cell.get("control", cell).get("policy_params") or {})


class _DefaultsTrial:
    """A stand-in Optuna trial that answers each draw with the policy's default for it
    (or the range's low end / first choice when it has none), noting which it knew."""

    def __init__(self, defaults: dict) -> None:
        self.defaults = defaults
        self.params: dict[str, Any] = {}

    def _draw(self, name: str, fallback: Any) -> Any:
        if name in self.defaults:
            self.params[name] = self.defaults[name]
            return self.defaults[name]
        return fallback

    def suggest_float(self, name: str, low: float, high: float, **_: Any) -> float:
        return self._draw(name, low)

    def suggest_int(self, name: str, low: int, high: int, **_: Any) -> int:
        return self._draw(name, low)

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self._draw(name, choices[0])


class _Fixing:
    """Wraps an Optuna trial: a parameter the study fixes is answered with its fixed value
    and never drawn (nor recorded among the trial's parameters); the rest are drawn."""

    def __init__(self, trial: Any, fixed: dict) -> None:
        self.trial = trial
        self.fixed = fixed

    def suggest_float(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in self.fixed:
            return self.fixed[name]
        return self.trial.suggest_float(name, *args, **kwargs)

    def suggest_int(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in self.fixed:
            return self.fixed[name]
        return self.trial.suggest_int(name, *args, **kwargs)

    def suggest_categorical(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in self.fixed:
            return self.fixed[name]
        return self.trial.suggest_categorical(name, *args, **kwargs)


def drawn_params(policy_cls: type, trial: Any, fixed: dict | None = None) -> dict:
    """``policy_cls``'s parameters for ``trial``: the study's fixed ones as fixed, the
    rest of its search space drawn."""
    fixed = dict(fixed or {})
    return {**fixed, **policy_cls.search_space(_Fixing(trial, fixed))}


def default_trial_params(policy: str, fixed: dict | None = None) -> dict:
    """The Optuna parameters of ``policy``'s search space that reproduce its defaults
    (the study's fixed parameters are not drawn): a new study's first trial."""
    policy_cls = POLICIES.get(policy)
    trial = _DefaultsTrial(policy_cls.search_defaults())
    drawn_params(policy_cls, trial, fixed)
    return trial.params


# ---------------------------------------------------------------------------------------
# Storage, sampler, budget


def _check_storage(url: str) -> None:
    """:func:`~prorsa.policy.params.check_storage_url`, except that a SQLite database's
    folder may be missing when it can be made (:func:`open_storage` creates it)."""
    if isinstance(url, str) and url.startswith("sqlite:///"):
        folder = Path(url.removeprefix("sqlite:///")).expanduser().parent
        if url.removeprefix("sqlite:///") not in ("", ":memory:") and not folder.is_dir():
            check_output(folder, kind="dir")
            return
    check_storage_url(url, "Optuna storage")


def absolute_storage_url(url: str) -> str:
    """A SQLite URL with an absolute path, so workers in other directories find the file."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        return f"sqlite:///{Path(url.removeprefix('sqlite:///')).resolve()}"
    return url


def open_storage(url: str, heartbeat_s: int | None = None):
    """An ``RDBStorage`` for ``url`` (SQLite folders are created); a bad URL is a ConfigError."""
    _check_storage(url)
    url = absolute_storage_url(url)
    engine_kwargs = None
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # Several workers write one file; wait for the lock instead of failing at once.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    try:
        with warnings.catch_warnings():  # heartbeats are marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_s,
                grace_period=2 * heartbeat_s if heartbeat_s else None,
            )
    except Exception as exc:  # SQLAlchemy reports bad URLs and drivers in many types
        raise ConfigError(
            f"cannot open Optuna storage '{url}': {exc}",
            hint="check the URL, its driver and that the database is reachable",
        ) from None


class PerTrialSeedSampler(optuna.samplers.BaseSampler):
    """TPE whose random stream is chosen by the trial number: trial ``n`` samples with a
    fresh ``TPESampler(seed=seed + n)``. The storage numbers trials uniquely, so resumed
    and concurrent runs never share a stream (the failure mode of one seeded sampler per
    process, which re-proposes the same parameter sets)."""

    def __init__(self, seed: int = 0, **tpe_options: Any) -> None:
        self.seed = seed
        self.tpe_options = tpe_options
        self._number: int | None = None
        self._delegate: optuna.samplers.BaseSampler = self._make(0)

    def seed_for(self, number: int) -> int:
        return (self.seed + number) % 2**32

    def _make(self, number: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.TPESampler(seed=self.seed_for(number), **self.tpe_options)

    def _for(self, trial) -> Any:
        if trial.number != self._number:
            self._number = trial.number
            self._delegate = self._make(trial.number)
        return self._delegate

    def infer_relative_search_space(self, study, trial):
        return self._for(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._for(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._for(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self._for(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._for(trial).after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        """Seeds come from trial numbers; nothing to reseed."""


COUNTED_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
FINISHED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


def counted_trials(study) -> list:
    """Trials that use the budget: finished (complete or pruned) or running, not surplus."""
    return [
        t
        for t in study.get_trials(deepcopy=False, states=COUNTED_STATES)
        if not t.user_attrs.get("over_budget")
    ]


def _within_budget(study, number: int, budget: int) -> bool:
    """True when fewer than ``budget`` counted trials were numbered before ``number``."""
    return sum(t.number < number for t in counted_trials(study)) < budget


class _OverBudget(Exception):
    """A trial started after the budget was filled by other workers (recorded as FAIL)."""


# ---------------------------------------------------------------------------------------
# Workers


@dataclass(frozen=True)
class _WorkerSpec:
    """Everything a worker needs (picklable: it travels to Ray tasks)."""

    storage: str
    study_name: str
    policy: str
    base: Cell
    seeds: int
    seed_offset: int
    objectives: tuple[str, ...]
    trials: int
    sampler_seed: int
    heartbeat_s: int
    run_token: str


def _load(spec: _WorkerSpec):
    return optuna.load_study(
        study_name=spec.study_name,
        storage=open_storage(spec.storage, spec.heartbeat_s),
        sampler=PerTrialSeedSampler(spec.sampler_seed),
        pruner=(
            optuna.pruners.NopPruner()
            if len(spec.objectives) > 1
            else optuna.pruners.MedianPruner(n_startup_trials=3)
        ),
    )


def run_trials(
    spec: _WorkerSpec, on_trial: Callable[[], None] | None = None, n_trials: int | None = None
) -> int:
    """Run trials of the study until its budget is used (or ``n_trials`` of them); returns
    how many this worker ran."""
    from optuna.study import MaxTrialsCallback

    from prorsa.experiments.cells import run_cell

    study = _load(spec)
    policy_cls = POLICIES.get(spec.policy)
    ran = 0

    def objective(trial) -> float | tuple[float, ...]:
        nonlocal ran
        trial.set_user_attr("run_token", spec.run_token)
        if not _within_budget(study, trial.number, spec.trials):
            trial.set_user_attr("over_budget", True)
            study.stop()
            raise _OverBudget(f"trial {trial.number}: the study's {spec.trials} trials are taken")
        params = drawn_params(policy_cls, trial, spec.base.control.policy_params)
        trial.set_user_attr("policy_params", params)
        ran += 1
        objective_sum = switches_sum = 0.0
        for i in range(spec.seeds):
            cell = spec.base.changed(
                policy=spec.policy,
                policy_params=params,
                seed=spec.seed_offset + i,
                series=False,
            )
            run = run_cell(cell)
            objective_sum += run["objective"]
            switches_sum += float(run["metrics"]["switches_completed"])
            # Optuna prunes single-objective studies only; after the last seed the value
            # is known, and pruning it would throw a finished evaluation away.
            if len(spec.objectives) == 1 and i < spec.seeds - 1:
                trial.report(objective_sum / (i + 1), step=i)
                if trial.should_prune():
                    raise optuna.TrialPruned()
        values = {"objective": objective_sum / spec.seeds, "switches": switches_sum / spec.seeds}
        trial.set_user_attr("switches", values["switches"])
        out = tuple(values[name] for name in spec.objectives)
        return out[0] if len(out) == 1 else out

    callbacks: list = [MaxTrialsCallback(spec.trials, states=COUNTED_STATES)]
    if on_trial is not None:
        callbacks.append(lambda _study, _trial: on_trial())
    if len(counted_trials(study)) < spec.trials:
        study.optimize(objective, n_trials=n_trials, catch=(_OverBudget,), callbacks=callbacks)
    return ran


def _remote_run_trials(spec: _WorkerSpec) -> int:
    """Ray task body (module-level so it pickles by reference)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a worker's INFO lines go nowhere
    return run_trials(spec)


# ---------------------------------------------------------------------------------------
# The driver


def tune(
    cfg: TuneConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    tracker=None,
    out: Path | None = None,
):
    """Run (or resume) the study until ``cfg.trials`` trials are used; returns the study.

    Lower is better for every objective. ``progress(done, total)`` follows finished
    trials; ``tracker`` (a :class:`prorsa.tracking.Tracker`) logs the study; ``out`` gets
    ``study.json`` (and ``pareto.json`` + ``pareto.png`` for two objectives).
    """
    cfg.validate()
    settings = study_settings(cfg)
    name = cfg.study_name or default_study_name(cfg)
    storage_url = absolute_storage_url(cfg.storage)
    storage = open_storage(storage_url, cfg.heartbeat_s)
    study = _create_or_check(storage, name, settings, len(cfg.objectives))
    with warnings.catch_warnings():  # fail_stale_trials is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    spec = _WorkerSpec(
        storage=storage_url,
        study_name=name,
        policy=cfg.policy,
        base=cfg.base,
        seeds=cfg.seeds,
        seed_offset=cfg.seed_offset,
        objectives=tuple(cfg.objectives),
        trials=cfg.trials,
        sampler_seed=cfg.sampler_seed,
        heartbeat_s=cfg.heartbeat_s,
        run_token=uuid.uuid4().hex,
    )

    def report() -> None:
        if progress is not None:
            done = study.get_trials(deepcopy=False, states=FINISHED_STATES)
            progress(min(len(done), cfg.trials), cfg.trials)

    report()
    try:
        from prorsa.experiments.sweep import signals_interrupt

        if cfg.workers == 1 and cfg.address is None:
            with signals_interrupt():
                run_trials(spec, on_trial=report)
        else:
            if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                # The enqueued defaults run here first: on SQLite two workers can both
                # take a waiting trial (no row locks), and the second then fails to
                # report a trial the first completed.
                with signals_interrupt():
                    run_trials(spec, on_trial=report, n_trials=1)
            _run_on_ray(spec, cfg, report)
    except KeyboardInterrupt:
        _fail_own_trials(storage, study, spec.run_token)
        raise
    report()
    study = optuna.load_study(study_name=name, storage=storage)
    if out is not None:
        write_study_files(study, out)
    if tracker is not None and tracker.enabled:
        log_study(tracker, study, settings, out)
    return study


def _run_on_ray(spec: _WorkerSpec, cfg: TuneConfig, report: Callable[[], None]) -> None:
    from prorsa.experiments.sweep import cancel_ray_tasks, ray_session, signals_interrupt

    if cfg.address and spec.storage.startswith("sqlite:"):
        logger.warning(
            "SQLite storage with a Ray cluster works only if every node sees %s", spec.storage
        )
    with ray_session(cfg.workers, cfg.address) as ray, signals_interrupt():
        task = ray.remote(num_cpus=1, max_retries=0)(_remote_run_trials)
        pending = [task.remote(spec) for _ in range(cfg.workers)]
        try:
            while pending:
                # A timeout keeps the driver responsive to signals and to progress.
                ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
                for ref in ready:
                    ray.get(ref)
                report()
        finally:
            if pending:
                cancel_ray_tasks(ray, pending)


def _create_or_check(storage, name: str, settings: dict, n_objectives: int):
    """Load study ``name`` and check its settings, or create it with them."""
    directions = ["minimize"] * n_objectives
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        try:
            study = optuna.create_study(study_name=name, storage=storage, directions=directions)
        except optuna.exceptions.DuplicatedStudyError:  # a concurrent run created it first
            study = optuna.load_study(study_name=name, storage=storage)
    stored = study.user_attrs.get(SETTINGS_ATTR)
    if stored is None:
        if study.trials:
            raise ConfigError(
                f"study '{name}' has {len(study.trials)} trials but no recorded settings; "
                "it cannot be checked against this run",
                hint="use a new --study name (or another --storage)",
            )
        study.set_user_attr(SETTINGS_ATTR, settings)
        defaults = default_trial_params(settings["policy"], fixed_params(settings))
        if defaults:
            # skip_if_exists: a concurrent run that loaded the fresh study may enqueue too.
            study.enqueue_trial(defaults, skip_if_exists=True)
        return study
    if stored != settings:
        diff = _differences(stored, settings)
        raise ConfigError(
            f"study '{name}' was run with other settings: {'; '.join(diff[:6])}",
            hint="resuming would mix incomparable trials; use a new --study name, "
            "or rerun with the study's settings",
        )
    return study


def _differences(stored: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(stored) | set(now)):
        a, b = stored.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} was {a!r}, now {b!r}")
    return out


def _fail_own_trials(storage, study, run_token: str) -> None:
    """Mark this run's still-running trials FAIL (their workers were just stopped)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.user_attrs.get("run_token") == run_token:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
            with contextlib.suppress(RuntimeError):  # it finished meanwhile
                storage.set_trial_state_values(trial_id, TrialState.FAIL)


# ---------------------------------------------------------------------------------------
# Results


def best_trial(study):
    """The best trial: the minimum for one objective; for several, the Pareto-optimal trial
    with the lowest first objective (makespan), ties broken by the next ones."""
    if len(study.directions) == 1:
        return study.best_trial
    return min(study.best_trials, key=lambda t: (tuple(t.values), t.number))


def policy_params_of(trial, policy: str, fixed: dict | None = None) -> dict:
    """The policy parameters a trial ran with (recorded, else rebuilt from its draws)."""
    if "policy_params" in trial.user_attrs:
        return dict(trial.user_attrs["policy_params"])
    return drawn_params(POLICIES.get(policy), optuna.trial.FixedTrial(trial.params), fixed)


def study_summary(study) -> dict:
    """Plain-data summary: settings, trial counts, best trial, Pareto front."""
    settings = study.user_attrs.get(SETTINGS_ATTR, {})
    objectives = settings.get("objectives", ["objective"])
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    summary: dict[str, Any] = {
        "study": study.study_name,
        "settings": settings,
        "trials": {
            state.name.lower(): len(study.get_trials(deepcopy=False, states=(state,)))
            for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        },
    }
    if not complete:
        return summary
    best = best_trial(study)
    summary["best"] = _trial_row(best, objectives, settings)
    if len(objectives) > 1:
        front = sorted(study.best_trials, key=lambda t: tuple(t.values))
        summary["pareto_front"] = [_trial_row(t, objectives, settings) for t in front]
    return summary


def _trial_row(trial, objectives: list[str], settings: dict) -> dict:
    fixed = fixed_params(settings)
    return {
        "trial": trial.number,
        "values": dict(zip(objectives, trial.values, strict=True)),
        "switches": trial.user_attrs.get("switches"),
        "params": trial.params,
        "policy_params": policy_params_of(trial, settings.get("policy", ""), fixed),
    }


def write_study_files(study, out: Path) -> list[Path]:
    """``study.json`` and, for two objectives, ``pareto.json`` and ``pareto.png``."""
    from prorsa.experiments.pareto import pareto_plot

    out.mkdir(parents=True, exist_ok=True)
    summary = study_summary(study)
    written = [out / "study.json"]
    written[0].write_text(json.dumps(summary, indent=1, default=float) + "\n")
    if "pareto_front" in summary:
        (out / "pareto.json").write_text(
            json.dumps(summary["pareto_front"], indent=1, default=float) + "\n"
        )
        written += [out / "pareto.json", pareto_plot(study, out / "pareto.png")]
    return written


def log_study(tracker, study, settings: dict, out: Path | None = None) -> str | None:
    """Log the study to MLflow: settings as params, each finished trial's objectives as
    metrics at ``step = trial number``, the best values, and the study files."""
    objectives = settings.get("objectives", ["objective"])
    with tracker.run(
        f"tune {study.study_name}",
        params={**settings, "study": study.study_name},
        experiment="prorsa-tune",
        tags={"prorsa.study": study.study_name},
    ) as run:
        for trial in sorted(
            study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
            key=lambda t: t.number,
        ):
            metrics = dict(zip(objectives, trial.values, strict=True))
            metrics.setdefault("switches", trial.user_attrs.get("switches"))
            run.log_metrics(metrics, step=trial.number)
        summary = study_summary(study)
        if "best" in summary:
            run.log_metrics({f"best_{k}": v for k, v in summary["best"]["values"].items()})
            run.log_params({f"best.{k}": v for k, v in summary["best"]["policy_params"].items()})
        if out is not None:
            run.log_artifacts(out)
        return run.run_id


def tuned_params(
    storage: str, policies: Iterable[str], studies: Iterable[str] = ()
) -> dict[str, dict]:
    """Best parameters per policy found in ``storage``.

    For each policy, the study tuning it (``studies`` names them when a storage holds
    several for one policy). Policies without a study keep their defaults. Returns
    ``{policy: {"study", "trial", "values", "params", "settings"}}``.
    """
    policies = list(policies)
    studies = list(studies)
    store = open_storage(storage)
    names = optuna.get_all_study_names(store)
    unknown = [s for s in studies if s not in names]
    if unknown:
        raise ConfigError(
            f"no study {unknown} in {storage}",
            hint=f"studies there: {', '.join(names) or 'none'}",
        )
    by_policy: dict[str, list] = {}
    for name in studies or names:
        study = optuna.load_study(study_name=name, storage=store)
        policy = study.user_attrs.get(SETTINGS_ATTR, {}).get("policy")
        if policy in policies and any(
            not math.isnan(v) for t in study.best_trials for v in t.values
        ):
            by_policy.setdefault(policy, []).append(study)
    found = {}
    for policy, candidates in by_policy.items():
        if len(candidates) > 1:
            raise ConfigError(
                f"{storage} holds {len(candidates)} studies of '{policy}': "
                + ", ".join(s.study_name for s in candidates),
                hint="name the one to use with --tuned-study",
            )
        study = candidates[0]
        settings = study.user_attrs[SETTINGS_ATTR]
        best = best_trial(study)
        found[policy] = {
            "study": study.study_name,
            "trial": best.number,
            "values": list(best.values),
            "params": policy_params_of(best, policy, fixed_params(settings)),
            "settings": settings,
        }
    for policy in policies:
        if policy not in found:
            logger.info("no tuned study of %s in %s; it keeps its defaults", policy, storage)
    return found
