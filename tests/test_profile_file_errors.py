"""A bad task-profile file is refused by file, record and field, never as a crash."""

from __future__ import annotations

import json

import pytest

from prorsa.errors import InputError
from prorsa.workload import get_scenario
from prorsa.workload.scenarios import datasets_dir, load_profile


def _good() -> dict:
    return get_scenario("swe").to_dict()


def _write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# Found by review: a list, a missing mixture part or a string where a number belongs
# crashed as an internal error, and other faults named neither file nor field.
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: [d], "JSON object"),
        (lambda d: {**d, "turns": {**d["turns"], "mu": "x"}}, "record turns, field 'mu'"),
        (lambda d: {**d, "turns": {**d["turns"], "mu": None}}, "record turns, field 'mu'"),
        (lambda d: {**d, "new_tokens": {**d["new_tokens"], "sigma_within": -1.0}},
         "record new_tokens"),
        (lambda d: {k: v for k, v in d.items() if k != "output_tokens"}, "field 'output_tokens'"),
        (lambda d: {**d, "tool_latency_s": {"sigma": 1.0}}, "record tool_latency_s, field 'mu'"),
        (lambda d: {**d, "turns": {**d["turns"], "spread": 1}}, "field 'spread'"),
        (lambda d: {**d, "group_rho": float("nan")}, "field 'group_rho'"),
        (lambda d: {**d, "group_rho": 2.0}, "group_rho"),
        (lambda d: {**d, "name": 7}, "field 'name'"),
    ],
)  # fmt: skip
def test_a_bad_task_profile_names_its_file_and_field(tmp_path, change, expected):
    path = _write(tmp_path, change(_good()))
    with pytest.raises(InputError) as error:
        load_profile(path)
    assert str(path) in str(error.value) and expected in str(error.value)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"kind": "mixture", "name": "m"}, "field 'components'"),
        ({"kind": "mixture", "name": "m", "components": [{"profile": "swe", "weight": "x"}]},
         "record components[0], field 'weight'"),
        ({"kind": "mixture", "name": "m", "components": [{"profile": "swe", "weight": 0}]},
         "field 'weight'"),
        ({"kind": "mixture", "name": "m", "components": [{"weight": 1.0}]}, "field 'profile'"),
        ({"kind": "mixture", "name": "m", "components": [{"profile": "mixed", "weight": 1}]},
         "another mixture"),
    ],
)  # fmt: skip
def test_a_bad_mixture_names_its_component(tmp_path, data, expected):
    path = _write(tmp_path, data)
    with pytest.raises(InputError) as error:
        load_profile(path)
    assert str(path) in str(error.value) and expected in str(error.value)


def test_unreadable_bytes_name_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(InputError, match=r"p\.json"):
        load_profile(path)


def test_every_shipped_profile_still_loads():
    for path in sorted((datasets_dir() / "workloads").glob("*.json")):
        assert load_profile(path).name
