"""The compiled bottom-up kernel computes what the numpy path does."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import ndtri

from prorsa.forecast import bottomup, bottomup_kernel
from prorsa.forecast.bottomup import Live
from prorsa.forecast.tracker import DECODING, IN_TOOL, PREFILLING, QUEUED, TRANSFERRING

pytestmark = pytest.mark.skipif(not bottomup_kernel.AVAILABLE, reason="numba not installed")

HORIZONS = np.array([1.0, 5.0, 30.0])
#: Every state the sum distinguishes, and one it leaves out (ended: code 99).
STATES = np.array([QUEUED, PREFILLING, TRANSFERRING, DECODING, IN_TOOL, 99])


def random_live(n: int, seed: int) -> Live:
    """Live states over the ranges the per-turn models produce, with the edges the
    formulas guard: nothing decoded yet, decodes far past the expected length, instant
    tools, near-empty turns, tool times not yet known (NaN) and outputs never seen
    (NaN)."""
    rng = np.random.default_rng(seed)
    tool_elapsed = rng.exponential(5.0, n)
    tool_elapsed[rng.random(n) < 0.1] = np.nan
    out_last = rng.exponential(300.0, n)
    out_last[rng.random(n) < 0.1] = np.nan
    decoded = rng.exponential(200.0, n)
    decoded[rng.random(n) < 0.2] = 0.0
    decoded[rng.random(n) < 0.05] = 1e5  # far beyond exp(mu + 3 sd)
    p_instant = rng.random(n)
    p_instant[rng.random(n) < 0.1] = 1.0
    mu_out = rng.normal(5.0, 1.5, n)
    mu_out[rng.random(n) < 0.05] = -3.0  # cycles shorter than the fluid limit's floor
    return Live(
        state=rng.choice(STATES, n),
        open=rng.random(n) < 0.7,
        ctx=rng.uniform(0.0, 30_000.0, n),
        since_queued=rng.exponential(1.0, n),
        decoded=decoded,
        tool_elapsed=tool_elapsed,
        out_last=out_last,
        mu_out=mu_out,
        sd_out=rng.uniform(0.0, 2.0, n),
        q_cont=rng.random(n),
        p_instant=p_instant,
        mu_tool=rng.normal(0.5, 1.5, n),
        sd_tool=rng.uniform(0.0, 2.0, n),
        mu_next=rng.normal(5.0, 1.5, n),
        sd_next=rng.uniform(0.0, 1.5, n),
        rate=np.full(n, rng.uniform(10.0, 100.0)),
        ttft=np.full(n, (0.02, 0.5, 1.5, 3.0)[seed % 4]),
    )


@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_the_numpy_path(monkeypatch, seed):
    live = random_live(5_000, seed)
    monkeypatch.setattr(bottomup, "COMPILED", False)
    reference = bottomup.bottom_up(live, HORIZONS)
    monkeypatch.setattr(bottomup, "COMPILED", True)
    compiled = bottomup.bottom_up(live, HORIZONS)
    assert compiled.shape == reference.shape == (5_000, 4, len(HORIZONS))
    assert np.isfinite(compiled).all()
    ended = live.state == 99
    assert not compiled[ended].any()
    # The numpy path works in float32: rows agree to its rounding (up to ~0.4% of a
    # target's scale for decodes 10^5 tokens past their expected length, where float32
    # cancels in E[min(X - d, c) | X > d]), sums closer still.
    scale = np.abs(reference).max(axis=0, keepdims=True) + 1e-6
    np.testing.assert_allclose(compiled / scale, reference / scale, atol=5e-3)
    np.testing.assert_allclose(compiled.sum(axis=0), reference.sum(axis=0), rtol=1e-4)


def test_kernel_rows_do_not_depend_on_their_neighbours():
    # The overlapped tick sums rows in two groups and must equal the sum of all at once.
    live = random_live(2_000, 7)
    whole = bottomup.bottom_up(live, HORIZONS)
    rows = np.arange(0, 2_000, 3)
    part = Live(**{k: np.asarray(v)[rows] for k, v in vars(live).items()})
    np.testing.assert_array_equal(bottomup.bottom_up(part, HORIZONS), whole[rows])


def test_inverse_normal_cdf_matches_scipy():
    low = np.logspace(-300, -1, 400)
    p = np.concatenate([low, np.linspace(0.01, 0.99, 400), 1.0 - np.logspace(-15, -1, 200)])
    ours = np.array([bottomup_kernel._ndtri(float(x)) for x in p])
    np.testing.assert_allclose(ours, ndtri(p), rtol=1e-13, atol=1e-13)
