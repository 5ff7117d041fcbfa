"""The provider adapter inside a simulation: online forecasts equal the offline backtest's."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.forecast import TARGETS, build_dataset, load_forecaster, make_forecaster
from prorsa.forecast.backtest import backtest
from prorsa.policy.base import Policy
from prorsa.policy.types import Allocation
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.forecast_provider import ForecastProvider, make_provider, resolve_forecaster
from prorsa.runtime.sim.drivers import SyncDriver
from prorsa.runtime.sim.simulation import Simulation
from tests.sim_helpers import profile, random_specs


class KeepAndRecord(Policy):
    """Keeps the cluster as it is and records every forecast it is given."""

    needs_forecast = True

    def __init__(self) -> None:
        self.seen: list = []

    def decide(self, obs, forecast):
        self.seen.append((obs.time_s, forecast))
        return Allocation(gpus={"colocated": obs.total_gpus}, reason="keep")


def _simulate(provider, *, record: bool = True, seed: int = 5):
    policy = KeepAndRecord()
    config = ClusterConfig(profile="test-tp1", num_slots=2)
    sim = Simulation(
        config,
        policy,
        SyncDriver([random_specs(20, seed=seed, turns=(2, 5))]),
        forecaster=provider,
        profiles={1: profile()},
        record=record,
        run_id="online",
    )
    return sim.run(), policy


def _fitted(name: str):
    if name == "kalman":
        return make_forecaster(name, horizons=[1, 5]).fit(None)
    other, _ = _simulate(make_provider("ewma", horizons=[1]), seed=11)
    data = build_dataset(other.telemetry, horizons=[1, 5])
    model = make_forecaster(name, horizons=[1, 5], n_estimators=5, calibration_estimators=5)
    return model.fit(data)


@pytest.mark.parametrize("name", ["kalman", "lightgbm-trajectory"])
def test_online_forecasts_match_the_offline_replay(name, tmp_path):
    forecaster = _fitted(name)
    folder = forecaster.save(tmp_path / name)
    result, policy = _simulate(ForecastProvider(forecaster))
    online = [(t, fc) for t, fc in policy.seen if fc is not None]
    assert len(online) >= 5
    offline = backtest(load_forecaster(folder), result.telemetry)
    compared = 0
    for t, fc in online:
        rows = offline[np.isclose(offline["cutoff"], t)]
        if rows.empty:
            continue  # the run's last tick can fall after its last event
        compared += 1
        for target in TARGETS:
            expect = rows[rows["target"] == target].sort_values("horizon_s")["forecast"]
            np.testing.assert_allclose(fc.point[target], expect.to_numpy(), rtol=1e-12)
    assert compared >= len(online) - 1


def test_provider_needs_telemetry():
    with pytest.raises(ConfigError, match="records no telemetry"):
        _simulate(make_provider("ewma"), record=False)


def test_oracle_reads_live_specs():
    _result, policy = _simulate(make_provider("oracle", horizons=[1, 5]))
    forecasts = [fc for _, fc in policy.seen if fc is not None]
    assert forecasts and all(fc.horizons_s == (1.0, 5.0) for fc in forecasts)
    assert sum(fc.point["decode_tokens"][1] for fc in forecasts) > 0


def test_resolving_names_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORSA_MODELS", str(tmp_path / "no-shipped-models"))
    assert resolve_forecaster("last-value").name == "last-value"
    with pytest.raises(ConfigError, match="must be trained first"):
        resolve_forecaster("lightgbm-aggregate")
    with pytest.raises(ConfigError, match="unknown forecaster or model folder"):
        resolve_forecaster(tmp_path / "nothing-here")
    model = make_forecaster("ewma", horizons=[2]).fit(None)
    model.save(tmp_path / "mine")
    provider = make_provider(tmp_path / "mine")
    assert provider.horizons == (2.0,)
    with pytest.raises(ConfigError, match="not fitted"):
        make_provider(tmp_path / "mine", horizons=[3])
    # A shipped model is found by name.
    model.save(tmp_path / "no-shipped-models" / "my-ewma")
    assert make_provider("my-ewma").horizons == (2.0,)


def test_policies_name_the_horizons_they_read():
    from prorsa.policy import make_policy

    fitted = (1.0, 2.0, 5.0, 10.0, 30.0)
    assert make_policy("predictive").forecast_horizons(fitted) == (5.0, 30.0)
    assert make_policy("predictive", horizon_s=2.0, payback_s=8.0).forecast_horizons(fitted) == (
        2.0,
        5.0,
    )
    assert make_policy("mpc").forecast_horizons(fitted) is None  # reads every horizon


def test_the_controller_forecasts_only_what_the_policy_reads_and_decides_the_same():
    """Narrowed to the policy's horizons, the shipped model gives the same decisions."""
    from prorsa.policy import make_policy
    from prorsa.workload import get_scenario

    runs = {}
    for keep in (False, True):
        provider = make_provider("lightgbm-trajectory")
        sim = Simulation(
            ClusterConfig(profile="h200-qwen2.5-7b-tp1", num_slots=8),
            make_policy("predictive", min_gain=0.0, start="split"),  # it switches at this load
            SyncDriver([get_scenario("swe").sample(512, seed=3, group_size=8)]),
            forecaster=provider,
            keep_forecasts=keep,
        )
        result = sim.run()
        decisions = [(d.time_s, d.gpus_target, d.switches) for d in sim.controller.decisions]
        runs[keep] = (provider.horizons, decisions, result.metrics["makespan_s"])
    assert runs[False][0] == (5.0, 30.0)
    assert runs[True][0] == (1.0, 2.0, 5.0, 10.0, 30.0)
    assert sum(len(switches) for *_, switches in runs[False][1]) > 0
    assert runs[False][1:] == runs[True][1:]
