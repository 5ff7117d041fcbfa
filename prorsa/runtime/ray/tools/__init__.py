"""Real, local tools for the agent loop: a sandboxed Python evaluator, BM25 text search
over a shipped corpus, and a tool whose latency follows the scenario's profile."""

from __future__ import annotations

from collections.abc import Iterable

from prorsa.errors import ConfigError
from prorsa.runtime.ray.tools.base import Tool, ToolResult
from prorsa.runtime.ray.tools.latency import LatencyTool
from prorsa.runtime.ray.tools.plan import TOOL_MIX, ToolCall, plan_call, trajectory_rng
from prorsa.runtime.ray.tools.python_eval import PythonEvalTool
from prorsa.runtime.ray.tools.search import BM25, SearchTool

TOOL_NAMES: tuple[str, ...] = ("python", "search", "latency")

__all__ = [
    "BM25",
    "TOOL_MIX",
    "TOOL_NAMES",
    "LatencyTool",
    "PythonEvalTool",
    "SearchTool",
    "Tool",
    "ToolCall",
    "ToolResult",
    "make_tools",
    "plan_call",
    "trajectory_rng",
]


def make_tools(
    names: Iterable[str] = TOOL_NAMES,
    *,
    corpus_dir: str | None = None,
    python_timeout_s: float = 5.0,
) -> dict[str, Tool]:
    """Build the named tools (``python``, ``search``, ``latency``)."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name == "python":
            tools[name] = PythonEvalTool(timeout_s=python_timeout_s)
        elif name == "search":
            tools[name] = SearchTool(corpus_dir)
        elif name == "latency":
            tools[name] = LatencyTool()
        else:
            raise ConfigError(f"unknown tool {name!r}", hint=f"choose from {', '.join(TOOL_NAMES)}")
    return tools
