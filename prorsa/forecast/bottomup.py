"""Bottom-up demand: each live trajectory's expected contribution to every target, summed.

Per-trajectory models (see :mod:`prorsa.forecast.trajectory`) predict, when a turn
arrives, log-normal distributions of the turn's output tokens, of the tool time after it
and of the next turn's new tokens, and the probability that another turn follows. Here
those distributions are *conditioned on what has happened since* (tokens already decoded,
seconds already spent in the tool) and turned into expected contributions in closed form:

* a decoding sequence with ``d`` tokens done decodes ``min(O - d, r h)`` more tokens in the
  window (``r``: per-sequence decode rate), stays active ``min(O - d, r h) / r`` seconds
  and holds ``context + d + r tau`` KV tokens while it does;
* a turn waiting for prefill starts decoding after the recent time-to-first-token;
* a trajectory in a tool sends its next prefill when the tool ends
  (``P(T <= e + h | T > e)`` times the expected next size), then decodes its next turn
  (integrated over the tool's remaining time at three quantiles);
* a decoding trajectory that continues sends its next prefill after its expected
  remaining decode time plus the tool time.

New trajectories (not yet started) are not in the sum; the calibration stage on top of it
accounts for them. Everything is vectorised over trajectories x horizons.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr, ndtri

from prorsa.forecast.tracker import DECODING, IN_TOOL, PREFILLING, QUEUED, TRANSFERRING

#: Tool times are modelled as log(T + TOOL_SHIFT_S): tools may take no time at all.
TOOL_SHIFT_S = 0.05
# Beyond this many standard deviations a trajectory is "running long": condition on the
# quantile there instead of extrapolating the log-normal's far tail.
_ZMAX = 3.0
_TINY = 1e-9
_NODES = np.array([1 / 6, 1 / 2, 5 / 6])  # quadrature over the remaining tool time


@dataclass
class Live:
    """Per-trajectory inputs (arrays of one length) at one tick, or at many stacked."""

    state: np.ndarray
    open: np.ndarray
    ctx: np.ndarray
    since_queued: np.ndarray
    decoded: np.ndarray
    tool_elapsed: np.ndarray
    out_last: np.ndarray
    mu_out: np.ndarray
    sd_out: np.ndarray
    q_cont: np.ndarray
    mu_tool: np.ndarray
    sd_tool: np.ndarray
    mu_next: np.ndarray
    sd_next: np.ndarray
    rate: np.ndarray  # per-sequence decode rate (tokens/s), per row
    ttft: np.ndarray  # recent queue-to-decode seconds, per row


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
    s_d = 1.0 - ndtr((ln_d - mu) / sd)
    s_u = 1.0 - ndtr((ln_u - mu) / sd)
    var = sd * sd
    m1 = np.exp(mu + var / 2) * (ndtr((ln_u - mu - var) / sd) - ndtr((ln_d - mu - var) / sd))
    m2 = np.exp(2 * mu + 2 * var) * (
        ndtr((ln_u - mu - 2 * var) / sd) - ndtr((ln_d - mu - 2 * var) / sd)
    )
    mass = s_d - s_u
    s_d = np.maximum(s_d, _TINY)
    first = (m1 - d * mass + c * s_u) / s_d
    second = (m2 - 2 * d * m1 + d * d * mass + c * c * s_u) / s_d
    first = np.clip(first, 0.0, c)
    second = np.clip(second, first * first, c * c)
    return first, second


def tool_cdf(mu: np.ndarray, sd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(T <= x) with log(T + shift) ~ N(mu, sd); zero for x < 0."""
    z = (np.log(np.maximum(x, 0.0) + TOOL_SHIFT_S) - mu) / np.maximum(sd, 1e-3)
    return np.where(x < 0, 0.0, ndtr(z))


