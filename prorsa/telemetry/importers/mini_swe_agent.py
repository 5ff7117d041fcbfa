"""mini-swe-agent trajectories (``*.traj.json``, format ``mini-swe-agent-1``).

Each assistant message is one LLM call (a turn). Its ``extra.response`` holds the
provider's ``created`` second and ``usage`` (prompt, cached and completion tokens; the
completion count already includes reasoning tokens). The gap between two calls'
``created`` is this call's generation plus the tool (shell command) that followed, so
generation is estimated from nominal API rates and the tool gets the rest (>= 0).
Trajectories keep their real start offsets: the folder is one concurrent batch run.
"""

from __future__ import annotations

from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.importers.fields import Fields, list_files, load_json
from prorsa.telemetry.importers.timing import GEMINI_API, fit_generation
from prorsa.telemetry.schema import detail_json

TASK = "swe"
RATES = GEMINI_API
_USAGE = "extra.response.usage"


def read(src: Path, out: TraceBuilder) -> None:
    """Import one ``*.traj.json`` file or every one in a folder; one trajectory each."""
    out.derive("prefill_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive("decode_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive(
        "tool_latency_s",
        "gap between consecutive calls' `created` (1 s resolution) minus the estimated "
        "prefill + decode, floored at 0; where the estimate exceeds the gap it is scaled "
        "down to fit (decode_end detail `fitted_to_gap`)",
    )
    out.note("output_tokens = completion_tokens, which include reasoning tokens (they cost decode)")
    out.note("prefill_queued = prefill_start = the call's `created` second (no queue visible)")
    for path in list_files(src, "*.traj.json"):
        name = path.name.removesuffix(".traj.json").removesuffix(".json")
        try:
            meta, calls = _parse(path)
        except InputError as exc:
            out.skip(exc, f"trajectory {name!r} (its turns' times depend on each other)")
            continue
        instance = meta.get("instance_id") or name
        out.add_trajectory(
            name,
            instance,
            TASK,
            _turns(calls, out),
            start_detail=detail_json(source=path.name, model=meta.get("model")),
            end_detail=detail_json(exit_status=meta.get("exit_status")),
            source=str(path),
        )


def _parse(path: Path) -> tuple[dict, list[tuple]]:
    """Trajectory metadata and ``(created, prompt, cached, completion, reasoning, finish)``
    per assistant message, every field checked."""
    source = str(path)
    data = load_json(path)
    top = Fields(source, "top level")
    if not isinstance(data, dict):
        raise top.error(None, "expected a JSON object with 'messages'")
    messages = top.seq(data, "messages")
    calls: list[tuple] = []
    model = None
    for index, message in enumerate(messages):
        rec = Fields(source, f"messages[{index}]")
        if not isinstance(message, dict):
            raise rec.error(None, "expected an object")
        if rec.text(message, "role") != "assistant":
            continue
        created = rec.unix_time(message, "extra.response.created")
        prompt = rec.count(message, f"{_USAGE}.prompt_tokens")
        cached = rec.count(message, f"{_USAGE}.prompt_tokens_details.cached_tokens", 0)
        completion = rec.count(message, f"{_USAGE}.completion_tokens")
        reasoning = rec.count(message, f"{_USAGE}.completion_tokens_details.reasoning_tokens", 0)
        if cached > prompt:
            raise rec.error(
                f"{_USAGE}.prompt_tokens_details.cached_tokens",
                f"{cached} cached tokens exceed the {prompt} prompt tokens",
            )
        if calls and created < calls[-1][0]:
            raise rec.error(
                "extra.response.created", f"{created} is earlier than the previous call's"
            )
        choices = rec.get(message, "extra.response.choices", [])
        first_choice = choices[0] if isinstance(choices, list) and choices else None
        finish = first_choice.get("finish_reason") if isinstance(first_choice, dict) else None
        model = model or rec.get(message, "extra.response.model", None)
        calls.append((created, prompt, cached, completion, reasoning, finish))
    if not calls:
        raise top.error("messages", "no assistant messages (LLM calls)")
    info = data.get("info") if isinstance(data.get("info"), dict) else {}
    meta = {
        "instance_id": data.get("instance_id")
        if isinstance(data.get("instance_id"), str)
        else None,
        "exit_status": info.get("exit_status"),
        "model": model,
    }
    return meta, calls


def _turns(calls: list[tuple], out: TraceBuilder) -> list[Turn]:
    turns = []
    last = len(calls) - 1
    for i, (created, prompt, cached, completion, reasoning, finish) in enumerate(calls):
        new = prompt - cached
        gap = calls[i + 1][0] - created if i < last else None
        prefill_s, decode_s, fitted = fit_generation(
            RATES.prefill_s(new), RATES.decode_s(completion), gap
        )
        decode_start = created + prefill_s
        decode_end = decode_start + decode_s
        turns.append(
            Turn(
                created,
                created,
                decode_start,
                decode_end,
                None if gap is None else calls[i + 1][0],
                prompt,
                new,
                cached,
                completion,
                decode_detail=detail_json(
                    derived=["prefill_s", "decode_s"],
                    reasoning_tokens=reasoning or None,
                    finish_reason=finish,
                    fitted_to_gap=True if fitted else None,
                ),
                tool_detail=_TOOL_DETAIL,
            )
        )
    return turns


_TOOL_DETAIL = detail_json(derived=["tool_latency_s"], tool="bash")

FORMAT = TraceFormat(
    name="mini-swe-agent",
    description="mini-swe-agent *.traj.json (a folder or one file): SWE-bench coding agent",
    read=read,
    shared_path="traces/mini-swe-agent-swebench",
)
