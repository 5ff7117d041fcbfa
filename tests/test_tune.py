from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from prorsa.errors import ConfigError, OutputError
from prorsa.experiments.cells import Cell, cell_of
from prorsa.experiments.compare import CompareConfig, run_compare
from prorsa.policy import POLICIES
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.tracking import Tracker
from prorsa.tune import (
    FINISHED_STATES,
    PerTrialSeedSampler,
    TuneConfig,
    _within_budget,
    default_study_name,
    default_trial_params,
    drawn_params,
    tune,
    tuned_params,
)
from prorsa.workload.config import WorkloadConfig

REPO = Path(__file__).resolve().parents[1]


def _base(tmp_path=None, **changes):
    base = Cell.of(
        scenario="search",
        mode="sync",
        policy="static",
        seed=0,
        num_slots=4,
        profile="h200-qwen2.5-7b-tp1",
        trajectories=24,
        group_size=4,
    )
    return base.changed(**changes)


def _param_sets(study) -> list[tuple]:
    return [tuple(sorted(t.params.items())) for t in study.trials if t.params]


def _finished(study) -> int:
    return len(study.get_trials(states=FINISHED_STATES))


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module; tune reuses it instead of starting its own."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_study_persists_and_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(policy="static", base=_base(tmp_path), trials=3, seeds=1, storage=storage)
    first = tune(cfg)
    assert len(first.trials) == 3
    assert 0.05 <= first.best_params["prefill_fraction"] <= 0.75
    again = tune(
        TuneConfig(policy="static", base=_base(tmp_path), trials=5, seeds=1, storage=storage)
    )
    assert len(again.trials) == 5  # two more, the first three kept
    assert again.best_value <= first.best_value
    # A resumed run used to restart the sampler at its seed and re-propose trials 0 and 1.
    assert len(set(_param_sets(again))) == 5


def test_a_new_study_runs_the_defaults_first_and_only_once(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(policy="static", base=_base(tmp_path), trials=2, seeds=1, storage=storage)
    first = tune(cfg)
    assert first.trials[0].params == {"prefill_fraction": 0.25}  # StaticPolicy's default
    assert first.best_value <= first.trials[0].value  # never worse than the defaults
    again = tune(replace(cfg, trials=4))
    assert [t.params["prefill_fraction"] for t in again.trials].count(0.25) == 1
    # A fixed parameter is never drawn: every trial runs it as fixed.
    fixed = _base(tmp_path, policy_params={"prefill_fraction": 0.5})
    other = tune(replace(cfg, base=fixed, study_name="fixed", trials=2))
    assert [t.params for t in other.trials] == [{}, {}]
    assert all(t.user_attrs["policy_params"] == {"prefill_fraction": 0.5} for t in other.trials)


def test_tuning_draws_the_start_mode_and_split_unless_they_are_fixed():
    defaults = default_trial_params("predictive")
    assert defaults["start"] == "auto" and defaults["prefill_fraction"] == 0.25
    fixed = {"start": "split", "prefill_fraction": 0.1875}
    assert not {"start", "prefill_fraction"} & set(default_trial_params("predictive", fixed))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    drawn = []
    for _ in range(12):
        trial = study.ask()
        drawn.append(drawn_params(POLICIES.get("predictive"), trial, fixed))
        assert "start" not in trial.params and "prefill_fraction" not in trial.params
        study.tell(trial, 1.0)
    assert all(p["start"] == "split" and p["prefill_fraction"] == 0.1875 for p in drawn)
    assert len({p["horizon_s"] for p in drawn}) > 1  # the knobs are still drawn
    free = study.ask()
    params = drawn_params(POLICIES.get("mpc"), free)
    assert params["start"] in ("auto", "colocated", "split") and "start" in free.params


def test_sampler_seed_follows_the_trial_number():
    sampler = PerTrialSeedSampler(seed=7)
    assert len({sampler.seed_for(n) for n in range(10_000)}) == 10_000
    study = optuna.create_study(sampler=sampler)
    for _ in range(4):
        study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=1)
    # A fresh sampler (a resumed or concurrent run) reproduces a trial only at its number.
    replay = optuna.create_study(sampler=PerTrialSeedSampler(seed=7))
    replay.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=1)
    assert replay.trials[0].params == study.trials[0].params
    assert len({t.params["x"] for t in study.trials}) == 4


def test_budget_counts_earlier_finished_and_running_trials():
    study = optuna.create_study()
    trials = [study.ask() for _ in range(4)]  # numbers 0..3, all running
    assert _within_budget(study, 2, budget=3)
    assert not _within_budget(study, 3, budget=3)
    study.tell(trials[0], state=TrialState.FAIL)  # a failed trial frees its slot
    assert _within_budget(study, 3, budget=3)
    study.tell(trials[1], 1.0)
    trials[2].set_user_attr("over_budget", True)  # surplus trials never count
    assert _within_budget(study, 3, budget=2)


