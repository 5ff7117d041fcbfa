"""Compiled bottom-up terms: :func:`prorsa.forecast.bottomup.bottom_up`, row by row in
machine code.

The numpy path evaluates each formula over all rows at once: some 400 array operations a
tick, each holding the interpreter lock, so it takes ~7 ms at 10,000 live trajectories
whichever thread runs it, and a second thread does not help. This kernel applies the same
formulas (same approximations, see each helper) to one row at a time in float64, without
temporaries and without the lock, so the tick's bottom-up sum runs beside the per-turn
scoring on the other core (:meth:`LightGBMTrajectoryForecaster._score_beside_bottom_up`).

It agrees with the numpy path to float32 rounding (the numpy path works in float32;
``tests/test_forecast_bottomup.py`` checks both on random and real states). numba is
optional, as for :mod:`prorsa.forecast.ingest_kernel`; without it the numpy path runs.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from prorsa.forecast.ingest_kernel import AVAILABLE, _jit

# The numpy path's constants (prorsa.forecast.bottomup), frozen into the machine code.
_SHIFT = 0.05  # TOOL_SHIFT_S
_ZMAX = 3.0
_TINY = 1e-9
_LOG_CAP = math.log(1e6)
_N1, _N2, _N3 = 1.0 / 6.0, 0.5, 5.0 / 6.0  # quadrature nodes
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
#: Row groups, as :func:`prorsa.forecast.bottomup.row_groups` sorts them (0: no terms).
#: Passed in rather than derived from the tracker's state codes, which numba would freeze
#: into its cached machine code.
GROUPS = (_WAITING, _RUNNING, _IN_TOOL) = (1, 2, 3)
#: The Live fields the kernel reads, as the columns of one row matrix.
FIELDS = (
    "ctx", "wait", "decoded", "tool_elapsed", "out_last", "mu_out", "sd_out",
    "q_cont", "p_instant", "mu_tool", "sd_tool", "mu_next", "sd_next", "rate", "ttft",
)  # fmt: skip
(
    _CTX, _WAIT, _DECODED, _TOOL_ELAPSED, _OUT_LAST, _MU_OUT, _SD_OUT, _Q_CONT,
    _P_INSTANT, _MU_TOOL, _SD_TOOL, _MU_NEXT, _SD_NEXT, _RATE, _TTFT,
) = range(len(FIELDS))  # fmt: skip


def _ndtr(z):
    return 0.5 * math.erfc(-z * _SQRT1_2)


def _upper(z):
    # bottomup.upper_tail: P(Z > z) without cancellation.
    return 0.5 * math.erfc(z * _SQRT1_2)


def _fast_ndtr(z):
    # bottomup.fast_ndtr's tanh form, for the terms where the numpy path uses it.
    return 0.5 * (1.0 + math.tanh(0.7978846 * (z + 0.044715 * z * z * z)))


# Wichura's AS 241 (PPND16) coefficients, highest power first: numerator and denominator
# near the median (|p - 0.5| <= 0.425), in the tail up to r = 5 and beyond.
_CENTRAL = (
    (2509.0809287301226727, 33430.575583588128105, 67265.770927008700853,
     45921.953931549871457, 13731.693765509461125, 1971.5909503065514427,
     133.14166789178437745, 3.387132872796366608),
    (5226.495278852545925, 28729.085735721942674, 39307.89580009271061,
     21213.794301586595867, 5394.1960214247511077, 687.1870074920579083,
     42.313330701600911252, 1.0),
)  # fmt: skip
_NEAR_TAIL = (
    (7.7454501427834140764e-4, 0.0227238449892691845833, 0.24178072517745061177,
     1.27045825245236838258, 3.64784832476320460504, 5.7694972214606914055,
     4.6303378461565452959, 1.42343711074968357734),
    (1.05075007164441684324e-9, 5.475938084995344946e-4, 0.0151986665636164571966,
     0.14810397642748007459, 0.68976733498510000455, 1.6763848301838038494,
     2.05319162663775882187, 1.0),
)  # fmt: skip
_FAR_TAIL = (
    (2.01033439929228813265e-7, 2.71155556874348757815e-5, 0.0012426609473880784386,
     0.026532189526576123093, 0.29656057182850489123, 1.7848265399172913358,
     5.4637849111641143699, 6.6579046435011037772),
    (2.04426310338993978564e-15, 1.4215117583164458887e-7, 1.8463183175100546818e-5,
     7.868691311456132591e-4, 0.0148753612908506148525, 0.13692988092273580531,
     0.59983220655588793769, 1.0),
)  # fmt: skip


def _ratio(coeffs, x):
    """Numerator over denominator polynomial at ``x`` (Horner)."""
    num = 0.0
    for c in coeffs[0]:
        num = num * x + c
    den = 0.0
    for c in coeffs[1]:
        den = den * x + c
    return num / den


def _ndtri(p):
    """Inverse of the standard normal CDF for 0 < p < 1 (Wichura's AS 241, PPND16:
    relative error about 1e-16)."""
    q = p - 0.5
    if abs(q) <= 0.425:
        return q * _ratio(_CENTRAL, 0.180625 - q * q)
    r = math.sqrt(-math.log(p if q < 0.0 else 1.0 - p))
    x = _ratio(_NEAR_TAIL, r - 1.6) if r <= 5.0 else _ratio(_FAR_TAIL, r - 5.0)
    return -x if q < 0.0 else x


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _expected_size(mu, sd):
    return max(math.exp(min(mu + sd * sd / 2.0, _LOG_CAP)) - 1.0, 0.0)


def _tool_cdf(p0, mu, sd, x, fast):
    if x < 0.0:
        return 0.0
    z = (math.log(max(x, 0.0) + _SHIFT) - mu) / max(sd, 1e-3)
    return p0 + (1.0 - p0) * (_fast_ndtr(z) if fast else _ndtr(z))


def _cond_quantile(mu, sd, f, node):
    """X at quantile ``node`` of the log-normal given X above the point of CDF ``f``."""
    level = _clip(f + node * (1.0 - f), 1e-6, 1.0 - 1e-6)
    return math.exp(mu + sd * _ndtri(level))


def _tool_quantile(p0, mu, sd, node):
    """bottomup.tool_quantiles at one node."""
    if node <= p0:
        return 0.0
    level = _clip((node - p0) / max(1.0 - p0, _TINY), 1e-6, 1.0 - 1e-6)
    return max(math.exp(mu + max(sd, 1e-3) * _ndtri(level)) - _SHIFT, 0.0)


def _log_upper(z):
    """log P(Z > z) (scipy's ``log_ndtr(-z)``): erfc while it is representable, then
    the asymptotic series of the Mills ratio (relative error below 1e-7 from z = 25)."""
    if z < 25.0:
        return math.log(0.5 * math.erfc(z * _SQRT1_2))
    inv2 = 1.0 / (z * z)
    return -0.5 * z * z - math.log(z) - _LOG_SQRT_2PI + math.log1p(-inv2 + 3.0 * inv2 * inv2)


def _tail_at(a):
    # What P(a < Z <= b) needs of a, from the tail that keeps its precision.
    return _upper(a) if a > 0.0 else _ndtr(a)


def _between_from(a, tail_a, b):
    # bottomup.normal_between(a, b), with tail_a = _tail_at(a) computed once for many b.
    return tail_a - _upper(b) if a > 0.0 else _ndtr(b) - tail_a


def _truncation(mu, sd, d):
    """What bottomup.truncated_moments at ``d`` computes once for every window ``c``."""
    sd = max(sd, 1e-3)
    d = min(max(d, _TINY), math.exp(mu + _ZMAX * sd))
    ln_d = math.log(d)
    var = sd * sd
    a1 = (ln_d - mu - var) / sd
    a2 = (ln_d - mu - 2.0 * var) / sd
    first_scale, second_scale = math.exp(mu + var / 2.0), math.exp(2.0 * mu + 2.0 * var)
    s_d = _upper((ln_d - mu) / sd)
    return sd, d, var, s_d, first_scale, second_scale, a1, _tail_at(a1), a2, _tail_at(a2)


def _truncated(mu, at, c):
    """bottomup.truncated_moments for one row and window ``c`` (``at``: its
    :func:`_truncation`): (first, second)."""
    sd, d, var, s_d, first_scale, second_scale, a1, tail1, a2, tail2 = at
    ln_u = math.log(max(d + c, _TINY))
    s_u = _upper((ln_u - mu) / sd)
    m1 = first_scale * _between_from(a1, tail1, (ln_u - mu - var) / sd)
    m2 = second_scale * _between_from(a2, tail2, (ln_u - mu - 2.0 * var) / sd)
    mass = s_d - s_u
    s_d = max(s_d, _TINY)
    first = (m1 - d * mass + c * s_u) / s_d
    second = (m2 - 2.0 * d * m1 + d * d * mass + c * c * s_u) / s_d
    first = _clip(first, 0.0, c)
    return first, _clip(second, first * first, c * c)


def _fresh(mu, sd, first_scale, second_scale, c):
    """bottomup.fresh_moments for one row (``sd`` floored, ``first_scale`` /
    ``second_scale``: E[X] and E[X^2] of the log-normal): (first, second)."""
    var = sd * sd
    ln_c = math.log(max(c, _TINY))
    above = 1.0 - _fast_ndtr((ln_c - mu) / sd)
    first = first_scale * _fast_ndtr((ln_c - mu - var) / sd) + c * above
    second = second_scale * _fast_ndtr((ln_c - mu - 2.0 * var) / sd) + c * c * above
    return min(first, c), min(second, c * c)


def _later(out, i, horizons, arr, dec, kv_base, mean_out, size, row):
    """bottomup._later_turns for row ``i``; ``arr`` / ``dec``: the three nodes' starts."""
    rate, ttft, q, p0 = row[_RATE], row[_TTFT], row[_Q_CONT], row[_P_INSTANT]
    mu_t, sd_t = row[_MU_TOOL], row[_SD_TOOL]
    dec_s = mean_out / max(rate, _TINY)
    tool_s = (1.0 - p0) * max(math.exp(min(mu_t + sd_t * sd_t / 2.0, _LOG_CAP)) - _SHIFT, 0.0)
    per = q / max(ttft + dec_s + tool_s, 0.1)
    for j in range(len(horizons)):
        h = horizons[j]
        x_arr = (max(h - arr[0], 0.0) + max(h - arr[1], 0.0) + max(h - arr[2], 0.0)) / 3.0
        x_dec = (max(h - dec[0], 0.0) + max(h - dec[1], 0.0) + max(h - dec[2], 0.0)) / 3.0
        out[i, 0, j] += per * size * x_arr
        out[i, 1, j] += per * mean_out * x_dec
        busy = per * dec_s * x_dec / h
        out[i, 2, j] += busy
        out[i, 3, j] += busy * (kv_base + mean_out / 2.0)


def _current(out, i, horizons, waiting, row):
    """bottomup._current_turn for row ``i`` (``row``: its :data:`FIELDS`)."""
    ctx, decoded = row[_CTX], row[_DECODED]
    mu, sd, q, p0 = row[_MU_OUT], row[_SD_OUT], row[_Q_CONT], row[_P_INSTANT]
    mu_t, sd_t, mu_n, sd_n = row[_MU_TOOL], row[_SD_TOOL], row[_MU_NEXT], row[_SD_NEXT]
    rate_raw, ttft = row[_RATE], row[_TTFT]
    size = _expected_size(mu_n, sd_n)
    rate = max(rate_raw, _TINY)
    wait = row[_WAIT] if waiting else 0.0
    d = 0.0 if waiting else decoded
    at = _truncation(mu, sd, d)
    for j in range(len(horizons)):
        h = horizons[j]
        m1, m2 = _truncated(mu, at, rate * max(h - wait, 0.0))
        out[i, 1, j] = m1
        out[i, 2, j] = m1 / (rate * h)
        out[i, 3, j] = ((ctx + d) * m1 / rate + m2 / (2.0 * rate)) / h
    sd_c = max(sd, 1e-3)
    f = _ndtr(min((math.log(max(d, _TINY)) - mu) / sd_c, _ZMAX))
    done = (
        wait + max(_cond_quantile(mu, sd_c, f, _N1) - d, 0.0) / rate,
        wait + max(_cond_quantile(mu, sd_c, f, _N2) - d, 0.0) / rate,
        wait + max(_cond_quantile(mu, sd_c, f, _N3) - d, 0.0) / rate,
    )
    for j in range(len(horizons)):
        h = horizons[j]
        p = 0.0
        for k in range(3):
            p += _tool_cdf(p0, mu_t, sd_t, h - done[k], True) / 3.0
        out[i, 0, j] = q * p * size
    # The decode's k-th node pairs with the tool's (2-k)-th (bottomup._current_turn).
    arr = (
        done[0] + _tool_quantile(p0, mu_t, sd_t, _N3),
        done[1] + _tool_quantile(p0, mu_t, sd_t, _N2),
        done[2] + _tool_quantile(p0, mu_t, sd_t, _N1),
    )
    dec = (arr[0] + ttft, arr[1] + ttft, arr[2] + ttft)
    mean_out = math.exp(min(mu + sd * sd / 2.0, _LOG_CAP))
    _later(out, i, horizons, arr, dec, ctx + mean_out + size, mean_out, size, row)


def _in_tool(out, i, horizons, row):
    """bottomup._in_tool for row ``i`` (``row``: its :data:`FIELDS`)."""
    ctx, elapsed, out_last = row[_CTX], row[_TOOL_ELAPSED], row[_OUT_LAST]
    mu, sd, mu_n, sd_n = row[_MU_OUT], row[_SD_OUT], row[_MU_NEXT], row[_SD_NEXT]
    mu_t, sd_t = row[_MU_TOOL], max(row[_SD_TOOL], 1e-3)
    rate_raw, ttft = row[_RATE], row[_TTFT]
    size = _expected_size(mu_n, sd_n)
    e = max(0.0 if elapsed != elapsed else elapsed, 0.0)
    log_s_e = _log_upper((math.log(e + _SHIFT) - mu_t) / sd_t)
    for j in range(len(horizons)):
        z_h = (math.log(e + horizons[j] + _SHIFT) - mu_t) / sd_t
        ends = -math.expm1(_log_upper(z_h) - log_s_e)  # P(T <= e + h | T > e)
        out[i, 0, j] = _clip(ends, 0.0, 1.0) * size
    f = _ndtr(min((math.log(max(e + _SHIFT, _TINY)) - mu_t) / sd_t, _ZMAX))
    rem = (
        max(_cond_quantile(mu_t, sd_t, f, _N1) - _SHIFT - e, 0.0),
        max(_cond_quantile(mu_t, sd_t, f, _N2) - _SHIFT - e, 0.0),
        max(_cond_quantile(mu_t, sd_t, f, _N3) - _SHIFT - e, 0.0),
    )
    base = ctx + (0.0 if out_last != out_last else out_last) + size
    rate = max(rate_raw, _TINY)
    sd_o = max(sd, 1e-3)
    first_scale = math.exp(mu + sd_o * sd_o / 2.0)
    second_scale = math.exp(2.0 * mu + 2.0 * sd_o * sd_o)
    for j in range(len(horizons)):
        h = horizons[j]
        m1 = 0.0
        m2 = 0.0
        for k in range(3):
            a, b = _fresh(mu, sd_o, first_scale, second_scale, rate * max(h - (rem[k] + ttft), 0.0))
            m1 += a
            m2 += b
        m1 /= 3.0
        m2 /= 3.0
        out[i, 1, j] += m1
        out[i, 2, j] += m1 / (rate * h)
        out[i, 3, j] += (base * m1 / rate + m2 / (2.0 * rate)) / h
    mean_out = math.exp(min(mu + sd * sd / 2.0, _LOG_CAP))
    lead = ttft + mean_out / max(rate_raw, _TINY)
    first = (rem[0] + lead, rem[1] + lead, rem[2] + lead)
    _later(out, i, horizons, rem, first, base + mean_out, mean_out, size, row)


def _kernel(group, rows, horizons, out, index):
    """The terms of rows ``index`` (of ``group``, ``rows`` and ``out``)."""
    for k in range(len(index)):
        i = index[k]
        g = group[i]
        if g in (_WAITING, _RUNNING):
            _current(out, i, horizons, g == _WAITING, rows[i])
        elif g == _IN_TOOL:
            _in_tool(out, i, horizons, rows[i])


if AVAILABLE:
    _ndtr = _jit(_ndtr)
    _upper = _jit(_upper)
    _log_upper = _jit(_log_upper)
    _fast_ndtr = _jit(_fast_ndtr)
    _ratio = _jit(_ratio)
    _ndtri = _jit(_ndtri)
    _clip = _jit(_clip)
    _expected_size = _jit(_expected_size)
    _tool_cdf = _jit(_tool_cdf)
    _cond_quantile = _jit(_cond_quantile)
    _tool_quantile = _jit(_tool_quantile)
    _tail_at = _jit(_tail_at)
    _between_from = _jit(_between_from)
    _truncation = _jit(_truncation)
    _truncated = _jit(_truncated)
    _fresh = _jit(_fresh)
    _later = _jit(_later)
    _current = _jit(_current)
    _in_tool = _jit(_in_tool)
    _kernel = _jit(_kernel)


#: Rows a thread claims at a time in :class:`SharedRows` (~0.15 ms of kernel work).
CHUNK_ROWS = 256


class SharedRows:
    """The kernel's work over ``live``, cut in chunks of rows that any thread calling
    :meth:`run` claims one at a time. The forecaster's scoring thread joins in once its
    own work is done, so both cores share the sum however long the scoring took.
    Every row is computed alone, so :attr:`out` is the same whoever computed which rows.

    :meth:`part` shares out only some rows, and :meth:`set_rows` rewrites columns of some
    rows before their part runs: the forecaster builds the rows of every live trajectory
    once, runs those whose scores are known, and runs the others once scored.
    """

    def __init__(self, live, group: np.ndarray, horizons: np.ndarray) -> None:
        n = len(group)
        self.out = np.zeros((n, 4, len(horizons)))
        self._rows = np.empty((n, len(FIELDS)))
        for column, name in enumerate(FIELDS):
            self._rows[:, column] = getattr(live, name)
        self._group = np.ascontiguousarray(group, np.int64)
        self._horizons = np.ascontiguousarray(horizons, np.float64)
        self._all = self.part(np.arange(n))

    def run(self) -> None:
        """Compute chunks of every row until none is left; :attr:`out` is complete once
        every thread that called this has returned."""
        self._all.run()

    def part(self, index: np.ndarray) -> _Part:
        """Shared work over rows ``index`` only (their terms land in :attr:`out`)."""
        return _Part(self, np.ascontiguousarray(index, np.int64))

    def set_rows(self, index: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        """Rewrite columns (:data:`FIELDS` names) of rows ``index``; before their part runs."""
        for name, values in columns.items():
            self._rows[index, FIELDS.index(name)] = values


class _Part:
    """Rows of a :class:`SharedRows`, claimed in chunks by whichever threads call run()."""

    def __init__(self, whole: SharedRows, index: np.ndarray) -> None:
        self._whole, self._index = whole, index
        self._chunk_rows = CHUNK_ROWS
        self._chunks = -(-len(index) // CHUNK_ROWS)
        self._claims = itertools.count()  # next() is atomic under the interpreter lock

    def run(self) -> None:
        whole = self._whole
        while (i := next(self._claims)) < self._chunks:
            lo = i * self._chunk_rows
            index = self._index[lo : lo + self._chunk_rows]
            _kernel(whole._group, whole._rows, whole._horizons, whole.out, index)
