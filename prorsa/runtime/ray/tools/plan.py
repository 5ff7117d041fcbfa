"""Which tool a turn calls and with what arguments, decided from the trajectory's spec.

A random tiny model writes gibberish, so the agent loop cannot parse a tool call out of
its output. Instead each trajectory's tool calls are drawn here from a generator seeded by
the run seed and the trajectory id: the tool from the task's mix (:data:`TOOL_MIX`), the
arguments from simple generators (an arithmetic expression, a query of corpus words, the
spec's tool latency for the latency tool). Same seed, same calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Tool shares per task (scenario profile name); other tasks use ``default``.
TOOL_MIX: dict[str, dict[str, float]] = {
    "math-tool": {"python": 1.0},
    "search": {"search": 1.0},
    "swe": {"latency": 0.6, "search": 0.2, "python": 0.2},  # test runs, grep, scratch math
    "tau2": {"latency": 0.7, "search": 0.3},  # remote APIs, policy look-ups
    "default": {"latency": 0.4, "search": 0.3, "python": 0.3},
}


@dataclass(frozen=True)
class ToolCall:
    """One planned call."""

    tool: str
    args: dict[str, object]


def trajectory_rng(seed: int, trajectory_id: str) -> np.random.Generator:
    """A generator for one trajectory's calls, stable across processes (no ``hash()``)."""
    digest = hashlib.blake2b(f"{seed}:{trajectory_id}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def plan_call(
    task: str,
    rng: np.random.Generator,
    vocabulary: Sequence[str],
    latency_s: float,
    available: Sequence[str],
) -> ToolCall:
    """Draw the next call of a trajectory of ``task``.

    Args:
        task: the spec's task (selects the mix).
        rng: the trajectory's generator.
        vocabulary: words the search tool indexes (queries are drawn from them).
        latency_s: the spec's tool time for this turn, already time-scaled.
        available: tools this run has; the mix is restricted to them.
    """
    mix = {t: w for t, w in TOOL_MIX.get(task, TOOL_MIX["default"]).items() if t in available}
    if not mix:
        mix = dict.fromkeys(available, 1.0)
    names = sorted(mix)
    weights = np.array([mix[n] for n in names], dtype=float)
    tool = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    if tool == "python":
        return ToolCall(tool, {"expression": _expression(rng)})
    if tool == "search":
        picks = rng.choice(len(vocabulary), size=min(3, len(vocabulary)), replace=False)
        return ToolCall(tool, {"query": " ".join(vocabulary[int(i)] for i in picks)})
    job = ("pytest -x", "curl api", "make build", "browser.open")[int(rng.integers(4))]
    return ToolCall(tool, {"seconds": float(latency_s), "job": job})


def _expression(rng: np.random.Generator) -> str:
    a, b, n = (int(x) for x in rng.integers(2, 999, size=3))
    forms = (
        f"sum(i * i for i in range({n})) % {a}",
        f"round(math.sqrt({a}) * {b} / {n}, 6)",
        f"sorted([{a} % 7, {b} % 11, {n} % 13])",
        f"max(divmod({a * b}, {n}))",
        f"[k for k in range(2, {n}) if all(k % d for d in range(2, int(math.sqrt(k)) + 1))][-3:]",
    )
    return forms[int(rng.integers(len(forms)))]
