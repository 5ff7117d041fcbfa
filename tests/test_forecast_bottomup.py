"""The compiled bottom-up kernel computes what the numpy path does."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_ndtr, ndtri

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
    tools, tools far into their tail, near-empty turns, tool times not yet known (NaN)
    and outputs never seen (NaN)."""
    rng = np.random.default_rng(seed)
    mu_tool = rng.normal(0.5, 1.5, n)
    sd_tool = rng.uniform(0.0, 2.0, n)
    tool_elapsed = rng.exponential(5.0, n)
    far = rng.random(n) < 0.05  # 5 to 8 standard deviations into the tool's tail
    tool_elapsed[far] = np.exp(mu_tool[far] + rng.uniform(5, 8, far.sum()) * sd_tool[far])
    tool_elapsed[rng.random(n) < 0.02] = -0.01  # clamped to 0 on both paths
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
        wait=rng.exponential(1.0, n),
        decoded=decoded,
        tool_elapsed=tool_elapsed,
        out_last=out_last,
        mu_out=mu_out,
        sd_out=rng.uniform(0.0, 2.0, n),
        q_cont=rng.random(n),
        p_instant=p_instant,
        mu_tool=mu_tool,
        sd_tool=sd_tool,
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
    usual = live.decoded < 1e5
    np.testing.assert_allclose(compiled[usual], reference[usual], rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_tool_far_into_its_tail_still_ends_within_the_horizon(monkeypatch, compiled):
    # P(T <= e + h | T > e) for a log-normal tool e seconds in, 5 to 8 sd into its tail:
    # both tails are below any floor, their ratio is not (it is near 1 there).
    monkeypatch.setattr(bottomup, "COMPILED", compiled)
    n = 4
    z = np.array([5.0, 6.0, 7.0, 8.0])
    mu, sd = np.zeros(n), np.full(n, 0.3)
    elapsed = np.exp(mu + z * sd) - bottomup.TOOL_SHIFT_S
    live = random_live(n, 0)
    for name, value in (("state", np.full(n, IN_TOOL)), ("tool_elapsed", elapsed),
                        ("mu_tool", mu), ("sd_tool", sd), ("q_cont", np.zeros(n)),
                        ("mu_next", np.full(n, 6.0)), ("sd_next", np.full(n, 0.1))):  # fmt: skip
        setattr(live, name, value)
    terms = bottomup.bottom_up(live, HORIZONS)
    size = bottomup.expected_size(live.mu_next, live.sd_next)

    def log_tail(x):  # log P(T > x)
        return log_ndtr(-(np.log(x + bottomup.TOOL_SHIFT_S) - mu[:, None]) / sd[:, None])

    exact = -np.expm1(log_tail(elapsed[:, None] + HORIZONS) - log_tail(elapsed[:, None]))
    np.testing.assert_allclose(terms[:, 0, :], exact * size[:, None], rtol=2e-3)
    assert (exact[:, -1] > 0.5).all()


def test_kernel_rows_do_not_depend_on_their_neighbours():
    # The overlapped tick sums rows in two groups and must equal the sum of all at once.
    live = random_live(2_000, 7)
    whole = bottomup.bottom_up(live, HORIZONS)
    rows = np.arange(0, 2_000, 3)
    part = Live(**{k: np.asarray(v)[rows] for k, v in vars(live).items()})
    np.testing.assert_array_equal(bottomup.bottom_up(part, HORIZONS), whole[rows])


@pytest.mark.parametrize("compiled", [True, False])
def test_shared_work_gives_the_same_terms_whichever_threads_take_which_rows(monkeypatch, compiled):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(bottomup, "COMPILED", compiled)
    monkeypatch.setattr(bottomup_kernel, "CHUNK_ROWS", 7)  # many chunks, a short last one
    live = random_live(2_000, 11)
    alone = bottomup.shared_bottom_up(live, HORIZONS)
    alone.run()
    shared = bottomup.shared_bottom_up(live, HORIZONS)
    with ThreadPoolExecutor(3) as pool:
        for job in [pool.submit(shared.run) for _ in range(3)]:
            job.result()
    shared.run()  # nothing left to claim: a no-op
    assert alone.out.shape == (2_000, 4, len(HORIZONS))
    np.testing.assert_array_equal(shared.out, alone.out)
    np.testing.assert_array_equal(alone.out, bottomup.bottom_up(live, HORIZONS))


def test_parts_with_rewritten_rows_give_the_terms_of_the_rewritten_state(monkeypatch):
    # The overlapped tick builds every row once, runs the scored rows, then rewrites the
    # new turns' scores and runs those: the terms must be those of the final state.
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(bottomup, "COMPILED", True)
    monkeypatch.setattr(bottomup_kernel, "CHUNK_ROWS", 7)
    before, after = random_live(2_000, 13), random_live(2_000, 13)
    late = np.arange(5, 2_000, 4)
    scored = {"mu_out": 1.0, "q_cont": 0.3, "p_instant": 0.1, "mu_tool": -1.0, "mu_next": 7.0}
    for name, value in scored.items():
        getattr(after, name)[late] = value
    work = bottomup.shared_bottom_up(before, HORIZONS)
    first = work.part(np.setdiff1d(np.arange(2_000), late))
    with ThreadPoolExecutor(2) as pool:
        for job in [pool.submit(first.run) for _ in range(2)]:
            job.result()
        work.set_rows(late, {name: getattr(after, name)[late] for name in scored})
        second = work.part(late)
        for job in [pool.submit(second.run) for _ in range(2)]:
            job.result()
    expected = bottomup.bottom_up(after, HORIZONS)
    np.testing.assert_array_equal(work.out, expected)
    assert not np.array_equal(expected[late], bottomup.bottom_up(before, HORIZONS)[late])


def test_inverse_normal_cdf_matches_scipy():
    low = np.logspace(-300, -1, 400)
    p = np.concatenate([low, np.linspace(0.01, 0.99, 400), 1.0 - np.logspace(-15, -1, 200)])
    ours = np.array([bottomup_kernel._ndtri(float(x)) for x in p])
    np.testing.assert_allclose(ours, ndtri(p), rtol=1e-13, atol=1e-13)


def test_a_queued_turn_waits_for_the_turns_queued_before_it():
    """Six rows: four waiting (one queued 3 s ago, three just now), one decoding, one in
    a tool. At 2 turns/s the three new ones wait 0.5, 1 and 1.5 s for the queue ahead;
    the recent queue-to-decode time (0.8 s) is the floor."""
    state = np.array([QUEUED, PREFILLING, QUEUED, DECODING, IN_TOOL, QUEUED])
    is_open = np.array([False, False, False, True, False, False])
    since = np.array([3.0, 0.0, 0.0, 0.4, 0.0, 0.0])
    waits = bottomup.decode_waits(state, is_open, since, 0.8, 2.0)
    np.testing.assert_allclose(waits, [0.0, 0.8, 1.0, 0.0, 0.0, 1.5])
    # An unknown rate leaves only the queue-to-decode term.
    unknown = bottomup.decode_waits(state, is_open, since, 0.8, np.nan)
    np.testing.assert_allclose(unknown, [0.0, 0.8, 0.8, 0.0, 0.0, 0.8])
    # Stacked ticks rank their queues apart: the same rows twice give the same waits.
    twice = bottomup.decode_waits(
        np.r_[state, state], np.r_[is_open, is_open], np.r_[since, since], 0.8, 2.0,
        tick=np.repeat([0, 1], len(state)),
    )  # fmt: skip
    np.testing.assert_allclose(twice, np.r_[waits, waits])
