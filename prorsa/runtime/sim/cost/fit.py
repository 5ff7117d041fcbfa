"""Non-negative least-squares fits of the profile's linear forms, shared by every source.

Roofline curves, kernel-table sums and measured timings are all reduced to a profile the
same way: sample the reference, then fit ``a + b*n + c2*n*(c + n/2)`` (prefill) and
``a' + b'*B + c'*S`` (decode) with non-negative coefficients. Residuals are relative by
default because samples span three orders of magnitude (1 ms steps next to 1 s prefills)
and the simulator cares about relative error at every size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prorsa.errors import InputError


@dataclass(frozen=True)
class LinearFit:
    """Fitted coefficients and how well they match the samples."""

    coefficients: tuple[float, ...]
    n_samples: int
    r2: float
    mape: float  # mean |pred - y| / y
    max_rel_error: float

    def summary(self) -> dict:
        return {
            "n_samples": self.n_samples,
            "r2": round(self.r2, 6),
            "mape": round(self.mape, 6),
            "max_rel_error": round(self.max_rel_error, 6),
        }


def _as_samples(samples, width: int, source: str) -> np.ndarray:
    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != width or len(arr) == 0:
        raise InputError(
            f"expected a non-empty sequence of {width}-tuples, got shape {arr.shape}",
            source=source,
        )
    for col in range(width):
        bad = np.flatnonzero(~np.isfinite(arr[:, col]) | (arr[:, col] < 0))
        if len(bad):
            raise InputError(
                f"value {arr[bad[0], col]!r} must be finite and >= 0",
                source=source,
                record=int(bad[0]),
                field=f"column {col}",
            )
    bad = np.flatnonzero(arr[:, -1] <= 0)
    if len(bad):
        raise InputError("seconds must be > 0", source=source, record=int(bad[0]), field="seconds")
    return arr


def _nnls(design: np.ndarray, y: np.ndarray, relative: bool) -> np.ndarray:
    from scipy.optimize import nnls  # scipy costs ~0.3 s to import; only fits need it

    # Scale columns to unit max so n**2-sized columns do not swamp the intercept.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    weights = 1.0 / y if relative else np.ones_like(y)
    coef, _ = nnls(design / scale * weights[:, None], y * weights)
    return coef / scale


def _stats(coef: np.ndarray, pred: np.ndarray, y: np.ndarray) -> LinearFit:
    rel = np.abs(pred - y) / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((pred - y) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return LinearFit(tuple(float(x) for x in coef), len(y), r2, float(rel.mean()), float(rel.max()))


def prefill_design(new_tokens, cached_tokens) -> np.ndarray:
    n = np.asarray(new_tokens, dtype=float)
    c = np.asarray(cached_tokens, dtype=float)
    return np.column_stack([np.ones_like(n), n, n * (c + n / 2)])


def fit_prefill(samples, *, relative: bool = True, source: str = "prefill_samples") -> LinearFit:
    """Fit ``(a, b, c2)`` to ``(new_tokens, cached_tokens, seconds)`` samples."""
    arr = _as_samples(samples, 3, source)
    if np.any(arr[:, 0] <= 0):
        bad = int(np.flatnonzero(arr[:, 0] <= 0)[0])
        raise InputError("new_tokens must be > 0", source=source, record=bad, field="new_tokens")
    design = prefill_design(arr[:, 0], arr[:, 1])
    coef = _nnls(design, arr[:, 2], relative)
    return _stats(coef, design @ coef, arr[:, 2])


def fit_decode(
    samples,
    *,
    floor_s: float = 0.0,
    min_batch: int = 1,
    relative: bool = True,
    source: str = "decode_samples",
) -> LinearFit:
    """Fit ``(a', b', c')`` to ``(batch, context_sum, seconds)`` samples under ``floor_s``.

    Samples at or below the floor say nothing about the linear part (the floor hides it),
    so they are left out of the fit when enough others remain, as are batches below
    ``min_batch``; the reported errors cover every sample with the floor applied.
    """
    arr = _as_samples(samples, 3, source)
    if np.any(arr[:, 0] <= 0):
        bad = int(np.flatnonzero(arr[:, 0] <= 0)[0])
        raise InputError("batch must be > 0", source=source, record=bad, field="batch")
    design = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
    above = (arr[:, 2] > floor_s * 1.001) & (arr[:, 0] >= min_batch)
    use = above if above.sum() >= 3 else np.ones(len(arr), dtype=bool)
    coef = _nnls(design[use], arr[use, 2], relative)
    pred = np.maximum(design @ coef, floor_s)
    return _stats(coef, pred, arr[:, 2])


# Sample grids shared by the roofline and kernel-table profiles: prefill chunks up to
# 16k tokens (chunked prefill rarely exceeds 8k per step), decode batches up to
# max_batch, per-sequence contexts 256..64k, kept within the engine's KV capacity.
PREFILL_TOKENS_GRID = (128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
DECODE_BATCH_GRID = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
DECODE_CONTEXT_GRID = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def decode_grid(max_batch: int, kv_capacity_tokens: int) -> list[tuple[int, int]]:
    """``(batch, context_per_sequence)`` points an engine can actually hold."""
    return [
        (b, ctx)
        for b in DECODE_BATCH_GRID
        if b <= max_batch
        for ctx in DECODE_CONTEXT_GRID
        if b * ctx <= kv_capacity_tokens
    ]
