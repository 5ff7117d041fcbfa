"""lightgbm-trajectory's offsets: what the calibration trees correct, for prefill and decode."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.forecast import build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.types import TARGETS
from tests.sim_helpers import random_specs, run


def _telemetry(slots: int, n: int, seed: int, run_id: str) -> pa.Table:
    table = run(random_specs(n, seed=seed, turns=(2, 5)), "static", slots=slots).telemetry
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


def _feed(model, table: pa.Table, until_s: float) -> None:
    model.reset()
    for t in np.arange(1.0, until_s + 1.0):
        events = table.filter(pa.compute.less_equal(table.column("time"), t))
        if t > 1.0:
            events = events.filter(pa.compute.greater(events.column("time"), t - 1.0))
        model.update(events, float(t))


def test_recent_offset_starts_decode_from_recent_demand_and_leaves_prefill_alone(tmp_path):
    data = build_dataset([_telemetry(2, 80, s, f"r{s}") for s in range(3)], horizons=[5])
    # One slow calibration tree: the forecast stays close to the offset it corrects.
    settings = {"horizons": [5], "n_estimators": 5, "calibration_estimators": 1}
    recent = make_forecaster("lightgbm-trajectory", decode_offset="recent", **settings)
    bottom_up = make_forecaster("lightgbm-trajectory", **settings)
    recent.fit(data).set_drift_check(False)
    bottom_up.fit(data).set_drift_check(False)
    # The point is the conformally shifted median; without the shift (measured here on
    # one small run) it is the offset plus one slow tree's correction.
    shifts = recent.conformal_
    recent.conformal_ = bottom_up.conformal_ = {}
    held_out = _telemetry(2, 80, 9, "held-out")
    for model in (recent, bottom_up):
        _feed(model, held_out, 5.0)
    fr, fb = recent.predict(), bottom_up.predict()
    tracker = recent.tracker_
    observed = tracker.observed_mean("decodes", 5.0)
    assert observed > 0
    assert fr.point["decode_sequences"][0] == pytest.approx(observed, rel=0.15)
    rate = tracker.observed_sum("cum_decode", 5.0)
    assert fr.point["decode_tokens"][0] == pytest.approx(rate * 5.0, rel=0.15)
    # prefill keeps the bottom-up offset: the same trees, the same forecast
    np.testing.assert_array_equal(fr.point["prefill_tokens"], fb.point["prefill_tokens"])
    assert fr.point["decode_sequences"][0] != fb.point["decode_sequences"][0]
    # the choice travels with the saved model
    recent.conformal_ = shifts
    fr = recent.predict()
    recent.save(tmp_path / "m")
    loaded = load_forecaster(tmp_path / "m").set_drift_check(False)
    assert loaded.decode_offset == "recent"
    _feed(loaded, held_out, 5.0)
    np.testing.assert_allclose(
        loaded.predict().point["decode_sequences"], fr.point["decode_sequences"]
    )


def test_blend_weights_are_fitted_saved_and_checked_on_load(tmp_path):
    data = build_dataset([_telemetry(2, 80, s, f"r{s}") for s in range(3)], horizons=[1, 5])
    settings = {"horizons": [1, 5], "n_estimators": 5, "calibration_estimators": 5}
    model = make_forecaster("lightgbm-trajectory", decode_offset="blend", **settings).fit(data)
    weights = model.offset_weights_
    assert weights["prefill_tokens"] == [1.0, 1.0]  # prefill corrects the bottom-up sum
    decode = [w for t in TARGETS[1:] for w in weights[t]]
    assert len(decode) == 6 and all(0.0 <= w <= 1.0 for w in decode)
    assert decode != [1.0] * 6  # recent demand carries weight somewhere
    model.save(tmp_path / "m")
    assert load_forecaster(tmp_path / "m").offset_weights_ == weights
    manifest = tmp_path / "m" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["state"]["offset_weights"]["decode_tokens"] = [0.5, 1.5]
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match=r"offset_weights\.decode_tokens"):
        load_forecaster(tmp_path / "m")
    text["state"]["offset_weights"] = {}  # a blend model without its weights
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match="needs the fitted offset weights"):
        load_forecaster(tmp_path / "m")


def test_unknown_decode_offset_is_refused():
    with pytest.raises(ConfigError, match="decode_offset"):
        make_forecaster("lightgbm-trajectory", decode_offset="last")
    with pytest.raises(ConfigError, match="prefill_offset"):
        make_forecaster("lightgbm-trajectory", prefill_offset="last")


def test_recent_prefill_offset_starts_prefill_from_later_turns_and_leaves_decode_alone():
    data = build_dataset([_telemetry(2, 80, s, f"r{s}") for s in range(3)], horizons=[5])
    settings = {"horizons": [5], "n_estimators": 5, "calibration_estimators": 1}
    recent = make_forecaster("lightgbm-trajectory", prefill_offset="recent", **settings)
    bottom_up = make_forecaster("lightgbm-trajectory", **settings)
    for model in (recent, bottom_up):
        model.fit(data).set_drift_check(False)
        model.conformal_ = {}  # the point is the median: the offset plus one slow tree
    assert recent.offset_weights_["prefill_tokens"] == [0.0]
    assert recent.offset_weights_["decode_tokens"] == [1.0]
    held_out = _telemetry(2, 80, 9, "held-out")
    for model in (recent, bottom_up):
        _feed(model, held_out, 5.0)
    fr, fb = recent.predict(), bottom_up.predict()
    tracker = recent.tracker_
    later = tracker.observed_sum("cum_prefill", 5.0) - tracker.observed_sum(
        "cum_first_prefill", 5.0
    )
    assert later > 0
    offset = recent.point_candidates()["prefill_tokens"]["offset"]
    assert offset[0] == pytest.approx(later * 5.0)
    assert fr.point["prefill_tokens"][0] == pytest.approx(later * 5.0, rel=0.15)
    assert fr.point["prefill_tokens"][0] != fb.point["prefill_tokens"][0]
    for target in TARGETS[1:]:  # decode keeps the bottom-up offset: the same forecast
        np.testing.assert_array_equal(fr.point[target], fb.point[target])


def test_blended_prefill_offset_is_fitted_saved_and_needed_on_load(tmp_path):
    data = build_dataset([_telemetry(2, 80, s, f"r{s}") for s in range(3)], horizons=[1, 5])
    settings = {"horizons": [1, 5], "n_estimators": 5, "calibration_estimators": 5}
    model = make_forecaster("lightgbm-trajectory", prefill_offset="blend", **settings).fit(data)
    weights = model.offset_weights_
    assert all(0.0 <= w <= 1.0 for w in weights["prefill_tokens"])
    assert weights["prefill_tokens"] != [1.0, 1.0]  # recent demand carries weight
    assert all(weights[t] == [1.0, 1.0] for t in TARGETS[1:])
    model.save(tmp_path / "m")
    loaded = load_forecaster(tmp_path / "m")
    assert loaded.prefill_offset == "blend" and loaded.offset_weights_ == weights
    manifest = tmp_path / "m" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["state"]["offset_weights"] = {}
    manifest.write_text(json.dumps(text))
    with pytest.raises(InputError, match="prefill_offset 'blend': the model needs"):
        load_forecaster(tmp_path / "m")


def test_calibration_splits_the_prefill_lag_into_later_and_first_turns():
    """A sync launch queues every first prompt at once: the calibration sees it apart from
    the later turns' prompts, so the trees can tell the burst from steady demand."""
    from prorsa.forecast.trajectory import LAG_FEATURES

    data = build_dataset([_telemetry(2, 80, s, f"r{s}") for s in range(2)], horizons=[5])
    model = make_forecaster(
        "lightgbm-trajectory", horizons=[5], n_estimators=5, calibration_estimators=1
    )
    model.fit(data).set_drift_check(False)
    _feed(model, _telemetry(2, 80, 9, "held-out"), 3.0)
    tracker = model.tracker_
    scale = float(max(tracker.peak_live, 1))
    sums = model.bottom_up_now((5.0,))
    row = model._calibration_rows(model.current_features()[None, :], sums[None], scale, (5.0,))
    lag = row[0, -1 - len(LAG_FEATURES) : -1]
    total = tracker.observed_sum("cum_prefill", 5.0) / scale
    first = tracker.observed_sum("cum_first_prefill", 5.0) / scale
    assert first > 0 and total > first  # every trajectory's first prompt is in the window
    assert lag[LAG_FEATURES.index("lag_first_prefill")] == pytest.approx(first)
    assert lag[LAG_FEATURES.index("lag_later_prefill")] == pytest.approx(total - first)


