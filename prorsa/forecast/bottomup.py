"""Bottom-up demand: each live trajectory's expected contribution to every target, summed.

Per-trajectory models (see :mod:`prorsa.forecast.trajectory`) predict, when a turn
arrives, log-normal distributions of the turn's output tokens, of the tool time after it
(a mixture: instant with some probability, else log-normal) and of the next turn's new
tokens, and the probability that another turn follows. Here those distributions are
*conditioned on what has happened since* (tokens already decoded, seconds already spent in
the tool) and turned into expected contributions in closed form or by three-point
quadrature:

* a decoding sequence with ``d`` tokens done decodes ``min(O - d, r h)`` more tokens in the
  window (``r``: per-sequence decode rate), stays active ``min(O - d, r h) / r`` seconds
  and holds ``context + d + r tau`` KV tokens while it does;
* a turn waiting for prefill starts decoding after the recent time-to-first-token;
* a trajectory in a tool sends its next prefill when the tool ends
  (``P(T <= e + h | T > e)`` times the expected next size), then decodes its next turn
  (integrated over the tool's remaining time at three quantiles);
* a decoding trajectory that continues sends its next prefill after the rest of its decode
  (at three conditional quantiles of the remaining tokens) plus the tool time;
* turns beyond those are added as a fluid limit: a trajectory that keeps going makes
  about one more turn per mean cycle (time to first token + decode + tool).

New trajectories (not yet started) are not in the sum; the calibration stage on top of it
accounts for them. Everything is vectorised over trajectories x horizons.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.special import log_ndtr, ndtr, ndtri

from prorsa.forecast.tracker import DECODING, IN_TOOL, waiting_mask

if TYPE_CHECKING:
    from prorsa.forecast.bottomup_kernel import SharedRows

#: Use the compiled kernel (:mod:`prorsa.forecast.bottomup_kernel`): ``None`` until the
#: first sum imports it and finds whether numba works; tests set it to check both paths.
#: Imported on first use: numba costs ~0.15 s and ~60 MB, and everything that imports
#: the forecasters (the simulator, the CLI) would pay it.
COMPILED: bool | None = None


def use_kernel() -> bool:
    """Whether the compiled kernel computes the sums (importing it the first time)."""
    global COMPILED
    if COMPILED is None:
        from prorsa.forecast import bottomup_kernel

        COMPILED = bottomup_kernel.AVAILABLE
    return COMPILED


#: Tool calls shorter than this are "instant"; longer ones are log-normal in T + shift.
TOOL_SHIFT_S = 0.05
# Beyond this many standard deviations a trajectory is "running long": condition on the
# quantile there instead of extrapolating the log-normal's far tail.
_ZMAX = 3.0
_TINY = 1e-9
_NODES = np.array([1 / 6, 1 / 2, 5 / 6], np.float32)  # quadrature over the remaining tool time
_LOG_CAP = np.log(1e6)  # caps log-normal means with a very wide spread


@dataclass
class Live:
    """Per-trajectory inputs (arrays of one length) at one tick, or at many stacked."""

    state: np.ndarray
    open: np.ndarray
    ctx: np.ndarray
    wait: np.ndarray  # seconds until the current turn's decode starts (decode_waits)
    decoded: np.ndarray
    tool_elapsed: np.ndarray
    out_last: np.ndarray
    mu_out: np.ndarray
    sd_out: np.ndarray
    q_cont: np.ndarray
    p_instant: np.ndarray  # probability that the tool after this turn is instant
    mu_tool: np.ndarray  # log(T + shift) of a non-instant tool
    sd_tool: np.ndarray
    mu_next: np.ndarray
    sd_next: np.ndarray
    rate: np.ndarray  # per-sequence decode rate (tokens/s), per row
    ttft: np.ndarray  # recent queue-to-decode seconds, per row


def upper_tail(z: np.ndarray) -> np.ndarray:
    """``P(Z > z)`` for a standard normal Z, without the cancellation of ``1 - ndtr(z)``
    (the tail masses the conditioning divides by are often below float32's epsilon)."""
    return ndtr(-z)


def normal_between(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``P(a < Z <= b)`` for ``a <= b``, from whichever tail keeps its precision."""
    sign = np.where(a > 0, -1.0, 1.0).astype(np.result_type(a, b))
    return sign * (ndtr(sign * b) - ndtr(sign * a))


def truncated_moments(
    mu: np.ndarray, sd: np.ndarray, d: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``E[min(X - d, c) | X > d]`` and ``E[min(X - d, c)^2 | X > d]`` for X ~ LN(mu, sd).

    Broadcasts; ``d >= 0`` and ``c >= 0``.
    """
    sd = np.maximum(sd, 1e-3)
    d = np.minimum(np.maximum(d, _TINY), np.exp(mu + _ZMAX * sd))
    u = d + c
    ln_d, ln_u = np.log(d), np.log(np.maximum(u, _TINY))
    s_d = upper_tail((ln_d - mu) / sd)
    s_u = upper_tail((ln_u - mu) / sd)
    var = sd * sd
    m1 = np.exp(mu + var / 2) * normal_between((ln_d - mu - var) / sd, (ln_u - mu - var) / sd)
    m2 = np.exp(2 * mu + 2 * var) * normal_between(
        (ln_d - mu - 2 * var) / sd, (ln_u - mu - 2 * var) / sd
    )
    mass = s_d - s_u
    s_d = np.maximum(s_d, _TINY)
    first = (m1 - d * mass + c * s_u) / s_d
    second = (m2 - 2 * d * m1 + d * d * mass + c * c * s_u) / s_d
    first = np.clip(first, 0.0, c)
    second = np.clip(second, first * first, c * c)
    return first, second


def fast_ndtr(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF to within 2e-4 (tanh form, float32): ~10x cheaper than ``ndtr``.

    Only for unconditioned terms; conditioning divides by tail mass, where the exact
    function is kept.
    """
    z = np.asarray(z, np.float32)
    return np.float32(0.5) * (
        np.float32(1.0) + np.tanh(np.float32(0.7978846) * (z + np.float32(0.044715) * z * z * z))
    )


def fresh_moments(mu: np.ndarray, sd: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`truncated_moments` with ``d = 0`` (a decode not started yet), cheaply:
    ``E[min(X, c)]`` and ``E[min(X, c)^2]``."""
    sd = np.maximum(sd, 1e-3)
    var = sd * sd
    ln_c = np.log(np.maximum(c, _TINY))
    above = 1.0 - fast_ndtr((ln_c - mu) / sd)
    first = np.exp(mu + var / 2) * fast_ndtr((ln_c - mu - var) / sd) + c * above
    second = np.exp(2 * mu + 2 * var) * fast_ndtr((ln_c - mu - 2 * var) / sd) + c * c * above
    return np.minimum(first, c), np.minimum(second, c * c)


def conditional_quantiles(mu: np.ndarray, sd: np.ndarray, above: np.ndarray) -> np.ndarray:
    """X at the :data:`_NODES` quantiles of X ~ LN(mu, sd) given X > ``above`` (rows x 3)."""
    sd = np.maximum(sd, 1e-3)
    z = np.minimum((np.log(np.maximum(above, _TINY)) - mu) / sd, _ZMAX)
    f = ndtr(z)
    level = np.clip(f[:, None] + _NODES[None, :] * (1.0 - f)[:, None], 1e-6, 1 - 1e-6)
    return np.exp(mu[:, None] + sd[:, None] * ndtri(level).astype(mu.dtype))


def tool_cdf(
    p_instant: np.ndarray, mu: np.ndarray, sd: np.ndarray, x: np.ndarray, *, fast: bool = False
) -> np.ndarray:
    """P(T <= x) for the instant / log-normal tool mixture; zero for x < 0. Broadcasts.

    ``fast`` uses :func:`fast_ndtr` (fine unless the result is divided by a tail mass).
    """
    z = (np.log(np.maximum(x, 0.0) + TOOL_SHIFT_S) - mu) / np.maximum(sd, 1e-3)
    phi = fast_ndtr(z) if fast else ndtr(z)
    return np.where(x < 0, 0.0, p_instant + (1.0 - p_instant) * phi)


def tool_quantiles(p_instant: np.ndarray, mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """Tool time at the :data:`_NODES` quantiles of the mixture (rows x 3)."""
    p0 = p_instant[:, None]
    level = np.clip((_NODES[None, :] - p0) / np.maximum(1.0 - p0, _TINY), 1e-6, 1 - 1e-6)
    z = ndtri(level).astype(mu.dtype)
    t = np.exp(mu[:, None] + np.maximum(sd, 1e-3)[:, None] * z) - TOOL_SHIFT_S
    return np.where(_NODES[None, :] <= p0, 0.0, np.maximum(t, 0.0))


def expected_size(mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """E[N] for log(1 + N) ~ N(mu, sd)."""
    return np.maximum(np.exp(np.minimum(mu + sd * sd / 2, _LOG_CAP)) - 1.0, 0.0)


def _mean_output(live: Live) -> np.ndarray:
    return np.exp(np.minimum(live.mu_out + live.sd_out**2 / 2, _LOG_CAP))


def _mean_tool_s(live: Live) -> np.ndarray:
    log_mean = np.minimum(live.mu_tool + live.sd_tool**2 / 2, _LOG_CAP)
    return (1.0 - live.p_instant) * np.maximum(np.exp(log_mean) - TOOL_SHIFT_S, 0.0)


def _decode_terms(
    mu, sd, d, base_kv, rate, wait, horizons
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, mean sequences and mean KV over (0, h] of one decode that starts after
    ``wait`` with ``d`` tokens already done (rows x horizons each)."""
    h = horizons[None, :]
    r = np.maximum(rate, _TINY)[:, None]
    span = np.maximum(h - wait[:, None], 0.0)
    m1, m2 = truncated_moments(mu[:, None], sd[:, None], d[:, None], r * span)
    return m1, m1 / (r * h), (base_kv[:, None] * m1 / r + m2 / (2 * r)) / h


def _take(live: Live, rows: np.ndarray) -> Live:
    """The rows ``rows`` of every field, as float32 (state and open keep their type);
    gathered first, so each group converts only its own rows."""
    return Live(
        **{
            k: np.asarray(v)[rows]
            if k in ("state", "open")
            else np.asarray(v)[rows].astype(np.float32, copy=False)
            for k, v in vars(live).items()
        }
    )


def row_groups(live: Live) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks of the rows whose current turn waits for its decode (queued, prefilling,
    moving its KV, or decoding a turn not yet open), decodes, and is in a tool."""
    state, is_open = np.asarray(live.state), np.asarray(live.open)
    running = (state == DECODING) & is_open
    return waiting_mask(state, is_open), running, state == IN_TOOL


def decode_waits(
    state: np.ndarray,
    is_open: np.ndarray,
    since_queued: np.ndarray,
    ttft_s: np.ndarray | float,
    start_rate: np.ndarray | float,
    tick: np.ndarray | None = None,
) -> np.ndarray:
    """Seconds until each row's current turn starts decoding (0 where it already does or
    is in a tool): the recent queue-to-decode time less what the turn has waited, or, where
    longer, the turns queued before it over the rate turns leave the wait
    (:attr:`~prorsa.forecast.tracker.LifecycleTracker.turn_start_rate`; NaN: unknown).

    The queue term matters in a burst: the queue-to-decode times seen so far are those
    of the turns served first, and a sync step's later turns wait far longer. Rows of
    several ticks stacked carry ``tick`` (their queues are ranked apart); ties, as at a
    launch, are ranked in row order.
    """
    since = np.asarray(since_queued, float)
    rows = np.flatnonzero(waiting_mask(np.asarray(state), np.asarray(is_open)))
    out = np.zeros(len(since))
    if not len(rows):
        return out
    ttft = np.broadcast_to(np.asarray(ttft_s, float), out.shape)
    if np.ndim(start_rate) == 0 and not (np.isfinite(start_rate) and start_rate > 0):
        # No queue term (unknown rate, or the option off): no ranking to pay for.
        out[rows] = np.maximum(ttft[rows] - since[rows], 0.0)
        return out
    back = -since[rows]  # longest waiting first; a stable sort keeps ties in row order
    if tick is None:
        order = np.argsort(back, kind="stable")
        ahead = np.arange(len(rows), dtype=float)
    else:
        at = np.asarray(tick)[rows]
        order = np.lexsort((back, at))
        first = np.r_[0, np.flatnonzero(np.diff(at[order])) + 1]
        ahead = np.arange(len(rows)) - np.repeat(first, np.diff(np.r_[first, len(rows)]))
    rows = rows[order]
    rate = np.broadcast_to(np.asarray(start_rate, float), out.shape)[rows]
    known = np.isfinite(rate) & (rate > 0)
    queue = np.where(known, ahead / np.where(known, rate, 1.0), 0.0)
    out[rows] = np.maximum(np.maximum(ttft[rows] - since[rows], 0.0), queue)
    return out


def bottom_up(live: Live, horizons: np.ndarray) -> np.ndarray:
    """Expected contributions [rows, 4 targets, horizons] (targets in ``TARGETS`` order)."""
    work = shared_bottom_up(live, horizons)
    work.run()
    return work.out


def shared_bottom_up(live: Live, horizons: np.ndarray) -> SharedRows | _Whole:
    """:func:`bottom_up` as work that several threads may share: each calls ``run()``,
    and ``out`` holds the terms once all of them have returned. The compiled kernel cuts
    it in chunks of rows (:class:`~prorsa.forecast.bottomup_kernel.SharedRows`); the
    numpy path is one piece, as it holds the interpreter lock anyway."""
    if use_kernel():
        from prorsa.forecast import bottomup_kernel

        waiting, running, in_tool = row_groups(live)
        group = np.select([waiting, running, in_tool], bottomup_kernel.GROUPS, 0)
        return bottomup_kernel.SharedRows(live, group, np.asarray(horizons, float))
    return _Whole(live, horizons)


class _Whole:
    """The numpy path as shared work: the first thread to call :meth:`run` computes it."""

    def __init__(self, live: Live, horizons: np.ndarray) -> None:
        self._live, self._horizons = live, horizons
        self._claims = itertools.count()  # next() is atomic under the interpreter lock
        self.out = np.zeros((0, 4, len(horizons)))

    def run(self) -> None:
        if next(self._claims) == 0:
            self.out = _numpy_bottom_up(self._live, self._horizons)


def _numpy_bottom_up(live: Live, horizons: np.ndarray) -> np.ndarray:
    """:func:`bottom_up` in numpy, over all rows at once."""
    # float32 halves the cost of the transcendental functions over 10^4-10^5 elements and
    # is ample for token counts and seconds; the sums are taken in float64. Each group of
    # rows (current turn, in a tool) is taken out once and worked on densely: indexing the
    # full arrays by row inside every term cost a third of the time.
    horizons = np.asarray(horizons, np.float32)
    state = np.asarray(live.state)
    n, nh = len(state), len(horizons)
    out = np.zeros((n, 4, nh))
    if n == 0:
        return out
    pre, running, in_tool = row_groups(live)
    cur = np.flatnonzero(pre | running)
    if len(cur):
        out[cur] = _current_turn(_take(live, cur), pre[cur], horizons)
    idx = np.flatnonzero(in_tool)
    if len(idx):
        out[idx] = _in_tool(_take(live, idx), horizons)
    return out


def _current_turn(live: Live, waiting: np.ndarray, horizons: np.ndarray) -> np.ndarray:
    """The turn being prefilled or decoded, then the trajectory's next arrivals."""
    out = np.zeros((len(waiting), 4, len(horizons)))
    size = expected_size(live.mu_next, live.sd_next)
    rate = np.maximum(live.rate, _TINY)
    wait = np.where(waiting, live.wait, 0.0)
    d = np.where(waiting, 0.0, live.decoded)
    mu, sd = live.mu_out, live.sd_out
    out[:, 1], out[:, 2], out[:, 3] = _decode_terms(mu, sd, d, live.ctx + d, rate, wait, horizons)
    # The decode ends at three conditional quantiles of the remaining tokens; the next
    # prefill comes a tool call later.
    remaining = np.maximum(conditional_quantiles(mu, sd, d) - d[:, None], 0.0)
    done = wait[:, None] + remaining / rate[:, None]  # rows x 3
    p0, mu_t, sd_t = live.p_instant, live.mu_tool, live.sd_tool
    p = np.zeros((len(waiting), len(horizons)))
    for k in range(len(_NODES)):
        x = horizons[None, :] - done[:, k, None]
        p += tool_cdf(p0[:, None], mu_t[:, None], sd_t[:, None], x, fast=True) / len(_NODES)
    out[:, 0] = live.q_cont[:, None] * p * size[:, None]
    # Pair the decode's k-th node with the tool's (2-k)-th: an antithetic three-point rule.
    arrival = done + tool_quantiles(p0, mu_t, sd_t)[:, ::-1]
    mean_out = _mean_output(live)
    kv_base = live.ctx + mean_out + size
    _later_turns(
        out, live, horizons, arrival, arrival + live.ttft[:, None], kv_base, mean_out, size
    )
    return out


def _in_tool(live: Live, horizons: np.ndarray) -> np.ndarray:
    """A trajectory in a tool: its next prefill, that turn's decode, then later turns."""
    rows = len(live.state)
    out = np.zeros((rows, 4, len(horizons)))
    size = expected_size(live.mu_next, live.sd_next)
    # A tool running for e > 0 s is not instant: condition the log-normal part on it.
    mu_t, sd_t = live.mu_tool, np.maximum(live.sd_tool, 1e-3)
    e = np.maximum(np.nan_to_num(live.tool_elapsed, nan=0.0), 0.0)
    z_e = (np.log(e + TOOL_SHIFT_S) - mu_t) / sd_t
    z_h = (np.log(e[:, None] + horizons[None, :] + TOOL_SHIFT_S) - mu_t[:, None]) / sd_t[:, None]
    # P(T <= e + h | T > e) = 1 - S(z_h) / S(z_e), from the logs of the tails: far into
    # the tail both are below any floor, their ratio is not.
    ends = -np.expm1(log_ndtr(-z_h) - log_ndtr(-z_e)[:, None])
    out[:, 0] = np.clip(ends, 0.0, 1.0) * size[:, None]
    remaining = conditional_quantiles(mu_t, sd_t, e + TOOL_SHIFT_S) - TOOL_SHIFT_S
    remaining = np.maximum(remaining - e[:, None], 0.0)  # rows x 3
    base = live.ctx + np.nan_to_num(live.out_last) + size
    rate, ttft = np.maximum(live.rate, _TINY), live.ttft
    # The next turn's decode, for the three remaining-tool nodes at once (nodes x rows x h).
    r = rate[None, :, None]
    h = horizons[None, None, :]
    span = np.maximum(h - (remaining.T + ttft[None, :])[:, :, None], 0.0)
    m1, m2 = fresh_moments(live.mu_out[None, :, None], live.sd_out[None, :, None], r * span)
    m1, m2 = m1.sum(axis=0) / len(_NODES), m2.sum(axis=0) / len(_NODES)
    r, h = r[0], h[0]
    out[:, 1] += m1
    out[:, 2] += m1 / (r * h)
    out[:, 3] += (base[:, None] * m1 / r + m2 / (2 * r)) / h
    mean_out = _mean_output(live)
    first_done = remaining + (ttft + mean_out / np.maximum(live.rate, _TINY))[:, None]
    _later_turns(out, live, horizons, remaining, first_done, base + mean_out, mean_out, size)
    return out


def _later_turns(
    out: np.ndarray,
    live: Live,
    horizons: np.ndarray,
    arrivals_from: np.ndarray,
    decodes_from: np.ndarray,
    kv_base: np.ndarray,
    mean_out: np.ndarray,
    size: np.ndarray,
) -> None:
    """Add turns beyond the ones modelled exactly, as a fluid (renewal-reward) limit.

    A trajectory that keeps going cycles through time to first token, decode and tool; by
    the renewal theorem (cycle lengths here have a coefficient of variation near one) it
    makes about ``x / cycle`` more arrivals in ``x`` seconds, each bringing the mean next
    size (``size``), and decodes ``mean_out / cycle`` tokens per second. ``arrivals_from``
    and ``decodes_from`` (rows x quadrature nodes) say where those extra turns begin.
    """
    dec_s = mean_out / np.maximum(live.rate, _TINY)
    cycle = np.maximum(live.ttft + dec_s + _mean_tool_s(live), 0.1)
    h = horizons[None, :]
    nodes = arrivals_from.shape[1]
    # Node by node on 2-D arrays: cheaper than a 3-D array reduced over its middle axis.
    x_arr = sum(np.maximum(h - arrivals_from[:, k, None], 0.0) for k in range(nodes)) / nodes
    x_dec = sum(np.maximum(h - decodes_from[:, k, None], 0.0) for k in range(nodes)) / nodes
    per = (live.q_cont / cycle)[:, None]
    out[:, 0] += per * size[:, None] * x_arr
    out[:, 1] += per * mean_out[:, None] * x_dec
    busy = per * dec_s[:, None] * x_dec / horizons[None, :]
    out[:, 2] += busy
    out[:, 3] += busy * (kv_base + mean_out / 2)[:, None]
