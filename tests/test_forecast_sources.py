"""Splits by source of trajectories: no held-out share, fold or early-stopping share
holds trajectories another side trained on (runs of one scenario sample or replayed
trace under other policies, modes or clusters)."""

from __future__ import annotations

import itertools

import pytest

from prorsa.forecast.conformal import held_out_runs
from prorsa.forecast.shipping import SimRun
from prorsa.forecast.sources import runs_by_source, source_folds, source_of_run
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig


def sim_run_id(seed: int, mode: str = "sync", policy: str = "static", scenario="math-tool",
               trace=None, slots: int = 4) -> str:  # fmt: skip
    work = WorkloadConfig(scenario=None if trace else scenario, trace=trace, mode=mode, seed=seed)
    control = ControlConfig(policy=policy)
    return SimRun.at_load(16, work, ClusterConfig(num_slots=slots), control).run_id


def test_sources_of_simulated_runs_follow_their_trajectories():
    a = sim_run_id(3)
    # another mode, policy or cluster: the same sampled trajectories
    assert {source_of_run(r) for r in (a, sim_run_id(3, "async", "mpc", slots=8))} == {
        "math-tool-s3"
    }
    assert source_of_run(sim_run_id(4)) == "math-tool-s4"
    # every replay of one trace (seed 0 replays it, other seeds draw from it): one source
    replays = {source_of_run(sim_run_id(s, trace="/x/tau2-train.parquet")) for s in (0, 5)}
    assert replays == {"replay:tau2-train"}
    assert source_of_run("imported-run-7") == "imported-run-7"


RUNS = [
    *(sim_run_id(s, mode, policy) for s in range(5) for mode in ("sync", "async")
      for policy in ("static", "mpc")),
    *(sim_run_id(s, mode, trace=f"/d/{t}.parquet") for s in range(3) for mode in ("sync", "async")
      for t in ("swe-train", "tau2-train")),
]  # fmt: skip


def test_held_out_runs_never_split_a_source_and_hold_out_a_replay():
    groups = runs_by_source(RUNS)
    assert len(groups) == 7  # five scenario seeds, two trace halves
    for seed in range(20):
        held = held_out_runs(RUNS, 0.2, seed)
        assert held and held != set(RUNS)
        for members in groups.values():
            assert set(members) <= held or not set(members) & held
        # replays are a stratum of their own: one of the two is always held out (a
        # fifth of the seven sources by count alone would often be scenarios only)
        replays = {source_of_run(r) for r in held if source_of_run(r).startswith("replay:")}
        assert len(replays) == 1


@pytest.mark.parametrize("folds", [2, 3, 10])
def test_source_folds_are_disjoint_and_stop_on_other_sources(folds):
    plan = source_folds(RUNS, folds, seed=1)
    assert len(plan) == min(folds, 7)
    tested = [run for f in plan for run in f.test]
    assert sorted(tested) == sorted(set(RUNS))  # every run predicted exactly once
    for f in plan:
        assert not (f.fit & f.stop or f.fit & f.test or f.stop & f.test)
        assert f.fit | f.stop | f.test == set(RUNS)
        assert f.stop and f.fit  # early stopping on sources the fold neither fits nor predicts
        sides = [{source_of_run(r) for r in side} for side in (f.fit, f.stop, f.test)]
        assert all(not a & b for a, b in itertools.combinations(sides, 2))
    if folds == 2:  # the two trace halves are dealt to different folds
        assert all(any(source_of_run(r).startswith("replay:") for r in f.test) for f in plan)
    assert source_folds([sim_run_id(0), sim_run_id(0, "async")], 2, seed=0) == []  # one source


def test_lightgbm_trajectory_fits_its_folds_by_source(monkeypatch):
    """The per-turn models' out-of-fold rounds follow :func:`source_folds`: no round fits
    or stops on a run of the source it predicts (spied on the trainer)."""
    import numpy as np
    import pyarrow as pa

    from prorsa.forecast import build_dataset, make_forecaster
    from prorsa.forecast import trajectory as trajectory_module
    from tests.sim_helpers import random_specs, run

    tables = []
    for i, (seed, mode) in enumerate(((0, "sync"), (0, "async"), (1, "sync"), (2, "sync"))):
        table = run(random_specs(24, seed=i, turns=(2, 5)), slots=4).telemetry
        ids = pa.array([sim_run_id(seed, mode)] * table.num_rows, pa.string())
        field = pa.field("run_id", pa.string(), nullable=False)
        tables.append(table.set_column(table.schema.get_field_index("run_id"), field, ids))
    data = build_dataset(tables)
    seen = []
    real = trajectory_module.source_folds

    def spy(runs, folds, seed):
        plan = real(runs, folds, seed)
        seen.append(plan)
        return plan

    monkeypatch.setattr(trajectory_module, "source_folds", spy)
    make_forecaster("lightgbm-trajectory", n_estimators=20).fit(data)
    (plan,) = seen
    assert len(plan) == 2
    for f in plan:
        assert {source_of_run(r) for r in f.test}.isdisjoint(
            source_of_run(r) for r in f.fit | f.stop
        )
    # the two mode runs of seed 0 share trajectories: one fold predicts both
    zero = {sim_run_id(0, "sync"), sim_run_id(0, "async")}
    assert any(zero <= f.test for f in plan)
    assert np.unique([source_of_run(r) for r in data.turns["run_id"].unique()]).size == 3