def test_mismatching_resume_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(
        policy="static", base=_base(), trials=1, seeds=1, storage=storage, study_name="s"
    )
    tune(cfg)
    heavier = replace(cfg, base=_base(trajectories=48))
    with pytest.raises(ConfigError, match="trajectories was 24, now 48") as info:
        tune(heavier)
    assert "--study" in info.value.hint
    with pytest.raises(ConfigError, match="seeds was 1, now 2"):
        tune(replace(cfg, seeds=2))
    with pytest.raises(ConfigError, match="objectives"):
        tune(replace(cfg, objectives=("objective", "switches")))
    # Default names carry a hash of the settings, so other settings make another study.
    named = replace(heavier, study_name=None)
    assert default_study_name(named) != default_study_name(replace(cfg, study_name=None))
    assert default_study_name(named).startswith("static-search-sync-4e-")


def test_bad_tune_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        tune(TuneConfig(policy="nope", base=_base(tmp_path)))
    with pytest.raises(ConfigError):
        tune(TuneConfig(policy="static", base=_base(tmp_path), trials=0))
    with pytest.raises(ConfigError, match="storage URL"):
        tune(TuneConfig(policy="static", base=_base(), storage="out/tune.db"))
    with pytest.raises(ConfigError, match="objectives"):
        tune(TuneConfig(policy="static", base=_base(), objectives=("switches",)))
    with pytest.raises(ConfigError, match="workers"):
        tune(TuneConfig(policy="static", base=_base(), workers=0))


@pytest.mark.ray
def test_two_ray_workers_fill_the_budget_exactly(tmp_path, ray_local):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(policy="static", base=_base(), trials=7, seeds=1, storage=storage, workers=2)
    done = []
    study = tune(cfg, progress=lambda d, t: done.append((d, t)))
    assert _finished(study) == 7
    assert len(set(_param_sets(study))) == len(_param_sets(study))  # no repeated sets
    surplus = [t for t in study.trials if t.user_attrs.get("over_budget")]
    assert all(not t.params for t in surplus)  # a surplus trial never samples
    assert done[-1] == (7, 7)
    # The defaults ran once, first (taken by the driver, not raced for by both workers).
    assert study.trials[0].params == {"prefill_fraction": 0.25}
    assert [t.params.get("prefill_fraction") for t in study.trials].count(0.25) == 1
    # Another run on the full study runs nothing more.
    assert _finished(tune(cfg)) == 7


