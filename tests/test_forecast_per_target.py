"""The per-target composite: each target is its member's forecast, members share one
tracker, the choice follows validation scores, and a saved composite checks its members."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prorsa.errors import ConfigError, InputError
from prorsa.forecast import TARGETS, build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.per_target import (
    DEFAULT_MEMBERS,
    PerTargetForecaster,
    choose_members,
    compose_shipped,
)
from prorsa.runtime.forecast_provider import models_dir
from tests.test_forecast_conformance import FAST, HORIZONS, _stream, _telemetry

MIXED = {
    "prefill_tokens": "lightgbm-aggregate",
    "decode_tokens": "lightgbm-trajectory",
    "decode_sequences": "lightgbm-trajectory",
    "decode_kv_tokens": "lightgbm-aggregate",
}


@pytest.fixture(scope="module")
def data():
    train = build_dataset([_telemetry(0, "a"), _telemetry(1, "b")], horizons=HORIZONS)
    return train, _telemetry(2, "c")


def _member(name, train):
    return make_forecaster(name, horizons=HORIZONS, seed=7, **FAST[name]).fit(train)


def test_each_target_is_its_members_own_forecast_from_one_shared_tracker(data):
    train, events = data
    agg, traj = _member("lightgbm-aggregate", train), _member("lightgbm-trajectory", train)
    composite = PerTargetForecaster.from_members(
        {t: agg if name == "lightgbm-aggregate" else traj for t, name in MIXED.items()}
    ).set_drift_check(False)
    together = _stream(composite, events)
    assert agg.tracker_ is composite.tracker_ and traj.tracker_ is composite.tracker_

    # The same members (same seed: the same models) on their own, each with its tracker.
    alone = {
        name: _stream(_member(name, train).set_drift_check(False), events)
        for name in set(MIXED.values())
    }
    for tick, fc in enumerate(together):
        for target, name in MIXED.items():
            own = alone[name][tick]
            np.testing.assert_array_equal(fc.point[target], own.point[target])
            for q in own.quantiles:
                np.testing.assert_array_equal(fc.quantiles[q][target], own.quantiles[q][target])
    # A composite is not its default: prefill here differs from trajectory's own.
    trajectory_own = alone["lightgbm-trajectory"][-1].point["prefill_tokens"]
    assert not np.array_equal(together[-1].point["prefill_tokens"], trajectory_own)


def test_members_run_only_the_models_of_the_targets_they_serve(data, monkeypatch):
    from prorsa.forecast import lgbm

    train, events = data
    agg, traj = _member("lightgbm-aggregate", train), _member("lightgbm-trajectory", train)
    composite = PerTargetForecaster.from_members(
        {t: agg if name == "lightgbm-aggregate" else traj for t, name in MIXED.items()}
    ).set_drift_check(False)
    name_of = {id(b): key for m in (agg, traj) for key, b in m.boosters_.items()}
    called: set[str] = set()
    real = lgbm.predict

    def spy(booster, x, *args, **kwargs):
        called.add(name_of.get(id(booster), "?"))
        return real(booster, x, *args, **kwargs)

    monkeypatch.setattr(lgbm, "predict", spy)
    _stream(composite, events, ticks=3)
    # Aggregate boosters are "<target>:<loss>", trajectory's calibration "cal:<target>:<loss>".
    tick_models = {k for k in called if k.count(":") >= 1 and k.split(":")[-2] in TARGETS}
    served = {(k.startswith("cal:"), k.split(":")[-2]) for k in tick_models}
    expected = {(name == "lightgbm-trajectory", t) for t, name in MIXED.items()}
    assert served == expected
    # The restriction holds for the composite's calls only: the members are the caller's.
    assert agg.targets_read is None and traj.targets_read is None
    alone = agg.predict()
    assert all(np.any(alone.point[t] > 0) for t in TARGETS)


def test_the_composite_alone_checks_drift_and_falls_back_for_every_target(data):
    train, events = data
    composite = make_forecaster("per-target", horizons=HORIZONS, seed=7, **FAST["per-target"]).fit(
        train
    )
    name = next(iter(composite.feature_ranges_))
    composite.feature_ranges_ = {name: (-2.0, -1.0)}  # nothing live is ever in it
    fc = _stream(composite, events, ticks=3)[-1]
    assert fc.fallback == "last-value" and fc.drift == (name,)
    assert not any(m._check_drift for m in composite.members_.values())


def test_members_are_chosen_by_their_validation_scores(data):
    train, _ = data
    agg, traj = _member("lightgbm-aggregate", train), _member("lightgbm-trajectory", train)
    for i, target in enumerate(TARGETS):
        agg.metrics_[f"validation_wape_{target}_h5"] = 0.2 + 0.1 * (i % 2)
        traj.metrics_[f"validation_wape_{target}_h5"] = 0.25
    chosen = choose_members([traj, agg])
    assert {t: m.name for t, m in chosen.items()} == {
        t: "lightgbm-aggregate" if i % 2 == 0 else "lightgbm-trajectory"
        for i, t in enumerate(TARGETS)
    }
    del agg.metrics_["validation_wape_decode_tokens_h5"]
    del traj.metrics_["validation_wape_decode_tokens_h5"]
    with pytest.raises(ConfigError, match="validation_wape_decode_tokens_h5"):
        choose_members([traj, agg])


def test_members_that_cannot_share_a_tracker_are_refused(data):
    train, _ = data
    agg = _member("lightgbm-aggregate", train)
    other = make_forecaster(
        "lightgbm-trajectory", horizons=(1.0, 5.0), seed=7, **FAST["lightgbm-trajectory"]
    ).fit(build_dataset([_telemetry(0, "a"), _telemetry(1, "b")], horizons=(1.0, 5.0)))
    with pytest.raises(ConfigError, match="differ in horizons"):
        PerTargetForecaster.from_members(
            {t: agg if n == "lightgbm-aggregate" else other for t, n in MIXED.items()}
        )


@pytest.mark.parametrize(
    ("members", "member_params", "message"),
    [
        ({"prefill_tokens": "lightgbm-aggregate"}, None, "missing"),
        ({**MIXED, "tokens": "ewma"}, None, "unknown target"),
        ({**MIXED, "decode_tokens": "nope"}, None, "registered forecaster"),
        ({**MIXED, "decode_tokens": "per-target"}, None, "other than"),
        ({**MIXED, "decode_tokens": "oracle"}, None, "shown the future"),
        (MIXED, {"gru": {"epochs": 1}}, "serve no target"),
    ],
)
def test_bad_members_are_refused_with_what_is_wrong(data, members, member_params, message):
    train, _ = data
    model = PerTargetForecaster(horizons=HORIZONS, members=members, member_params=member_params)
    with pytest.raises(ConfigError, match=message):
        model.fit(train)


def test_a_saved_composite_names_the_damaged_member(data, tmp_path):
    train, _ = data
    model = make_forecaster("per-target", horizons=HORIZONS, seed=7, **FAST["per-target"])
    folder = model.fit(train).save(tmp_path / "pt")
    assert (folder / "lightgbm-trajectory" / "manifest.json").is_file()
    load_forecaster(folder)  # intact

    # A member's manifest edited: the composite's manifest pins it.
    manifest = folder / "lightgbm-aggregate" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"seed": 7', '"seed": 8'))
    with pytest.raises(InputError, match="lightgbm-aggregate") as info:
        load_forecaster(folder)
    assert "files.lightgbm-aggregate" in str(info.value)
    manifest.write_text(text)

    # A member's weights damaged: the member's own manifest names the file.
    boosters = folder / "lightgbm-trajectory" / "boosters.json.gz"
    boosters.write_bytes(boosters.read_bytes()[:100])
    with pytest.raises(InputError, match=r"boosters\.json\.gz"):
        load_forecaster(folder)


def test_saving_twice_into_one_folder_replaces_the_members(data, tmp_path):
    train, events = data
    model = make_forecaster("per-target", horizons=HORIZONS, seed=7, **FAST["per-target"])
    model.set_drift_check(False).fit(train)
    model.save(tmp_path / "pt")
    folder = model.save(tmp_path / "pt")
    loaded = load_forecaster(folder).set_drift_check(False)
    a, b = _stream(model, events, ticks=4)[-1], _stream(loaded, events, ticks=4)[-1]
    for target in TARGETS:
        np.testing.assert_array_equal(a.point[target], b.point[target])


def test_composing_the_shipped_models_follows_their_manifests(tmp_path):
    path, choice = compose_shipped(models_dir(), out=tmp_path / "per-target")
    manifests = {
        name: json.loads((models_dir() / name / "manifest.json").read_text())["metrics"]
        for name in ("lightgbm-trajectory", "lightgbm-aggregate")
    }
    for target in TARGETS:
        key = f"validation_wape_{target}_h5"
        best = min(manifests, key=lambda n: (manifests[n][key], n != "lightgbm-trajectory"))
        assert choice[target]["member"] == best
    loaded = load_forecaster(path)
    assert loaded.member_of() == {t: c["member"] for t, c in choice.items()}
    assert json.loads((path / "manifest.json").read_text())["chosen_by"]["targets"] == choice


def test_the_default_members_are_the_shipped_composites():
    # A per-target built by name (no folder) must serve each target from the member the
    # shipped composite chose on validation, not from an older choice.
    shipped = json.loads((models_dir() / "per-target" / "manifest.json").read_text())
    chosen = {t: c["member"] for t, c in shipped["chosen_by"]["targets"].items()}
    assert chosen == DEFAULT_MEMBERS
