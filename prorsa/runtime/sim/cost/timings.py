"""Profiles fitted to timings measured on a real engine (CPU vLLM in tests, a GPU otherwise)."""

from __future__ import annotations

from collections.abc import Sequence

from prorsa.runtime.sim.cost.fit import fit_decode, fit_prefill
from prorsa.runtime.sim.cost.profile import CostProfile


def fit_from_timings(
    name: str,
    model: str,
    hardware: str,
    tp: int,
    prefill_samples: Sequence[tuple[float, float, float]],
    decode_samples: Sequence[tuple[float, float, float]],
    *,
    kv_bytes_per_token: int,
    kv_capacity_tokens: int,
    max_batch: int,
    max_step_tokens: int,
    decode_floor_s: float = 0.0,
    mixed_overhead_s: float | None = None,
    relative: bool = True,
    provenance: dict | None = None,
) -> CostProfile:
    """Fit a profile to measured iteration times by non-negative least squares.

    ``prefill_samples`` are ``(new_tokens, cached_tokens, seconds)``; ``decode_samples``
    are ``(batch, context_sum, seconds)`` with ``context_sum`` the sum of the batch's
    context lengths. ``relative=True`` minimises relative error (right when samples span
    orders of magnitude). ``decode_floor_s`` defaults to 0 because a measured decode
    intercept already contains the weight-read time; ``mixed_overhead_s`` defaults to the
    larger of the two fitted bases (one iteration reads the weights once).

    The returned profile's provenance records the sample counts, R², MAPE and maximum
    relative error of each fit, plus anything passed in ``provenance``.
    """
    prefill = fit_prefill(prefill_samples, relative=relative)
    decode = fit_decode(decode_samples, floor_s=decode_floor_s, relative=relative)
    a, b, c2 = prefill.coefficients
    da, db, dc = decode.coefficients
    record = {
        "method": "non-negative least squares (scipy.optimize.nnls)"
        + (", relative residuals" if relative else ", absolute residuals"),
        "prefill_fit": prefill.summary(),
        "decode_fit": decode.summary(),
        "decode_floor_s": "given" if decode_floor_s else "none (0.0): intercept holds weight reads",
        "mixed_overhead_s": "given"
        if mixed_overhead_s is not None
        else "max(prefill_base_s, decode_base_s)",
    }
    record.update(provenance or {})
    return CostProfile(
        name=name,
        model=model,
        hardware=hardware,
        tp=tp,
        prefill_base_s=a,
        prefill_per_token_s=b,
        prefill_attn_s_per_token2=c2,
        decode_base_s=da,
        decode_per_seq_s=db,
        decode_per_ctx_token_s=dc,
        decode_floor_s=decode_floor_s,
        mixed_overhead_s=max(a, da) if mixed_overhead_s is None else mixed_overhead_s,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_capacity_tokens=kv_capacity_tokens,
        max_batch=max_batch,
        max_step_tokens=max_step_tokens,
        source="timings",
        provenance=record,
    )