def test_blend_weights_never_see_the_runs_the_conformal_shifts_are_measured_on():
    import dataclasses

    from prorsa.forecast.conformal import held_out_runs
    from prorsa.forecast.types import target_column

    data = build_dataset([_telemetry(2, 60, s, f"r{s}") for s in range(5)], horizons=[5])
    settings = {"horizons": [5], "n_estimators": 5, "calibration_estimators": 1}
    held = held_out_runs(data.runs, 0.2, seed=0)
    assert held and len(held) < len(data.runs)
    ticks = data.ticks.copy()
    rows = ticks["run_id"].isin(held)
    for target in TARGETS[1:]:
        ticks.loc[rows, target_column(target, 5)] *= 7.0  # only the held-out runs move
    moved = dataclasses.replace(data, ticks=ticks)
    weights = [
        make_forecaster("lightgbm-trajectory", decode_offset="blend", **settings)
        .fit(d)
        .offset_weights_
        for d in (data, moved)
    ]
    assert weights[0] == weights[1]


def test_a_dataset_of_other_features_is_refused_before_training():
    # Found by review: models read features by position, so a dataset built before a
    # feature changed would train on the wrong columns.
    import dataclasses

    data = build_dataset([_telemetry(2, 40, 0, "r0")], horizons=[5])
    names = data.feature_names
    old = {**data.meta, "feature_names": [n.replace("cohort_age_s", "time_s") for n in names]}
    stale = dataclasses.replace(
        data, ticks=data.ticks.rename(columns={"cohort_age_s": "time_s"}), meta=old
    )
    with pytest.raises(InputError, match="not this version's") as err:
        make_forecaster("lightgbm-aggregate", horizons=[5]).fit(stale)
    assert "cohort_age_s" in str(err.value) and err.value.field == "feature_names"
