"""Sampling parameters in, logprobs and weight versions out: the engine's request contract.

:func:`sampling_params` turns the keyword arguments of ``EngineServer.generate`` into a
vLLM ``SamplingParams`` (rejecting unknown keys and bad values with an
:class:`~prorsa.errors.InputError` naming the field); :class:`OutputCollector` folds the
delta outputs of one request into token ids, per-token logprobs, prompt logprobs and the
weight-version spans vLLM stamps on every finished completion. vLLM is imported inside
the functions, so this module imports without it.
"""

from __future__ import annotations

from typing import Any

from prorsa.errors import InputError

#: Sampling keys the engine accepts besides ``max_tokens`` and ``temperature``.
SAMPLING_KEYS: frozenset[str] = frozenset(
    {
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "ignore_eos",
        "stop_token_ids",
        "logprobs",
        "prompt_logprobs",
        "min_tokens",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    }
)


def sampling_params(
    max_tokens: int,
    temperature: float,
    kv_transfer_params: dict[str, Any] | None,
    sampling: dict[str, Any],
    *,
    record: str | None = None,
) -> Any:
    """A delta-streaming, detokenize-free vLLM ``SamplingParams``.

    Args:
        max_tokens: tokens to generate.
        temperature: 0 is greedy.
        kv_transfer_params: connector parameters for this leg (None for a whole turn).
        sampling: any of :data:`SAMPLING_KEYS`; ``logprobs=k`` returns the sampled
            token's logprob plus the top ``k`` (0: the sampled token only);
            ``prompt_logprobs=k`` likewise for every prompt token.
        record: request id, named in errors.

    Raises:
        InputError: an unknown key, or a value vLLM rejects.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise InputError(
            f"unknown sampling parameter(s) {unknown}",
            record=record,
            field="sampling_params",
            hint=f"accepted: max_tokens, temperature, {', '.join(sorted(SAMPLING_KEYS))}",
        )
    values = {k: v for k, v in sampling.items() if v is not None}
    if kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
        # A decode leg pulls the prompt's KV from the prefill engine: the prompt never runs
        # here, so its logprobs come from the prefill leg.
        values.pop("prompt_logprobs", None)
    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
            **values,
        )
    except request_errors() as exc:
        raise InputError(str(exc), record=record, field="sampling_params") from None


def request_errors() -> tuple[type[BaseException], ...]:
    """Exception types vLLM raises for a bad request (not a broken engine)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # older vLLM: validation errors are ValueErrors
        return (ValueError, TypeError)
    return (ValueError, TypeError, VLLMClientError)


#: The floor of a reported logprob, as vLLM's OpenAI server applies it: a token the
#: sampler masks (top-k, top-p) has logprob -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


class OutputCollector:
    """Accumulates one request's delta outputs into the engine's result fields
    (logprobs floored at :data:`LOGPROB_FLOOR`)."""

    def __init__(self, logprobs: int | None, prompt_logprobs: int | None) -> None:
        self.want_logprobs = logprobs is not None
        self.top_k = logprobs or 0
        self.prompt_top_k = prompt_logprobs or 0
        self.want_prompt_logprobs = prompt_logprobs is not None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
        self.weight_versions: list[tuple[str, int, int]] = []

    def add(self, out: Any) -> None:
        """Fold in one ``RequestOutput`` (``RequestOutputKind.DELTA``)."""
        completion = out.outputs[0]
        new_ids = list(completion.token_ids)
        self.token_ids.extend(new_ids)
        if self.want_logprobs and completion.logprobs:
            for token_id, ranked in zip(new_ids, completion.logprobs, strict=False):
                self.logprobs.append(_logprob(ranked[token_id].logprob))
                if self.top_k:
                    self.top_logprobs.append(_top(ranked, self.top_k))
        if self.want_prompt_logprobs and self.prompt_logprobs is None and out.prompt_logprobs:
            self._add_prompt(out.prompt_token_ids or [], out.prompt_logprobs)
        spans = getattr(completion, "weight_versions", None)
        if spans:
            self.weight_versions = [(str(s.version), int(s.start), int(s.end)) for s in spans]

    def _add_prompt(self, prompt: list[int], entries: list[Any]) -> None:
        values: list[float | None] = []
        tops: list[list[tuple[int, float]]] = []
        for token_id, ranked in zip(prompt, entries, strict=False):
            if not ranked:  # the first prompt token has no context
                values.append(None)
                tops.append([])
                continue
            values.append(_logprob(ranked[token_id].logprob) if token_id in ranked else None)
            tops.append(_top(ranked, self.prompt_top_k) if self.prompt_top_k else [])
        self.prompt_logprobs = values
        self.prompt_top_logprobs = tops if self.prompt_top_k else None

    def fields(self) -> dict[str, Any]:
        """Result fields: ``output_logprobs`` (None unless asked), ``top_logprobs``,
        ``prompt_logprobs``, ``prompt_top_logprobs``, ``weight_versions`` (spans
        ``(version, start, end)`` over output positions) and ``weight_version`` (the
        version of the whole output; None when spans differ or are unknown)."""
        versions = {v for v, _, _ in self.weight_versions}
        return {
            "output_logprobs": list(self.logprobs) if self.want_logprobs else None,
            "top_logprobs": self.top_logprobs if self.top_k else None,
            "prompt_logprobs": self.prompt_logprobs,
            "prompt_top_logprobs": self.prompt_top_logprobs,
            "weight_versions": [list(s) for s in self.weight_versions],
            "weight_version": versions.pop() if len(versions) == 1 else None,
        }


def _top(ranked: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The ``k`` best-ranked entries as ``(token_id, logprob)``, best first."""
    best = sorted(ranked.items(), key=lambda item: item[1].rank or 0)
    return [(int(t), _logprob(lp.logprob)) for t, lp in best if lp.rank and lp.rank <= k][:k]
