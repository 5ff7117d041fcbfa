"""Nominal serving speeds and the arithmetic that fills timing gaps in public traces.

Public traces record when a call was made and how many tokens it used, rarely when its
prefill ended or how long its tool ran. Where a stage time is missing it is estimated as
``base_s + new_tokens / prefill_tokens_per_s`` (time to first token) and
``output_tokens / decode_tokens_per_s`` (decoding), from the nominal rates below, and the
event that carries it says so in its ``detail``. Reasoning tokens are decoded like any
other output token, so they count as output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NominalRates:
    """Nominal speed of the serving stack behind a trace (one sequence's view of it)."""

    label: str
    base_s: float  # fixed part of time to first token: network, admission, scheduling
    prefill_tokens_per_s: float  # on prompt tokens not served from cache
    decode_tokens_per_s: float  # per sequence, reasoning tokens included

    def prefill_s(self, new_tokens: int) -> float:
        return self.base_s + new_tokens / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: int) -> float:
        return output_tokens / self.decode_tokens_per_s

    def describe(self) -> str:
        return (
            f"{self.label}: time to first token {self.base_s:g} s + new_tokens / "
            f"{self.prefill_tokens_per_s:,.0f} tok/s, decode {self.decode_tokens_per_s:g} tok/s"
        )


# Gemini 3 Pro Preview through OpenRouter (the mini-swe-agent slice). Assumed figures, not
# measured in the trace: ~100 output tok/s and ~1 s to first token before any thinking,
# 10k tok/s of uncached prefill. Checked against the slice: 94% of its 901 inter-call gaps
# exceed the estimate; the other 6% are fitted into their gap (see fit_generation).
GEMINI_API = NominalRates("Gemini 3 Pro API (nominal)", 1.0, 10_000.0, 100.0)

# GPT-4o through the OpenAI API (tau2-bench), assumed figures. Only the prefill/decode
# split depends on them: tau2 timestamps give each call's real total time.
GPT4O_API = NominalRates("GPT-4o API (nominal)", 0.4, 10_000.0, 90.0)

# Frontier coding-agent APIs (TraceLab's Claude / GPT-5 sessions, SWE-agent's models),
# assumed figures. With TraceLab's real call times they only split prefill from decode;
# SWE-agent has no clock at all, so there they place every event.
FRONTIER_API = NominalRates("frontier model API (nominal)", 1.0, 10_000.0, 60.0)

# A self-hosted engine for the request-level traces (Mooncake, Azure), which give only
# arrivals: Qwen2.5-32B on one H200 from the reference table in shared/data/README.md
# (prefill of 8k tokens in 821 ms -> ~10k tok/s; a decode step at batch 64 in 26.7 ms ->
# ~37 tok/s per sequence), plus 50 ms of scheduling before the first token.
SELF_HOSTED_ENGINE = NominalRates(
    "Qwen2.5-32B on one H200 (profile reference)", 0.05, 10_000.0, 37.0
)


def fit_generation(
    prefill_s: float, decode_s: float, available_s: float | None
) -> tuple[float, float, bool]:
    """Estimated prefill and decode times, shrunk in proportion if they exceed
    ``available_s`` (the observed gap before the next call); also whether they were shrunk.

    The trace's own timestamps win over the nominal rates: the next call cannot start
    before this one ended, so the tool time left is ``available_s - prefill - decode >= 0``.
    """
    total = prefill_s + decode_s
    if available_s is None or total <= available_s:
        return prefill_s, decode_s, False
    if total <= 0:
        return 0.0, 0.0, False
    scale = available_s / total
    return prefill_s * scale, decode_s * scale, True


def split_generation(total_s: float, prefill_s: float, decode_s: float) -> tuple[float, float]:
    """Split a measured call time into prefill and decode in the ratio of the estimates."""
    estimate = prefill_s + decode_s
    if estimate <= 0 or total_s <= 0:
        return 0.0, max(total_s, 0.0)
    prefill = total_s * prefill_s / estimate
    return prefill, total_s - prefill


def scale_to_total(weights: Sequence[float], total: int) -> list[int]:
    """Integers proportional to ``weights`` that add up to ``total`` exactly.

    Largest-remainder rounding, so per-call token estimates reproduce a trace's totals.
    """
    weight_sum = float(sum(weights))
    if weight_sum <= 0:
        return [0] * len(weights)
    shares = [w * total / weight_sum for w in weights]
    out = [int(s) for s in shares]
    short = total - sum(out)
    by_remainder = sorted(range(len(shares)), key=lambda i: out[i] - shares[i])
    for i in by_remainder[:short]:
        out[i] += 1
    return out
