"""Parameters are checked where they enter: unknown or mistyped values fail at once."""

from __future__ import annotations

import inspect
import math

import pytest

from prorsa.errors import ConfigError
from prorsa.policy import POLICIES
from prorsa.policy.params import (
    MIN_INTERVAL_S,
    check_count,
    check_interval_s,
    check_policy_param_groups,
    check_policy_params,
    check_storage_url,
    check_tracking_uri,
    policy_parameters,
)


def _constructor_defaults(cls) -> dict:
    return {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("name", POLICIES.names())
def test_every_policy_accepts_its_own_defaults(name):
    cls = POLICIES.get(name)
    defaults = _constructor_defaults(cls)
    assert check_policy_params(name, defaults).keys() == defaults.keys()
    assert set(policy_parameters(name)) == set(defaults)


@pytest.mark.parametrize("name", POLICIES.names())
def test_the_search_space_holds_every_policys_defaults(name):
    import optuna

    from prorsa.tune import default_trial_params

    cls = POLICIES.get(name)
    trial = optuna.create_study().ask()
    cls.search_space(trial)
    params = default_trial_params(name)
    # Every drawn parameter has a default, and the defaults lie in their ranges...
    assert set(params) == set(trial.params)
    for key, value in params.items():
        dist = trial.distributions[key]
        if isinstance(dist, optuna.distributions.CategoricalDistribution):
            assert value in dist.choices, key
        else:
            assert dist.low <= value <= dist.high, key
    # ...and drawing them gives the constructor's defaults back.
    defaults = _constructor_defaults(cls)
    space = cls.search_space(optuna.trial.FixedTrial(params))
    assert space == {k: defaults[k] for k in space}


def test_unknown_parameter_names_the_closest_and_lists_all():
    with pytest.raises(ConfigError, match="policy 'static' has no parameter 'prefill_gpu'") as info:
        check_policy_params("static", {"prefill_gpu": 4})
    assert "did you mean 'prefill_gpus'?" in info.value.hint
    assert "prefill_fraction" in info.value.hint


def test_typo_in_the_policy_of_a_param_is_an_error():
    with pytest.raises(ConfigError, match="policy 'statc', which does not exist") as info:
        check_policy_param_groups({"statc": {"prefill_gpus": 4}})
    assert "did you mean 'static'?" in info.value.hint
    with pytest.raises(ConfigError, match="not among the policies run"):
        check_policy_param_groups({"mpc": {"max_step": 2}}, policies=["static", "threshold"])
    assert check_policy_param_groups({"static": {"prefill_gpus": 4}}, policies=["static"]) == {
        "static": {"prefill_gpus": 4}
    }


@pytest.mark.parametrize(
    ("policy", "params", "expected"),
    [
        ("static", {"prefill_gpus": "four"}, "an integer or null"),
        ("static", {"prefill_gpus": 2.5}, "an integer or null"),
        ("static", {"prefill_fraction": "nan"}, "a finite number"),
        ("static", {"prefill_fraction": math.nan}, "a finite number"),
        ("threshold", {"cooldown_s": True}, "a finite number"),
        ("rl", {"model": 3}, "text"),
        ("predictive", {"quantile": [0.9]}, "a finite number or null"),
    ],
)
def test_wrong_value_types_name_the_expected_type(policy, params, expected):
    with pytest.raises(ConfigError, match=expected):
        check_policy_params(policy, params)


def test_ints_are_widened_where_floats_are_declared():
    checked = check_policy_params("threshold", {"cooldown_s": 30, "prefill_fraction": 0.5})
    assert checked == {"cooldown_s": 30.0, "prefill_fraction": 0.5}
    assert type(checked["cooldown_s"]) is float
    assert check_policy_params("predictive", {"quantile": None}) == {"quantile": None}


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e-9, 0.0, -1.0, "1", None, True])
def test_intervals_must_be_finite_and_not_tiny(bad):
    with pytest.raises(ConfigError, match="interval_s"):
        check_interval_s(bad)


def test_interval_bounds():
    assert check_interval_s(MIN_INTERVAL_S) == MIN_INTERVAL_S
    assert check_interval_s(5) == 5.0


def test_counts():
    assert check_count(2, "workers") == 2
    for bad in (-1, 0, 1.5, True):
        with pytest.raises(ConfigError, match="workers"):
            check_count(bad, "workers")


def test_storage_urls(tmp_path):
    url = f"sqlite:///{tmp_path}/study.db"
    assert check_storage_url(url) == url
    for bad, reason in [
        (f"sqlite:///{tmp_path}/missing/study.db", "does not exist"),
        ("sqlite://", "names no database"),
        ("sqlite:///:memory:", "names no database"),
        ("study.db", "not a database"),
        ("redis://localhost/0", "not a database"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            check_storage_url(bad)
    assert check_storage_url("postgresql+psycopg2://u@host/db")


def test_tracking_uris(tmp_path):
    for ok in (str(tmp_path / "mlruns"), "file:///tmp/mlruns", "http://host:5000", "mlruns"):
        assert check_tracking_uri(ok) == ok
    with pytest.raises(ConfigError, match="unknown scheme 'htp'"):
        check_tracking_uri("htp://host")


def test_a_policy_without_parameters_says_so():
    with pytest.raises(ConfigError, match="policy 'colocate' has no parameter 'x'") as info:
        check_policy_params("colocate", {"x": 1})
    assert info.value.hint == "'colocate' takes no parameters"


def test_the_oracle_tunes_nothing_its_forecast_cannot_change():
    # The oracle forecast has no quantiles: MPC's quantile and band would be dead knobs.
    import optuna

    drawn = {}
    for name in ("mpc", "oracle"):
        trial = optuna.create_study().ask()
        POLICIES.get(name).search_space(trial)
        drawn[name] = set(trial.params)
    assert {"quantile", "robust"} <= drawn["mpc"]
    assert drawn["oracle"] == drawn["mpc"] - {"quantile", "robust"}
