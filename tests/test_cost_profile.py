"""CostProfile formulas, validation and serialisation."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost import CostProfile


def make(**over) -> CostProfile:
    base = dict(
        name="t",
        model="m",
        hardware="h",
        tp=1,
        prefill_base_s=0.002,
        prefill_per_token_s=1e-5,
        prefill_attn_s_per_token2=1e-9,
        decode_base_s=0.004,
        decode_per_seq_s=1e-5,
        decode_per_ctx_token_s=2e-8,
        decode_floor_s=0.0045,
        mixed_overhead_s=0.005,
        kv_bytes_per_token=131072,
        kv_capacity_tokens=100_000,
        source="roofline",
    )
    base.update(over)
    return CostProfile(**base)


def test_prefill_formula_scalar_and_array():
    p = make()
    n, c = 1000, 500
    expected = 0.002 + 1e-5 * n + 1e-9 * n * (c + n / 2)
    assert p.prefill_time_s(n, c) == pytest.approx(expected)
    assert isinstance(p.prefill_time_s(n, c), float)
    arr = p.prefill_time_s(np.array([0, 1000, 2000]), np.array([0, 500, 0]))
    assert arr.shape == (3,)
    assert arr[0] == 0.0
    assert arr[1] == pytest.approx(expected)
    assert arr[2] == pytest.approx(0.002 + 1e-5 * 2000 + 1e-9 * 2000 * 1000)


def test_decode_formula_floor_and_broadcast():
    p = make()
    assert p.decode_step_time_s(1, 10) == pytest.approx(0.0045)  # floor wins
    b, s = 64, 64 * 2048
    assert p.decode_step_time_s(b, s) == pytest.approx(0.004 + 1e-5 * b + 2e-8 * s)
    assert p.decode_step_time_s(0, 0) == 0.0
    grid = p.decode_step_time_s(np.array([[1], [64]]), np.array([10, 64 * 2048]))
    assert grid.shape == (2, 2)
    assert grid[1, 1] == pytest.approx(p.decode_step_time_s(b, s))


def test_decode_run_time_matches_step_sum():
    p = make(decode_floor_s=0.0062)
    batch, ctx, steps = 8, 8 * 5000, 500
    total = sum(p.decode_step_time_s(batch, ctx + j * batch) for j in range(steps))
    assert p.decode_run_time_s(batch, ctx, steps) == pytest.approx(total, rel=1e-9)
    assert p.decode_run_time_s(batch, ctx, 0) == 0.0


def test_mixed_step_replaces_bases_and_floors_whole_step():
    p = make()
    n, c, b, s = 512, 1000, 32, 32 * 4000
    expected = 0.005 + 1e-5 * n + 1e-9 * n * (c + n / 2) + 1e-5 * b + 2e-8 * s
    assert p.mixed_step_time_s(n, c, b, s) == pytest.approx(expected)
    assert p.mixed_step_time_s(0, 0, b, s) == pytest.approx(p.decode_step_time_s(b, s))
    assert p.mixed_step_time_s(n, c, 0, 0) == pytest.approx(p.prefill_time_s(n, c))
    tiny = make(mixed_overhead_s=0.0, decode_floor_s=0.5)
    assert tiny.mixed_step_time_s(1, 0, 1, 1) == 0.5


def test_kv_transfer_units_are_gigabytes_per_second():
    p = make(kv_bytes_per_token=1_000_000)  # 1 MB per token
    assert p.kv_transfer_time_s(1000, bandwidth_gbytes_per_s=10.0, base_s=0.001) == pytest.approx(
        0.001 + 1000 * 1e6 / 10e9
    )
    assert p.kv_transfer_time_s(0, 10.0, base_s=0.001) == 0.0
    with pytest.raises(ConfigError, match="bandwidth_gbytes_per_s"):
        p.kv_transfer_time_s(10, 0.0)


def test_negative_inputs_rejected():
    p = make()
    with pytest.raises(ValueError):
        p.prefill_time_s(-1)
    with pytest.raises(ValueError):
        p.decode_step_time_s(np.array([1, -2]), 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefill_per_token_s", -1e-6),
        ("decode_floor_s", float("nan")),
        ("tp", 0),
        ("kv_capacity_tokens", 0),
        ("kv_bytes_per_token", 0),
        ("max_batch", 0),
        ("source", "guess"),
        ("name", ""),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        make(**{field: value})


def test_round_trip_json(tmp_path):
    p = make(provenance={"note": "hand-made", "nested": {"x": 1}})
    path = p.save(tmp_path / "p.json")
    q = CostProfile.load(path)
    assert q == p
    assert q.provenance == p.provenance
    assert CostProfile.from_dict(p.to_dict()) == p


def test_from_dict_rejects_unknown_and_missing_fields():
    d = make().to_dict()
    with pytest.raises(ConfigError, match="unknown field 'bogus'"):
        CostProfile.from_dict({**d, "bogus": 1})
    d.pop("decode_floor_s")
    with pytest.raises(ConfigError, match="missing field 'decode_floor_s'"):
        CostProfile.from_dict(d)
