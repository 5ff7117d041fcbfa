"""``CostProfile``: per-iteration time of one vLLM-style engine (model x GPU x TP degree).

Formulas (all times in seconds, tokens are counts):

* prefill of ``n`` new tokens over ``c`` cached ones::

      a + b*n + c2*n*(c + n/2)

  ``c2`` is the attention term: new token ``i`` attends to ``c + i`` keys, and the sum
  over ``i < n`` is ``n*c + n**2/2``.
* decode step of ``B`` sequences whose contexts sum to ``S``::

      max(a' + b'*B + c'*S, floor)

  linear in ``B`` and ``S`` apart from the floor (the time to read the weights once), so
  a fixed batch's step times form an arithmetic series the simulator sums in closed form.
* mixed step (chunked prefill riding on a decode batch)::

      max(mixed_overhead + b*n + c2*n*(c + n/2) + b'*B + c'*S, floor)

  both bases are replaced by ``mixed_overhead``: one iteration reads the weights once,
  whatever it carries. The floor applies to the whole step.
* KV transfer of ``t`` tokens: ``base_s + t * kv_bytes_per_token / (GB/s * 1e9)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from prorsa.errors import ConfigError

SOURCES = ("roofline", "aiconfigurator", "timings")
_COEFFICIENTS = (
    "prefill_base_s",
    "prefill_per_token_s",
    "prefill_attn_s_per_token2",
    "decode_base_s",
    "decode_per_seq_s",
    "decode_per_ctx_token_s",
    "decode_floor_s",
    "mixed_overhead_s",
)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating)


@dataclass(frozen=True)
class CostProfile:
    """Cost coefficients of one engine plus where each number came from."""

    name: str
    model: str
    hardware: str
    tp: int
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_attn_s_per_token2: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    decode_floor_s: float
    mixed_overhead_s: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_batch: int = 256
    max_step_tokens: int = 8192
    source: str = "roofline"
    provenance: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f"cost profile '{self.name}'"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("cost profile: field 'name' must be a non-empty string")
        for attr in ("model", "hardware"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ConfigError(f"{where}: field '{attr}' must be a non-empty string")
        for attr in _COEFFICIENTS:
            value = getattr(self, attr)
            if not _is_scalar(value) or not math.isfinite(float(value)) or value < 0:
                raise ConfigError(
                    f"{where}: field '{attr}' must be a finite number >= 0 (got {value!r})"
                )
            object.__setattr__(self, attr, float(value))
        for attr, low in (
            ("tp", 1),
            ("kv_bytes_per_token", 1),
            ("kv_capacity_tokens", 1),
            ("max_batch", 1),
            ("max_step_tokens", 1),
        ):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ConfigError(
                    f"{where}: field '{attr}' must be an integer >= {low} (got {value!r})"
                )
            object.__setattr__(self, attr, int(value))
        if self.source not in SOURCES:
            raise ConfigError(
                f"{where}: field 'source' must be one of {', '.join(SOURCES)} (got {self.source!r})"
            )
        if not isinstance(self.provenance, dict):
            raise ConfigError(f"{where}: field 'provenance' must be a dict")

    # ---- per-iteration times ---------------------------------------------------------
    def prefill_time_s(self, new_tokens, cached_tokens=0):
        """Time to prefill ``new_tokens`` on top of ``cached_tokens`` (0 for 0 new tokens).

        Accepts scalars or numpy-broadcastable arrays; returns a float for scalars.
        """
        if _is_scalar(new_tokens) and _is_scalar(cached_tokens):
            n, c = float(new_tokens), float(cached_tokens)
            if n < 0 or c < 0:
                raise ValueError(f"new_tokens and cached_tokens must be >= 0 (got {n}, {c})")
            if n == 0:
                return 0.0
            return (
                self.prefill_base_s
                + self.prefill_per_token_s * n
                + self.prefill_attn_s_per_token2 * n * (c + n / 2)
            )
        n = np.asarray(new_tokens, dtype=float)
        c = np.asarray(cached_tokens, dtype=float)
        _check_nonnegative(n, "new_tokens")
        _check_nonnegative(c, "cached_tokens")
        t = (
            self.prefill_base_s
            + self.prefill_per_token_s * n
            + self.prefill_attn_s_per_token2 * n * (c + n / 2)
        )
        return np.where(n > 0, t, 0.0)

    def decode_step_time_s(self, batch, context_sum):
        """Time of one decode step for ``batch`` sequences with ``context_sum`` KV tokens.

        ``context_sum`` is the sum of the sequences' context lengths. 0 for an empty batch.
        """
        if _is_scalar(batch) and _is_scalar(context_sum):
            b, s = float(batch), float(context_sum)
            if b < 0 or s < 0:
                raise ValueError(f"batch and context_sum must be >= 0 (got {b}, {s})")
            if b == 0:
                return 0.0
            linear = (
                self.decode_base_s + self.decode_per_seq_s * b + self.decode_per_ctx_token_s * s
            )
            return max(linear, self.decode_floor_s)
        b = np.asarray(batch, dtype=float)
        s = np.asarray(context_sum, dtype=float)
        _check_nonnegative(b, "batch")
        _check_nonnegative(s, "context_sum")
        linear = self.decode_base_s + self.decode_per_seq_s * b + self.decode_per_ctx_token_s * s
        return np.where(b > 0, np.maximum(linear, self.decode_floor_s), 0.0)

    def mixed_step_time_s(
        self, prefill_new_tokens, prefill_cached_tokens, batch, context_sum
    ) -> float:
        """One iteration carrying a prefill chunk and a decode batch (see module docstring).

        Falls back to the pure prefill / pure decode time when one side is empty.
        """
        n, c = float(prefill_new_tokens), float(prefill_cached_tokens)
        b, s = float(batch), float(context_sum)
        if min(n, c, b, s) < 0:
            raise ValueError(f"token counts and batch must be >= 0 (got {n}, {c}, {b}, {s})")
        if n == 0:
            return self.decode_step_time_s(b, s)
        if b == 0:
            return self.prefill_time_s(n, c)
        total = (
            self.mixed_overhead_s
            + self.prefill_per_token_s * n
            + self.prefill_attn_s_per_token2 * n * (c + n / 2)
            + self.decode_per_seq_s * b
            + self.decode_per_ctx_token_s * s
        )
        return max(total, self.decode_floor_s)

    def decode_run_time_s(self, batch: int, context_sum: int, steps: int) -> float:
        """Total time of ``steps`` decode steps of a fixed batch (each step adds ``batch``
        tokens to ``context_sum``), in closed form, floor included."""
        k, b = int(steps), float(batch)
        if k <= 0 or b <= 0:
            return 0.0
        d0 = (
            self.decode_base_s
            + self.decode_per_seq_s * b
            + self.decode_per_ctx_token_s * context_sum
        )
        slope = self.decode_per_ctx_token_s * b
        floor = self.decode_floor_s
        # steps below the floor come first (step times only grow); they each cost the floor
        if d0 >= floor:
            at_floor = 0
        elif slope <= 0:
            at_floor = k
        else:
            at_floor = min(k, math.ceil((floor - d0) / slope))
        rest = k - at_floor
        return at_floor * floor + rest * d0 + slope * (k * (k - 1) - at_floor * (at_floor - 1)) / 2

    def kv_transfer_time_s(self, tokens, bandwidth_gbytes_per_s: float, base_s: float = 0.0):
        """Time to move ``tokens`` tokens of KV between engines.

        ``bandwidth_gbytes_per_s`` is the link's usable bandwidth in GB/s (1e9 *bytes* per
        second, not Gbit/s); ``base_s`` is the fixed cost of one transfer (handshake,
        descriptor setup). Nothing moves, and nothing is charged, for 0 tokens.
        """
        if bandwidth_gbytes_per_s <= 0:
            raise ConfigError(
                f"bandwidth_gbytes_per_s must be > 0 (got {bandwidth_gbytes_per_s!r})"
            )
        if base_s < 0:
            raise ConfigError(f"base_s must be >= 0 (got {base_s!r})")
        per_token = self.kv_bytes_per_token / (bandwidth_gbytes_per_s * 1e9)
        if _is_scalar(tokens):
            t = float(tokens)
            if t < 0:
                raise ValueError(f"tokens must be >= 0 (got {t})")
            return 0.0 if t == 0 else base_s + t * per_token
        t = np.asarray(tokens, dtype=float)
        _check_nonnegative(t, "tokens")
        return np.where(t > 0, base_s + t * per_token, 0.0)

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON-ready dict (round-trips through ``from_dict``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        """Build a profile from ``to_dict`` output; unknown or missing fields are errors."""
        if not isinstance(d, dict):
            raise ConfigError(f"cost profile must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"cost profile '{d.get('name', '?')}': unknown field '{unknown[0]}'")
        required = [
            f.name
            for f in fields(cls)
            if f.name not in ("max_batch", "max_step_tokens", "source", "provenance")
        ]
        for name in required:
            if name not in d:
                raise ConfigError(f"cost profile '{d.get('name', '?')}': missing field '{name}'")
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """Read a profile written by ``save``."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data)


def _check_nonnegative(value, label: str) -> None:
    if np.any(np.asarray(value) < 0):
        raise ValueError(f"{label} must be >= 0")
