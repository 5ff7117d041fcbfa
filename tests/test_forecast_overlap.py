"""lightgbm-trajectory scores a tick's new turns beside the bottom-up sum: same forecasts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prorsa.forecast import bottomup, bottomup_kernel, build_dataset, make_forecaster
from prorsa.forecast import trajectory as trajectory_module
from tests.sim_helpers import random_specs, run


def _telemetry(n: int, seed: int, run_id: str) -> pa.Table:
    table = run(random_specs(n, seed=seed, turns=(2, 5)), "static", slots=2).telemetry
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


def _forecasts(model, table: pa.Table, ticks: int) -> tuple[list, int]:
    """Point and quantile forecasts tick by tick, and how many ticks overlapped."""
    model.reset()
    out, overlapped = [], 0
    for t in np.arange(1.0, ticks + 1.0):
        window = pc.and_(
            pc.greater(table.column("time"), t - 1.0), pc.less_equal(table.column("time"), t)
        )
        model.update(table.filter(window), float(t))
        overlapped += model._sums_at is not None
        f = model.predict()
        out.append((f.point, f.quantiles))
    return out, overlapped


def test_overlapped_scoring_gives_the_sequential_forecasts_bit_for_bit(monkeypatch):
    data = build_dataset([_telemetry(80, s, f"r{s}") for s in range(3)], horizons=[5, 30])
    model = make_forecaster(
        "lightgbm-trajectory", horizons=[5, 30], n_estimators=5, calibration_estimators=3
    )
    model.fit(data).set_drift_check(False)
    held_out = _telemetry(120, 9, "held-out")
    monkeypatch.setattr(trajectory_module, "MIN_ROWS", 1)  # every tick's new turns qualify
    # Both paths on the row kernel, which the overlap needs (numba-compiled where installed;
    # plain Python otherwise: slower, the same values).
    monkeypatch.setattr(bottomup, "COMPILED", True)
    monkeypatch.setattr(trajectory_module, "forecast_threads", lambda: 1)
    sequential, none = _forecasts(model, held_out, 12)
    assert none == 0
    monkeypatch.setattr(trajectory_module, "forecast_threads", lambda: 2)
    # Rows in chunks of 3: both threads take some of each shared sum.
    monkeypatch.setattr(bottomup_kernel, "CHUNK_ROWS", 3)
    overlapped, used = _forecasts(model, held_out, 12)
    assert used >= 8  # the first tick has no horizons to sum yet; some ticks start no turn
    # A tick whose forecast nobody read is not summed ahead at the next update.
    model.update(held_out.slice(0, 0), 13.0)
    model.update(held_out.slice(0, 0), 14.0)
    assert model._sums_at is None
    for (p1, q1), (p2, q2) in zip(sequential, overlapped, strict=True):
        for target in p1:
            np.testing.assert_array_equal(p1[target], p2[target])
        for level in q1:
            for target in q1[level]:
                np.testing.assert_array_equal(q1[level][target], q2[level][target])
