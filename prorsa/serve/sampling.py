"""Sampling settings a trainer sends, checked once, and the router request that carries them.

Trainers send vLLM-style ``sampling_params`` dicts. :func:`parse_sampling` accepts the keys
the engines implement, ignores keys that only shape text output (prorsa is token-in,
token-out), and rejects anything else with an :class:`~prorsa.errors.InputError` naming the
key, so a typo never silently changes how a policy samples. :class:`ServeTurnRequest`
extends the router's ``TurnRequest`` with the settings it lacks; the router passes
``sampling()`` to every leg unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prorsa.errors import InputError
from prorsa.runtime.ray.turns import TurnRequest

#: Keys that only affect detokenised text; token-in/token-out output is the same without.
TEXT_ONLY_KEYS: frozenset[str] = frozenset(
    {
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "detokenize",
        "output_kind",
        "logprobs_mode",
    }
)
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
#: Sampling fields that must be numbers (vLLM checks their ranges beyond those here).
_NUMBERS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty",
)  # fmt: skip


@dataclass
class Sampling:
    """How to sample one turn (vLLM's meaning for every field)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # k: the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``EngineServer.generate`` beyond max_tokens/temperature
        (defaults left out, so legs stay as small as possible over Ray)."""
        defaults = Sampling()
        out: dict[str, Any] = {}
        for name in (
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "min_tokens",
            "logprobs",
            "prompt_logprobs",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                out[name] = value
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


def parse_sampling(
    values: Mapping[str, Any] | None,
    *,
    source: str = "sampling_params",
    default_max_tokens: int = 16,
) -> Sampling:
    """A checked :class:`Sampling` from a vLLM-style dict.

    Raises:
        InputError: an unknown key, a value of the wrong type or out of range (the error
            names the key), ``n`` other than 1, or text ``stop`` strings.
    """
    values = dict(values or {})
    for key in TEXT_ONLY_KEYS:
        values.pop(key, None)
    n = values.pop("n", 1)
    if n not in (1, None):
        raise InputError(
            f"n={n}: one sample per request", source=source, field="n",
            hint="send n requests (GRPO groups are n sessions)",
        )  # fmt: skip
    stop = values.pop("stop", None)
    if stop:
        raise InputError(
            "stop strings need detokenisation; this endpoint is token-in, token-out",
            source=source,
            field="stop",
            hint="use stop_token_ids",
        )
    if "max_tokens" not in values or values["max_tokens"] is None:
        values["max_tokens"] = default_max_tokens
    known = set(Sampling.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise InputError(
            f"unknown sampling parameter(s) {unknown}",
            source=source,
            field=unknown[0],
            hint=f"accepted: {', '.join(sorted(known))}",
        )
    sampling = Sampling(**{k: v for k, v in values.items() if v is not None})
    _check(sampling, source)
    return sampling


def _check(s: Sampling, source: str) -> None:
    def bad(name: str, why: str) -> InputError:
        return InputError(f"{name} {why}, got {getattr(s, name)!r}", source=source, field=name)

    ints = ("max_tokens", "top_k", "min_tokens")
    for name in ints:
        if not _is_int(getattr(s, name)):
            raise bad(name, "must be an integer")
    for name in _NUMBERS:
        if not _is_finite_number(getattr(s, name)):
            raise bad(name, "must be a finite number")
    if s.max_tokens < 1:
        raise bad("max_tokens", "must be >= 1")
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise bad("min_tokens", f"must be in [0, max_tokens={s.max_tokens}]")
    if not isinstance(s.ignore_eos, bool):
        raise bad("ignore_eos", "must be true or false")
    if s.temperature < 0:
        raise bad("temperature", "must be >= 0")
    if not 0 < s.top_p <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if s.top_k < -1:
        raise bad("top_k", "must be -1 or 0 (off) or >= 1")
    if not 0 <= s.min_p <= 1:
        raise bad("min_p", "must be in [0, 1]")
    # vLLM's own limits, checked here so a refused turn never reaches the session's turn
    # count or an engine.
    if s.repetition_penalty <= 0:
        raise bad("repetition_penalty", "must be > 0")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            raise bad(name, "must be in [-2, 2]")
    if s.seed is not None and not _is_int(s.seed):
        raise bad("seed", "must be an integer")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if isinstance(value, bool):  # OpenAI chat sends logprobs=true
            setattr(s, name, 0 if value else None)
        elif value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
    if not isinstance(s.stop_token_ids, list) or not all(_is_int(t) for t in s.stop_token_ids):
        raise bad("stop_token_ids", "must be a list of token ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    try:
        return _is_number(value) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


@dataclass
class ServeTurnRequest(TurnRequest):
    """A router turn with every :class:`Sampling` setting (the router forwards them)."""

    extra_sampling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        trajectory_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        *,
        turn: int,
        group_id: str = "",
        task: str = "",
        **routing: Any,
    ) -> ServeTurnRequest:
        kwargs = sampling.engine_kwargs()
        return cls(
            trajectory_id=trajectory_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=sampling.max_tokens,
            turn=turn,
            temperature=float(sampling.temperature),
            group_id=group_id,
            task=task,
            extra_sampling=kwargs,
            **routing,
        )

    def sampling(self) -> dict[str, Any]:
        return dict(self.extra_sampling)