def expected_size(mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """E[N] for log(1 + N) ~ N(mu, sd)."""
    return np.maximum(np.exp(mu + sd * sd / 2) - 1.0, 0.0)


def _decode_terms(
    mu, sd, d, base_kv, rate, wait, horizons
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, mean sequences, mean KV over (0, h] of one decode starting after ``wait``,
    and its expected remaining tokens (rows x horizons, last: rows)."""
    h = horizons[None, :]
    r = np.maximum(rate, _TINY)[:, None]
    span = np.maximum(h - wait[:, None], 0.0)
    m1, m2 = truncated_moments(mu[:, None], sd[:, None], d[:, None], r * span)
    tokens = m1
    seqs = m1 / (r * h)
    kv = (base_kv[:, None] * m1 / r + m2 / (2 * r)) / h
    remaining, _ = truncated_moments(mu, sd, d, np.full(len(mu), 1e12))
    return tokens, seqs, kv, remaining


def bottom_up(live: Live, horizons: np.ndarray) -> np.ndarray:
    """Expected contributions [rows, 4 targets, horizons] (targets in ``TARGETS`` order)."""
    horizons = np.asarray(horizons, float)
    n, nh = len(live.state), len(horizons)
    out = np.zeros((n, 4, nh))
    if n == 0:
        return out
    state = live.state
    pre = (state == QUEUED) | (state == PREFILLING) | (state == TRANSFERRING)
    pre |= (state == DECODING) & ~live.open
    running = (state == DECODING) & live.open
    tool = state == IN_TOOL
    next_size = expected_size(live.mu_next, live.sd_next)

    # The current turn's decode (waiting turns start after the recent time to first token).
    cur = np.flatnonzero(pre | running)
    if len(cur):
        wait = np.where(pre[cur], np.maximum(live.ttft[cur] - live.since_queued[cur], 0.0), 0.0)
        d = np.where(running[cur], live.decoded[cur], 0.0)
        tok, seq, kv, remaining = _decode_terms(
            live.mu_out[cur],
            live.sd_out[cur],
            d,
            live.ctx[cur] + d,
            live.rate[cur],
            wait,
            horizons,
        )
        out[cur, 1], out[cur, 2], out[cur, 3] = tok, seq, kv
        # Its next turn arrives after the rest of the decode and a whole tool call.
        done_at = wait + remaining / np.maximum(live.rate[cur], _TINY)
        p = tool_cdf(
            live.mu_tool[cur, None], live.sd_tool[cur, None], horizons[None, :] - done_at[:, None]
        )
        out[cur, 0] = live.q_cont[cur, None] * p * next_size[cur, None]

    # Trajectories in a tool: the next prefill, then the next turn's decode.
    idx = np.flatnonzero(tool)
    if len(idx):
        mu_t, sd_t = live.mu_tool[idx], np.maximum(live.sd_tool[idx], 1e-3)
        e = np.nan_to_num(live.tool_elapsed[idx], nan=0.0)
        f_e = tool_cdf(mu_t, sd_t, e)
        s_e = np.maximum(1.0 - f_e, _TINY)
        f_h = tool_cdf(mu_t[:, None], sd_t[:, None], e[:, None] + horizons[None, :])
        p = np.clip((f_h - f_e[:, None]) / s_e[:, None], 0.0, 1.0)
        out[idx, 0] = p * next_size[idx, None]
        # Remaining tool time at three conditional quantiles (equal weights).
        level = np.clip(f_e[:, None] + _NODES[None, :] * s_e[:, None], 1e-6, 1 - 1e-6)
        remaining = np.exp(mu_t[:, None] + sd_t[:, None] * ndtri(level)) - TOOL_SHIFT_S
        remaining = np.maximum(remaining - e[:, None], 0.0)
        base = live.ctx[idx] + np.nan_to_num(live.out_last[idx]) + next_size[idx]
        rate, ttft = live.rate[idx], live.ttft[idx]
        for k in range(len(_NODES)):
            tok, seq, kv, _ = _decode_terms(
                live.mu_out[idx],
                live.sd_out[idx],
                np.zeros(len(idx)),
                base,
                rate,
                remaining[:, k] + ttft,
                horizons,
            )
            out[idx, 1] += tok / len(_NODES)
            out[idx, 2] += seq / len(_NODES)
            out[idx, 3] += kv / len(_NODES)
    return out
