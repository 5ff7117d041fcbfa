"""TraceLab round traces (JSONL, one line per round = one LLM call of a session).

The closest public match to lifecycle telemetry: real token splits (``prefix_tokens``
served from the provider's cache, ``newly_append_tokens`` prefilled) and real times.
A round's request goes out when its last input (user message or tool result) arrives and
its response is complete at its last output event (text, tool call or usage report); the
time until the next round's request is the tool (or user) time, with the tools' own
``tool_wall_latency_ms`` kept in ``detail``. Only the prefill/decode split inside a call
is estimated.

Sessions were recorded months apart on different machines, so their absolute offsets say
nothing about load: each session is aligned to start at t = 0, as if launched together in
one rollout (the original start time is in ``traj_start``'s detail).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.importers.fields import Fields, check_text_file, iter_jsonl, list_files
from prorsa.telemetry.importers.timing import FRONTIER_API, split_generation
from prorsa.telemetry.schema import detail_json

TASK = "tracelab"
RATES = FRONTIER_API
_INPUT_EVENTS = frozenset({"user_message", "tool_result"})


def read(src: Path, out: TraceBuilder) -> None:
    """Import one ``round_trace.jsonl`` (or every ``*.jsonl`` in a folder)."""
    out.derive(
        "prefill_s",
        f"real call time (last input event -> last output event) split in the ratio of "
        f"nominal estimates, capped at the first output event: {RATES.describe()}",
    )
    out.note("sessions are aligned to start at t = 0 (they were recorded on different days)")
    out.note(
        "tool_latency_s is real: response complete -> next request; after a round without "
        "tools the next request is a user message (tool_end detail `user_wait`)"
    )
    overlaps: list[float] = []
    for path in list_files(src, "*.jsonl"):
        try:
            check_text_file(path)
        except InputError as exc:
            out.skip(exc, "file")
            continue
        sessions: dict[str, list[tuple]] = {}
        broken: set[str] = set()
        for line, record in iter_jsonl(path):
            if isinstance(record, InputError):
                out.skip(record, "line (session unknown; a gap it leaves skips that session)")
                continue
            rec = Fields(str(path), f"line {line}")
            try:
                session, round_index, parsed = _parse_round(record, rec)
            except InputError as exc:
                session = record.get("session_id") if isinstance(record, dict) else None
                if not isinstance(session, str):
                    out.skip(exc, "line (session unknown; a gap it leaves skips that session)")
                    continue
                broken.add(session)
                out.skip(exc, f"session {session!r} (its rounds' times depend on each other)")
                continue
            sessions.setdefault(session, []).append((round_index, rec, parsed))
        for session, rounds in sessions.items():
            if session in broken:
                continue
            try:
                overlaps += _add_session(session, rounds, out)
            except InputError as exc:
                out.skip(exc, f"session {session!r} (its rounds' times depend on each other)")
    if overlaps:
        out.note(
            f"{len(overlaps)} round(s) had their request (a tool result) arrive while the "
            f"previous response was still streaming; they start when it ended (moved by up "
            f"to {max(overlaps):.3f} s)"
        )


def _parse_round(record: object, rec: Fields) -> tuple[str, int, dict]:
    if not isinstance(record, dict):
        raise rec.error(None, "expected a JSON object")
    session = rec.text(record, "session_id")
    round_index = rec.count(record, "round_index")
    total = rec.count(record, "input_tokens_total")
    prefix = rec.count(record, "prefix_tokens")
    new = rec.count(record, "newly_append_tokens")
    if prefix + new != total:
        raise rec.error(
            "newly_append_tokens",
            f"prefix_tokens {prefix} + newly_append_tokens {new} != input_tokens_total {total}",
        )
    inputs, outputs = [], []
    for i, event in enumerate(rec.seq(record, "timing_events")):
        ev = rec.within(f"timing_events[{i}]")
        if not isinstance(event, dict):
            raise ev.error(None, "expected an object")
        kind = ev.text(event, "event_type")
        (inputs if kind in _INPUT_EVENTS else outputs).append(ev.timestamp(event, "timestamp"))
    if not inputs:
        raise rec.error("timing_events", "no user_message or tool_result event (request time)")
    if not outputs:
        raise rec.error("timing_events", "no assistant output event (response time)")
    tools = []
    for i, tool in enumerate(rec.seq(record, "tools", [])):
        tr = rec.within(f"tools[{i}]")
        if not isinstance(tool, dict):
            raise tr.error(None, "expected an object")
        tools.append(
            (
                tr.text(tool, "tool_name", "?"),
                tr.number(tool, "tool_wall_latency_ms", None),
                tool.get("is_error") is True,
            )
        )
    parsed = {
        "context": total,
        "cached": prefix,
        "new": new,
        "output": rec.count(record, "output_tokens"),
        "reasoning": rec.count(record, "reasoning_output_tokens", None),
        "request": max(inputs),
        "first_output": min(outputs),
        "response": max(outputs),
        "user_message": rec.get(record, "first_input_event_type", "") == "user_message",
        "tools": tools,
        "provider": record.get("provider"),
        "model": record.get("model"),
    }
    if parsed["response"] < parsed["request"]:
        raise rec.error("timing_events", "last output event is earlier than the last input")
    return session, round_index, parsed


def _add_session(session: str, rounds: list[tuple], out: TraceBuilder) -> list[float]:
    """Add one session; return how far each overlapping request was moved (seconds)."""
    rounds.sort(key=lambda r: r[0])
    for expected, (index, rec, _) in enumerate(rounds):
        if index != expected:
            problem = "duplicate" if index < expected else f"round {expected} is missing; got"
            raise rec.error("round_index", f"{problem} round_index {index} in session {session!r}")
    parsed = [p for _, _, p in rounds]
    for (_, rec, p), (_, _, before) in zip(rounds[1:], rounds, strict=False):
        # A tool result can arrive while the response that called the tool still streams,
        # but not before that response began: such a request is a bad timestamp.
        if p["request"] < before["first_output"]:
            raise rec.error(
                "timing_events",
                f"request at {_iso(p['request'])} is {before['first_output'] - p['request']:,.3f}"
                f" s before the previous round's first output ({_iso(before['first_output'])})",
            )
    origin = parsed[0]["request"]
    turns: list[Turn] = []
    moved: list[float] = []
    queued = origin
    for k, p in enumerate(parsed):
        # Tools can finish while the response is still streaming; the next call cannot.
        if p["request"] < queued:
            moved.append(queued - p["request"])
        queued = max(p["request"], queued)
        response = max(p["response"], queued)
        prefill_s, _ = split_generation(
            response - queued, RATES.prefill_s(p["new"]), RATES.decode_s(p["output"])
        )
        prefill_s = min(prefill_s, max(p["first_output"] - queued, 0.0))
        following = parsed[k + 1] if k + 1 < len(parsed) else None
        next_queued = None if following is None else max(following["request"], response)
        tools = p["tools"]
        turns.append(
            Turn(
                queued - origin,
                queued - origin,
                queued + prefill_s - origin,
                response - origin,
                None if next_queued is None else next_queued - origin,
                p["context"],
                p["new"],
                p["cached"],
                p["output"],
                decode_detail=detail_json(derived=["prefill_s"], reasoning_tokens=p["reasoning"]),
                tool_detail=detail_json(
                    tools=[t[0] for t in tools] or None,
                    tool_wall_ms=[t[1] for t in tools] or None,
                    tool_errors=sum(t[2] for t in tools) or None,
                    user_wait=True if following is not None and following["user_message"] else None,
                ),
            )
        )
        queued = next_queued if next_queued is not None else queued
    out.add_trajectory(
        session,
        "",
        TASK,
        turns,
        start_detail=detail_json(
            started_at=_iso(origin), provider=parsed[0]["provider"], model=parsed[0]["model"]
        ),
        source=rounds[0][1].source,
        record=rounds[0][1].record,
        id_field="session_id",
    )
    return moved


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat()


FORMAT = TraceFormat(
    name="tracelab",
    description="TraceLab round_trace.jsonl: real agent sessions with tool and cache timing",
    read=read,
    shared_path="traces/tracelab/round_trace.jsonl",
)
