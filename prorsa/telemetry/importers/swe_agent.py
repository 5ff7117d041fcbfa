"""SWE-agent trajectories (``*.traj``: JSON with ``trajectory`` steps and ``history``).

Each step is one LLM call followed by one tool action. ``execution_time`` per step is the
real tool time where present. Tokens are only reported as totals
(``info.model_stats.tokens_sent/tokens_received``), so per-call tokens are estimated from
message characters (~4 chars/token) and scaled so they add up to those totals; when the
totals are zero or absent (replayed test trajectories) the character estimate stands.
There are no timestamps: each trajectory starts at t = 0 and its clock is built from
nominal prefill/decode times plus the tool times.
"""

from __future__ import annotations

import json
from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.importers.fields import Fields, list_files, load_json
from prorsa.telemetry.importers.timing import FRONTIER_API, scale_to_total
from prorsa.telemetry.schema import detail_json

TASK = "swe"
RATES = FRONTIER_API
CHARS_PER_TOKEN = 4.0  # typical for English text and code with BPE tokenizers
# Used for steps without execution_time: the median per-step time of
# SWE-agent's own recorded trajectory in the shared data (swea_marsh.traj: 0.138 s).
NOMINAL_TOOL_S = 0.14


def read(src: Path, out: TraceBuilder) -> None:
    """Import one ``*.traj`` file or every one in a folder; one trajectory each."""
    out.derive("time", "no timestamps: clock built from nominal generation times + tool times")
    out.derive("prefill_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive("decode_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive(
        "context_tokens",
        f"characters of the history before each call / {CHARS_PER_TOKEN:g}, scaled to "
        "model_stats.tokens_sent when it is > 0",
    )
    out.derive(
        "output_tokens",
        f"characters of each assistant message / {CHARS_PER_TOKEN:g}, scaled to "
        "model_stats.tokens_received when it is > 0",
    )
    out.derive(
        "cached_tokens",
        "previous call's context + output (the history so far), capped at this context",
    )
    out.derive("new_tokens", "derived context_tokens - derived cached_tokens")
    for path in list_files(src, "*.traj"):
        try:
            _add(path, out)
        except InputError as exc:
            out.skip(exc, f"trajectory {path.stem!r} (per-call tokens are scaled jointly)")


def _add(path: Path, out: TraceBuilder) -> None:
    source = str(path)
    data = load_json(path)
    top = Fields(source, "top level")
    if not isinstance(data, dict):
        raise top.error(None, "expected a JSON object with 'trajectory' and 'history'")
    steps = top.seq(data, "trajectory")
    history = top.seq(data, "history")
    context_chars, output_chars = _char_counts(history, source)
    if len(output_chars) != len(steps):
        raise top.error(
            "history",
            f"{len(output_chars)} assistant messages but {len(steps)} trajectory steps",
        )
    if not steps:
        raise top.error("trajectory", "no steps")
    tool_s: list[float | None] = []
    for i, step in enumerate(steps):
        rec = Fields(source, f"trajectory[{i}]")
        if not isinstance(step, dict):
            raise rec.error(None, "expected an object")
        tool_s.append(rec.number(step, "execution_time", None))
    stats = Fields(source, "info.model_stats")
    model_stats = top.mapping(data, "info.model_stats", {})
    sent = stats.count(model_stats, "tokens_sent", 0)
    received = stats.count(model_stats, "tokens_received", 0)
    calls = stats.count(model_stats, "api_calls", 0)
    # Totals cover every API call; count only this trajectory's steps' share of them.
    share = len(steps) / calls if calls > len(steps) else 1.0
    contexts = _tokens(context_chars, round(sent * share))
    outputs = _tokens(output_chars, round(received * share))

    if None in tool_s:
        out.derive("tool_latency_s", f"steps without execution_time: {NOMINAL_TOOL_S} s (nominal)")
    turns: list[Turn] = []
    clock = 0.0
    prev_total = 0
    for i, (context, output) in enumerate(zip(contexts, outputs, strict=True)):
        cached = min(prev_total, context)
        prev_total = context + output
        prefill_s = RATES.prefill_s(context - cached)
        decode_end = clock + prefill_s + RATES.decode_s(output)
        tool = NOMINAL_TOOL_S if tool_s[i] is None else tool_s[i]
        last = i == len(steps) - 1
        turns.append(
            Turn(
                clock,
                clock,
                clock + prefill_s,
                decode_end,
                None if last else decode_end + tool,
                context,
                context - cached,
                cached,
                output,
                prefill_detail=_TOKENS_DERIVED,
                decode_detail=_GENERATION_DERIVED,
                tool_detail=_tool_detail(steps[i], tool_s[i] is None),
            )
        )
        clock = decode_end + tool
    out.add_trajectory(
        path.stem,
        _instance(data) or path.stem,
        TASK,
        turns,
        start_detail=detail_json(source=path.name, clock="synthetic"),
        end_detail=detail_json(
            exit_status=top.get(data, "info.exit_status", None),
            final_tool_s=tool_s[-1],
        ),
        source=source,
    )


def _char_counts(history: list, source: str) -> tuple[list[int], list[int]]:
    """Characters of context before each assistant message, and of each assistant message."""
    contexts, outputs = [], []
    seen = 0
    for j, message in enumerate(history):
        rec = Fields(source, f"history[{j}]")
        if not isinstance(message, dict):
            raise rec.error(None, "expected an object")
        role = rec.text(message, "role")
        chars = _content_chars(message.get("content"), rec)
        if message.get("tool_calls"):
            chars += len(json.dumps(message["tool_calls"]))
        if role == "assistant":
            contexts.append(seen)
            outputs.append(chars)
        seen += chars
    return contexts, outputs


def _content_chars(content: object, rec: Fields) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return sum(
            len(p["text"])
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    raise rec.error("content", f"must be a string or a list of parts, got {type(content).__name__}")


def _tokens(chars: list[int], total: int) -> list[int]:
    if total > 0:
        return scale_to_total(chars, total)
    return [round(c / CHARS_PER_TOKEN) for c in chars]


def _tool_detail(step: dict, nominal: bool) -> str:
    action = step.get("action")
    tool = action.split()[0] if isinstance(action, str) and action.split() else None
    return detail_json(derived=["tool_latency_s"] if nominal else None, tool=tool)


def _instance(data: dict) -> str | None:
    config = data.get("replay_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            return None
    agent = config.get("agent") if isinstance(config, dict) else None
    name = agent.get("name") if isinstance(agent, dict) else None
    return name if isinstance(name, str) and name else None


_TOKENS_DERIVED = detail_json(derived=["context_tokens", "new_tokens", "cached_tokens"])
_GENERATION_DERIVED = detail_json(derived=["prefill_s", "decode_s", "output_tokens"])

FORMAT = TraceFormat(
    name="swe-agent",
    description="SWE-agent *.traj (a folder or one file): per-step tool times, token totals",
    read=read,
    shared_path="traces/swe-agent",
)
