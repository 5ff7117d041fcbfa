"""fit_from_timings recovers known coefficients from noisy synthetic samples."""

from __future__ import annotations

import numpy as np
import pytest

from prorsa.errors import InputError
from prorsa.runtime.sim.cost import fit_from_timings


def test_recovers_coefficients_from_noisy_samples():
    rng = np.random.default_rng(7)
    a, b, c2 = 0.010, 2e-4, 3e-9
    da, db, dc = 0.020, 5e-4, 4e-8
    n = rng.integers(16, 4096, 300)
    c = rng.integers(0, 20000, 300)
    pre = a + b * n + c2 * n * (c + n / 2)
    prefill = np.column_stack([n, c, pre * rng.normal(1, 0.02, 300)])
    bs = rng.integers(1, 64, 300)
    s = bs * rng.integers(100, 8000, 300)
    dec = da + db * bs + dc * s
    decode = np.column_stack([bs, s, dec * rng.normal(1, 0.02, 300)])
    p = fit_from_timings(
        "cpu-tiny",
        "tiny",
        "cpu",
        1,
        prefill.tolist(),
        decode.tolist(),
        kv_bytes_per_token=4096,
        kv_capacity_tokens=200_000,
        max_batch=64,
        max_step_tokens=2048,
    )
    assert p.source == "timings"
    assert p.prefill_base_s == pytest.approx(a, rel=0.15)
    assert p.prefill_per_token_s == pytest.approx(b, rel=0.05)
    assert p.prefill_attn_s_per_token2 == pytest.approx(c2, rel=0.1)
    assert p.decode_base_s == pytest.approx(da, rel=0.1)
    assert p.decode_per_seq_s == pytest.approx(db, rel=0.1)
    assert p.decode_per_ctx_token_s == pytest.approx(dc, rel=0.05)
    for part in ("prefill_fit", "decode_fit"):
        stats = p.provenance[part]
        assert stats["n_samples"] == 300
        assert stats["r2"] > 0.99
        assert stats["mape"] < 0.03
    assert p.mixed_overhead_s == pytest.approx(max(p.prefill_base_s, p.decode_base_s))


def test_bad_samples_name_the_record():
    with pytest.raises(InputError, match="record 1"):
        fit_from_timings(
            "x",
            "m",
            "cpu",
            1,
            [(10, 0, 0.1), (20, 0, -0.2), (30, 0, 0.3)],
            [(1, 10, 0.01)] * 3,
            kv_bytes_per_token=1,
            kv_capacity_tokens=1,
            max_batch=1,
            max_step_tokens=1,
        )
