"""tau2-bench simulation files (one JSON with ``simulations[]`` of agent/user conversations).

Turns are the agent's LLM calls: assistant messages with ``usage`` (the scripted greeting
has none and is not a call). Messages carry the time they were written, so a call runs
from the previous message's timestamp to its own: real generation time, split into
prefill and decode by nominal rates. "Tool latency" after a call is everything the
environment does before the agent's next call: simulated tools (~0 s) plus the
user-simulator's LLM calls (its own tokens are not the agent's and are not counted as
turns). That is the time the agent's trajectory is off the agent's engine, which is what
the rollout scheduler sees. Conversations keep their real start offsets.
"""

from __future__ import annotations

from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.importers.fields import Fields, list_files, load_json
from prorsa.telemetry.importers.timing import GPT4O_API, split_generation
from prorsa.telemetry.schema import detail_json

RATES = GPT4O_API


def read(src: Path, out: TraceBuilder) -> None:
    """Import one tau2 results JSON (or every ``*.json`` in a folder)."""
    out.derive(
        "prefill_s",
        f"real call time (previous message -> assistant message) split in the ratio of "
        f"nominal estimates: {RATES.describe()}",
    )
    out.derive(
        "cached_tokens",
        "previous agent call's prompt + completion tokens (the conversation so far), capped "
        "at this prompt: a prefix cache that keeps the trajectory's context",
    )
    out.derive("new_tokens", "prompt_tokens - derived cached_tokens")
    out.note(
        "tool_latency_s is real: agent response -> next agent call, i.e. simulated tools "
        "plus user-simulator LLM calls (tool_end detail counts both)"
    )
    for path in list_files(src, "*.json"):
        top = Fields(str(path), "top level")
        try:
            data = load_json(path)
            if not isinstance(data, dict):
                raise top.error(None, "expected a JSON object with 'simulations'")
            simulations = top.seq(data, "simulations")
        except InputError as exc:
            out.skip(exc, "file (every simulation in it)")
            continue
        domain = _domain(data)
        task = f"tau2-{domain}" if isinstance(domain, str) and domain else "tau2"
        for index, simulation in enumerate(simulations):
            rec = Fields(str(path), f"simulations[{index}]")
            try:
                _add(simulation, rec, task, out)
            except InputError as exc:
                out.skip(exc, f"simulation {index} (one trajectory)")


def _add(sim: dict, rec: Fields, task: str, out: TraceBuilder) -> None:
    if not isinstance(sim, dict):
        raise rec.error(None, "expected an object")
    sim_id = rec.text(sim, "id")
    task_id = rec.text(sim, "task_id", "")
    start = rec.timestamp(sim, "start_time")
    messages = rec.seq(sim, "messages")
    stamps: list[float] = []
    calls: list[int] = []
    for j, message in enumerate(messages):
        mrec = Fields(rec.source, f"{rec.record}.messages[{j}]")
        if not isinstance(message, dict):
            raise mrec.error(None, "expected an object")
        stamp = mrec.timestamp(message, "timestamp")
        if stamp < (stamps[-1] if stamps else start):
            raise mrec.error("timestamp", "earlier than the message (or start) before it")
        stamps.append(stamp)
        if mrec.text(message, "role") == "assistant" and message.get("usage") is not None:
            calls.append(j)
    if not calls:
        raise rec.error("messages", "no agent LLM calls (assistant messages with usage)")

    turns: list[Turn] = []
    prev_total = 0
    for k, j in enumerate(calls):
        message = messages[j]
        mrec = Fields(rec.source, f"{rec.record}.messages[{j}]")
        prompt = mrec.count(message, "usage.prompt_tokens")
        completion = mrec.count(message, "usage.completion_tokens")
        cached = min(prev_total, prompt)
        prev_total = prompt + completion
        request = stamps[j - 1] if j > 0 else start
        response = stamps[j]
        prefill_s, _ = split_generation(
            response - request, RATES.prefill_s(prompt - cached), RATES.decode_s(completion)
        )
        next_request = stamps[calls[k + 1] - 1] if k + 1 < len(calls) else None
        tool_calls = mrec.seq(message, "tool_calls", [])
        tools = [c.get("name") for c in tool_calls if isinstance(c, dict) and c.get("name")]
        env = messages[j + 1 : calls[k + 1]] if k + 1 < len(calls) else []
        turns.append(
            Turn(
                request,
                request,
                request + prefill_s,
                response,
                next_request,
                prompt,
                prompt - cached,
                cached,
                completion,
                prefill_detail=_CACHED_DERIVED if k else "",
                decode_detail=detail_json(
                    derived=["prefill_s"],
                    finish_reason=_finish_reason(message),
                ),
                tool_detail=detail_json(
                    tools=tools or None,
                    tool_results=_count(env, "tool") or None,
                    user_sim_calls=_count(env, "user") or None,
                ),
            )
        )
    end = rec.timestamp(sim, "end_time") if sim.get("end_time") else None
    # (a millisecond of slack: timestamps are written rounded)
    if end is not None and end < turns[-1].decode_end_s - 1e-3:
        raise rec.error("end_time", "earlier than the simulation's last message")
    reward = (
        sim.get("reward_info", {}).get("reward")
        if isinstance(sim.get("reward_info"), dict)
        else None
    )
    out.add_trajectory(
        sim_id,
        task_id,
        task,
        turns,
        start_s=start,
        start_detail=detail_json(task_id=task_id or None, trial=sim.get("trial")),
        end_detail=detail_json(
            termination=sim.get("termination_reason"),
            reward=reward,
            env_tail_s=None if end is None else round(max(end - turns[-1].decode_end_s, 0.0), 3),
        ),
        source=rec.source,
        record=rec.record,
        id_field="id",
    )


def _domain(data: dict) -> str | None:
    info = data.get("info")
    env = info.get("environment_info") if isinstance(info, dict) else None
    return env.get("domain_name") if isinstance(env, dict) else None


def _count(messages: list, role: str) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == role)


def _finish_reason(message: dict) -> str | None:
    raw = message.get("raw_data")
    return raw.get("finish_reason") if isinstance(raw, dict) else None


_CACHED_DERIVED = detail_json(derived=["cached_tokens", "new_tokens"])

FORMAT = TraceFormat(
    name="tau2",
    description="tau2-bench simulation results JSON: customer-service agent vs user simulator",
    read=read,
    shared_path="traces/tau2-bench/tau2_telecom_gpt4o.json",
)