def test_study_killed_mid_trial_resumes_in_the_same_file(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    script = f"""
from prorsa.experiments.cells import Cell, cell_of
from prorsa.tune import TuneConfig, tune
base = Cell.of(scenario="swe", mode="sync", policy="static", seed=0, num_slots=8,
               profile="h200-qwen2.5-7b-tp1", trajectories=512)
tune(TuneConfig(policy="static", base=base, trials=3, seeds=1, storage={storage!r},
                study_name="killed", heartbeat_s=1))
"""
    # The schema first: this test polls the file while the child starts, and two processes
    # creating an empty Optuna database at once can both insert its version row.
    optuna.storages.RDBStorage(storage)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        running = []
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:
                study = optuna.load_study(study_name="killed", storage=storage)
            except KeyError:
                continue
            running = study.get_trials(states=(TrialState.RUNNING,))
            if running and running[0].params:
                break
        assert running, "no trial started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = running[0].number
    time.sleep(2.5)  # past the grace period of two missed heartbeats
    base = Cell.of(
        scenario="swe",
        mode="sync",
        policy="static",
        seed=0,
        num_slots=8,
        profile="h200-qwen2.5-7b-tp1",
        trajectories=512,
    )
    study = tune(
        TuneConfig(
            policy="static",
            base=base,
            trials=3,
            seeds=1,
            storage=storage,
            study_name="killed",
            heartbeat_s=1,
        )
    )
    assert study.trials[killed].state == TrialState.FAIL
    assert _finished(study) == 3
    assert len(set(_param_sets(study))) == len(_param_sets(study))


def test_two_objectives_give_a_pareto_front(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(
        policy="threshold",
        base=_base(policy="threshold", trajectories=32),
        trials=5,
        seeds=1,
        storage=storage,
        objectives=("objective", "switches"),
    )
    study = tune(cfg, out=tmp_path / "out")
    assert len(study.directions) == 2
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    front = json.loads((tmp_path / "out" / "pareto.json").read_text())
    assert front and all(set(row["values"]) == {"objective", "switches"} for row in front)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    for row in front:  # nothing dominates a front member
        m, s = row["values"]["objective"], row["values"]["switches"]
        assert not any(
            t.values[0] <= m and t.values[1] <= s and (t.values[0] < m or t.values[1] < s)
            for t in complete
        )
    summary = json.loads((tmp_path / "out" / "study.json").read_text())
    assert summary["best"]["trial"] in {row["trial"] for row in front}
    assert summary["trials"]["complete"] == 5


def test_study_is_logged_to_mlflow_without_touching_the_callers_run(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(policy="static", base=_base(), trials=3, seeds=1, storage=storage)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'caller.db'}")
    try:
        with mlflow.start_run() as caller:
            study = tune(cfg, tracker=Tracker(uri), out=tmp_path / "out")
            assert mlflow.active_run().info.run_id == caller.info.run_id
        mlflow.set_tracking_uri(uri)
        runs = mlflow.search_runs(experiment_names=["prorsa-tune"])
    finally:
        mlflow.set_tracking_uri(None)
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["params.policy"] == "static" and run["params.cell.work.trajectories"] == "24"
    assert run["metrics.best_objective"] == pytest.approx(study.best_value)
    history = Tracker(uri).client().get_metric_history(run["run_id"], "objective")
    assert sorted(m.step for m in history) == [t.number for t in study.trials]
    assert (tmp_path / "mlruns" / "artifacts").is_dir()  # artifacts beside the store


def test_disabled_tracker_logs_nothing():
    with Tracker(None).run("x", params={"a": 1}) as run:
        run.log_metrics({"m": 1.0}, step=3)
        run.log_artifacts("/nonexistent")
    assert run.run_id is None and not run.enabled


def test_compare_uses_the_tuned_parameters(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = tune(TuneConfig(policy="static", base=_base(), trials=3, seeds=1, storage=storage))
    cfg = CompareConfig(
        workloads=[("search", None)],
        policies=["colocate", "static", "threshold"],
        seeds=1,
        work=WorkloadConfig(trajectories=24, group_size=4),
        cluster=ClusterConfig(num_slots=4),
        workers=1,
        tuned_storage=storage,
    )
    result = run_compare(cfg)
    assert set(result["tuned"]) == {"static"}  # threshold has no study: defaults
    assert result["tuned"]["static"]["trial"] == study.best_trial.number
    static = next(r for r in result["runs"] if cell_of(r).policy == "static")
    assert cell_of(static).control.policy_params == study.best_params
    threshold = next(r for r in result["runs"] if cell_of(r).policy == "threshold")
    assert cell_of(threshold).control.policy_params == {}
    # Two studies of one policy: the caller has to say which.
    tune(
        TuneConfig(policy="static", base=_base(trajectories=32), trials=1, seeds=1, storage=storage)
    )
    with pytest.raises(ConfigError, match="2 studies of 'static'"):
        tuned_params(storage, ["static"])
    chosen = tuned_params(storage, ["static"], studies=[study.study_name])
    assert chosen["static"]["study"] == study.study_name
    with pytest.raises(ConfigError, match="no study"):
        tuned_params(storage, ["static"], studies=["missing"])


def test_tune_cli_reports_the_study(tmp_path):
    from typer.testing import CliRunner

    from prorsa.cli.main import app

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = [
        "tune",
        "static",
        "--scenario",
        "search",
        "--engines",
        "4",
        "--trajectories",
        "24",
        "--trials",
        "3",
        "--seeds",
        "1",
        "--storage",
        storage,
        "--out",
        str(tmp_path / "out"),
    ]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    assert summary["trials"]["complete"] + summary["trials"]["pruned"] == 3
    assert (tmp_path / "out" / summary["study"] / "study.json").exists()
    bad = CliRunner().invoke(app, [*args[:-4], "--storage", "nonsense"])
    assert bad.exit_code == 1 and "storage URL" in bad.output


def test_bad_parameters_fail_before_the_study_opens(tmp_path, monkeypatch):
    import prorsa.tune as tuning

    def no_study(*_a, **_k):
        raise AssertionError("a study opened for settings that cannot work")

    monkeypatch.setattr(tuning, "open_storage", no_study)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    bad = {
        "no parameter 'prefill_gpu'": _base(policy_params={"prefill_gpu": 2}),
        "interval_s must be finite": _base(interval_s=float("nan")),
        "interval_s must be at least": _base(interval_s=1e-9),
        "trace not found": _base(scenario=None, trace=str(tmp_path / "missing.parquet")),
    }
    for message, base in bad.items():
        with pytest.raises(ConfigError, match=message):
            tune(TuneConfig(policy="static", base=base, storage=storage))


def test_sqlite_storage_folder_may_be_missing_but_must_be_makeable(tmp_path):
    fresh = f"sqlite:///{tmp_path / 'new' / 'deeper' / 'study.db'}"
    TuneConfig(policy="static", base=_base(), storage=fresh).validate()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        TuneConfig(
            policy="static", base=_base(), storage=f"sqlite:///{tmp_path}/file/s.db"
        ).validate()


def test_a_study_of_other_simulator_code_is_another_study(tmp_path, monkeypatch):
    # Found by review: the settings held no simulator or model identity, so after a code
    # change or a retrained forecaster the old study was resumed (or found complete).
    import prorsa.runtime.sim.version as version

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(
        policy="static", base=_base(), trials=1, seeds=1, storage=storage, study_name="s"
    )
    before = default_study_name(replace(cfg, study_name=None))
    tune(cfg)
    monkeypatch.setattr(version, "simulator_hash", lambda: "other simulator code")
    assert default_study_name(replace(cfg, study_name=None)) != before
    with pytest.raises(ConfigError, match=r"inputs\.simulator"):
        tune(cfg)
