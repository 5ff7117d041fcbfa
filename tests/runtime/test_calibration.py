"""Calibration fits: the KV link line and the mixed-step base from measured samples."""

from __future__ import annotations

import pytest

from prorsa.runtime.cluster import telemetry as ev
from prorsa.runtime.ray.calibration import fit_transfer, mixed_overhead, tokens
from prorsa.telemetry.columns import EventLog
from tests.sim_helpers import profile


def test_fit_transfer_recovers_base_and_bandwidth_despite_a_handshake():
    log = EventLog("calib")
    base_s, s_per_token = 0.01, 2e-5
    for i, ctx in enumerate(range(100, 1100, 50)):
        key = log.key(f"t{i}")
        t0 = float(i)
        span = base_s + ctx * s_per_token + (1.0 if i == 0 else 0.0)  # first: NIXL handshake
        for kind, at in (
            (ev.TRAJ_START, t0),
            (ev.PREFILL_QUEUED, t0),
            (ev.PREFILL_START, t0),
            (ev.PREFILL_END, t0 + 0.1),
            (ev.KV_TRANSFER_START, t0 + 0.1),
            (ev.KV_TRANSFER_END, t0 + 0.1 + span),
            (ev.DECODE_START, t0 + 0.1 + span),
        ):
            log.append(at, key, 0, kind, 0, ctx, ctx if kind == ev.PREFILL_START else 0)
        log.append(t0 + 0.5, key, 0, ev.DECODE_END, 1, ctx, 0, 0, 4)
        log.append(t0 + 0.5, key, 0, ev.TRAJ_END)
    kv_bytes = 1024
    fitted_base, gbytes_per_s = fit_transfer(log.to_table(), kv_bytes)
    # A least-squares line would put the base near 0.06 s (the handshake averaged in).
    assert fitted_base == pytest.approx(base_s, rel=0.3)
    assert gbytes_per_s == pytest.approx(kv_bytes / s_per_token / 1e9, rel=0.3)


def test_mixed_overhead_is_the_median_residual():
    prof = profile()
    base = 0.004
    samples = []
    for b, s, n in ((4, 1000, 64), (8, 2000, 256), (16, 4000, 64)):
        modelled = (
            prof.prefill_per_token_s * n
            + prof.prefill_attn_s_per_token2 * n * (n / 2)
            + prof.decode_per_seq_s * b
            + prof.decode_per_ctx_token_s * s
        )
        samples.append((b, s, n, 0, modelled + base))
    assert mixed_overhead(prof, samples) == pytest.approx(base)


def test_tokens_are_reproducible_and_distinct_per_salt():
    assert tokens(32, 1) == tokens(32, 1)
    assert tokens(32, 1) != tokens(32, 2)
