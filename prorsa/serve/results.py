"""What a served turn returns: the router's result plus logprobs, weight version, TTFT/TPOT.

The router's :class:`~prorsa.runtime.ray.turns.TurnResult` keeps each leg's raw engine
result; :func:`served_result` lifts out what a policy-gradient trainer needs — the
sampled tokens' logprobs (from the decode leg), prompt logprobs (from the leg that ran
the prompt), the weight version vLLM stamped on every output token — and the timings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from prorsa.runtime.ray.turns import TurnResult
from prorsa.serve.weight_labels import WeightLabels, is_number

logger = logging.getLogger(__name__)


@dataclass
class ServeTurnResult(TurnResult):
    """A served turn: the router's result plus what a policy-gradient trainer needs."""

    session_id: str = ""
    prompt_tokens: int = 0
    output_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    weight_version: int = 0
    weight_version_label: str = "0"  # the trainer's name for it (prorsa.serve.weight_labels)
    # [label, start, end, number]: output tokens [start, end) sampled by the weights so
    # named (number: the version's; None for an engine stamp that is not one)
    weight_versions: list[list[Any]] = field(default_factory=list)
    ttft_s: float | None = None
    tpot_s: float | None = None
    engine_s: float | None = None  # time inside the engine actors (all legs)


def served_result(
    result: TurnResult, session_id: str, prompt_tokens: int, labels: WeightLabels | None = None
) -> ServeTurnResult:
    """The router's result with logprobs, weight version (named by ``labels``; by its
    number without) and TTFT/TPOT from the legs."""
    labels = labels or WeightLabels()
    decode = result.legs.get("decode", {})
    prefill = result.legs.get("prefill")
    versions = {decode.get("weight_version")}
    if prefill is not None:
        versions.add(prefill.get("weight_version"))
    if len(versions) != 1 or None in versions:
        # Engines stamp every token; this would mean a turn saw two sets of weights.
        logger.error("turn %s/%d saw weight versions %s", session_id, result.turn, versions)
    version = decode.get("weight_version")
    timings = decode.get("timings", {})
    ttft = timings.get("first_token_s")
    if prefill is not None and ttft is not None:
        ttft += prefill.get("timings", {}).get("total_s") or 0.0
    n_out = len(result.output_token_ids)
    decode_s = timings.get("decode_s")
    if decode_s is None and timings.get("total_s") is not None and ttft is not None:
        decode_s = max(0.0, timings["total_s"] - timings["first_token_s"])
    prompt_logprobs = (prefill or decode).get("prompt_logprobs")
    return ServeTurnResult(
        **{name: getattr(result, name) for name in TurnResult.__dataclass_fields__},
        session_id=session_id,
        prompt_tokens=prompt_tokens,
        output_logprobs=decode.get("output_logprobs"),
        top_logprobs=decode.get("top_logprobs"),
        prompt_logprobs=prompt_logprobs,
        prompt_top_logprobs=(prefill or decode).get("prompt_top_logprobs"),
        weight_version=int(version) if version is not None else -1,
        weight_version_label=labels.label(int(version)) if version is not None else "-1",
        weight_versions=[
            [labels.label(v), start, end, int(v) if is_number(str(v)) else None]
            for v, start, end in decode.get("weight_versions") or []
        ],
        ttft_s=ttft,
        engine_s=sum(leg.get("timings", {}).get("total_s") or 0.0 for leg in result.legs.values()),
        tpot_s=decode_s / (n_out - 1) if decode_s is not None and n_out > 1 else None,
    )
