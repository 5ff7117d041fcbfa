"""Fit scenario specs to what the engines can hold, and make the tokens they prefill.

Scenario profiles describe production agents (coding prompts of 10k-100k tokens, outputs
of hundreds); a CPU engine of a tiny model holds ``max_model_len`` tokens (1024 by
default). :func:`fit_specs` caps and scales each GRPO group's token counts so that every
trajectory's final context plus its last output fits, keeping the group's shared prompt
identical and the shape (turns, relative sizes, tool times) of the spec; tool times can be
scaled too so CPU runs stay short. The fitted spec is exactly what the runtime executes,
so a simulator fed the same specs runs the same workload.

:class:`TokenSource` turns text into token ids of an exact length: group prompts from the
search corpus, tool observations from the tool's real output.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import replace
from itertools import groupby
from typing import Any

import numpy as np

from prorsa.errors import ConfigError
from prorsa.workload.spec import TrajectorySpec


def fit_specs(
    specs: Sequence[TrajectorySpec],
    *,
    max_context_tokens: int,
    max_output_tokens: int | None = None,
    max_turns: int | None = None,
    min_prompt_tokens: int = 16,
    tool_time_scale: float = 1.0,
) -> list[TrajectorySpec]:
    """Specs whose every turn fits an engine of ``max_context_tokens`` (``max_model_len``).

    Per GRPO group (consecutive specs with the same ``group_id``): turns are cut to
    ``max_turns``, outputs capped at ``max_output_tokens``; if outputs alone take more
    than half the context they are scaled down; the remaining budget bounds the appended
    tokens, scaled by one factor per group so the shared prompt stays shared; turns that
    still do not fit (after the floors of one token) are dropped from the end. Tool
    latencies are multiplied by ``tool_time_scale``. ``meta`` records every factor.
    """
    if max_context_tokens < min_prompt_tokens + 2:
        raise ConfigError(f"max_context_tokens {max_context_tokens} is too small")
    if tool_time_scale < 0:
        raise ConfigError("tool_time_scale must be >= 0")
    budget = max_context_tokens - 1  # vLLM needs prompt + max_tokens <= max_model_len
    out: list[TrajectorySpec] = []
    for _, members in groupby(specs, key=lambda s: s.group_id or s.trajectory_id):
        group = list(members)
        cut = [_cut(s, max_output_tokens, max_turns) for s in group]
        out_scale = min(min(1.0, budget / 2 / max(int(o.sum()), 1)) for _, o in cut)
        outs = [np.maximum(np.floor(o * out_scale), 1).astype(np.int64) for _, o in cut]
        new_scale = min(
            min(1.0, (budget - int(o.sum())) / max(int(n.sum()), 1))
            for (n, _), o in zip(cut, outs, strict=True)
        )
        prompt = max(min_prompt_tokens, math.floor(int(cut[0][0][0]) * new_scale))
        for spec, (new, _), output in zip(group, cut, outs, strict=True):
            scaled = np.maximum(np.floor(new * new_scale), 1).astype(np.int64)
            scaled[0] = prompt
            turns = _turns_that_fit(scaled, output, budget)
            out.append(
                replace(
                    spec,
                    new_tokens=scaled[:turns],
                    output_tokens=output[:turns],
                    tool_latency_s=np.asarray(spec.tool_latency_s[:turns]) * tool_time_scale,
                    shared_prompt_tokens=prompt,
                    meta={
                        **spec.meta,
                        "new_token_scale": round(new_scale, 6),
                        "output_token_scale": round(out_scale, 6),
                        "max_output_tokens": max_output_tokens,
                        "tool_time_scale": tool_time_scale,
                        "turns_in_profile": spec.num_turns,
                    },
                )
            )
    return out


def _cut(
    spec: TrajectorySpec, max_output: int | None, max_turns: int | None
) -> tuple[np.ndarray, np.ndarray]:
    turns = spec.num_turns if max_turns is None else max(1, min(spec.num_turns, max_turns))
    output = np.asarray(spec.output_tokens[:turns], dtype=np.int64)
    if max_output is not None:
        output = np.minimum(output, max_output)
    return np.asarray(spec.new_tokens[:turns], dtype=np.int64), output


def _turns_that_fit(new: np.ndarray, output: np.ndarray, budget: int) -> int:
    # Turn k needs its whole context plus its output: sum(new[:k+1]) + sum(output[:k+1]).
    need = np.cumsum(new) + np.cumsum(output)
    return max(1, int(np.searchsorted(need, budget, side="right")))


class TokenSource:
    """Token ids of exact lengths from text, with the model's tokenizer.

    Args:
        tokenizer: anything with ``encode(text, add_special_tokens=False)``.
        passages: texts prompts are built from (the search corpus).
    """

    def __init__(self, tokenizer: Any, passages: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.passages = list(passages) or ["an agent solves a task with tools"]
        self._encoded: dict[int, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, group_id: str, task: str, length: int) -> list[int]:
        """The group's prompt: a task line and corpus passages chosen by the group id."""
        digest = hashlib.blake2b(group_id.encode(), digest_size=8).digest()
        start = int.from_bytes(digest, "little") % len(self.passages)
        ids = self.encode(f"Task ({task}) {group_id}: use the tools to answer. ")
        i = start
        while len(ids) < length and i < start + len(self.passages):
            ids += self._passage(i % len(self.passages))
            i += 1
        return fit_length(ids, length)

    def observation(self, text: str, length: int) -> list[int]:
        """A tool's output as exactly ``length`` tokens (cut, or repeated to fill)."""
        return fit_length(self.encode(f"\nObservation: {text}\n"), length)

    def _passage(self, index: int) -> list[int]:
        if index not in self._encoded:
            self._encoded[index] = self.encode(self.passages[index] + "\n")
        return self._encoded[index]


def fit_length(ids: list[int], length: int) -> list[int]:
    """``ids`` cut to ``length``, or repeated until it is that long (never empty)."""
    if length <= 0:
        return []
    if not ids:
        raise ConfigError("cannot build tokens from empty text")
    reps = -(-length // len(ids))
    return (ids * reps)[:length]
