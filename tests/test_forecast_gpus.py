"""Per-GPU load features: the cluster's GPU count comes from its telemetry's allocation events."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from prorsa.forecast.dataset import build_dataset
from prorsa.forecast.events import allocated_gpus, as_batch, gpus_in_detail
from prorsa.forecast.tracker import LifecycleTracker
from tests.sim_helpers import random_specs, run


def _telemetry(slots: int, policy: str = "static", **config) -> pa.Table:
    return run(random_specs(24, seed=1, turns=(2, 4)), policy, slots=slots, **config).telemetry


def test_a_simulated_run_starts_with_its_allocation():
    table = _telemetry(3)
    first = table.slice(0, 1).to_pylist()[0]
    assert first["kind"] == "allocation" and first["time"] == 0.0
    detail = json.loads(first["detail"])
    assert detail["reason"] == "start" and sum(detail["gpus"].values()) == 3
    # static: a quarter of the GPUs prefill, rounded to whole slots, at least one
    assert detail["gpus"]["prefill"] >= 1 and detail["gpus"]["decode"] >= 1


@pytest.mark.parametrize("role_tp", [1, 2])
def test_both_ingest_paths_read_the_gpu_count(role_tp):
    tp = {"prefill": role_tp, "decode": role_tp, "colocated": role_tp}
    table = _telemetry(2, role_tp=tp)
    vectorised, sequential = LifecycleTracker(()), LifecycleTracker(())
    vectorised.update(table)
    sequential.update_sequential(table)
    assert vectorised.gpus == sequential.gpus == 2 * role_tp


def test_features_are_per_gpu_and_nan_without_an_allocation():
    table = _telemetry(4)
    data = build_dataset(table, horizons=[1, 5])
    live = data.ticks["live"] * data.ticks["scale"]
    np.testing.assert_allclose(data.ticks["live_per_gpu"], live / 4)
    assert data.ticks["queued_per_gpu"].max() > 0
    # An imported trace without allocation events: the load features are unknown, not 0.
    kinds = table.column("kind").cast(pa.string())
    bare = table.filter(pa.compute.not_equal(kinds, "allocation"))
    unknown = build_dataset(bare, horizons=[1, 5])
    assert unknown.ticks["live_per_gpu"].isna().all()
    # Everything else is the same.
    np.testing.assert_allclose(unknown.ticks["live"], data.ticks["live"])


def test_the_latest_allocation_wins_and_odd_details_are_ignored():
    def allocation(t: float, detail: str) -> tuple:
        return (t, "r", "", "", "", 0, "allocation", -1, 0, 0, 0, 0, detail)

    rows = [
        allocation(0.0, '{"gpus":{"decode":6,"prefill":2}}'),
        allocation(1.0, '{"gpus":{"decode":7}}'),
        allocation(2.0, "not json"),
    ]
    assert allocated_gpus(as_batch(rows[:1])) == 8
    assert allocated_gpus(as_batch(rows)) == 7  # e.g. an engine lost; bad detail skipped
    for detail in ("", "[]", '{"gpus": 3}', '{"gpus": {"decode": "x"}}'):
        assert gpus_in_detail(detail) == 0
    tracker = LifecycleTracker(())
    tracker.update(rows)
    assert tracker.gpus == 7
