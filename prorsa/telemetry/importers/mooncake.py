"""Mooncake (FAST'25) request traces: JSONL of ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token prompt block).

The trace has no sessions, so they are rebuilt from prefix sharing: a request whose
leading blocks match the previous turn of an earlier session continues the session with
the longest shared leading run (ties: the most recently started); sharing nothing starts a
new session. Cached tokens are those shared blocks (x 512, capped at the input length).
Only arrivals are real: prefill and decode take nominal self-hosted engine times, and the
gap to the session's next arrival minus them is its "tool" (think/tool) time.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from prorsa.errors import InputError
from prorsa.telemetry.importers.base import TraceBuilder, TraceFormat, Turn
from prorsa.telemetry.importers.fields import Fields, check_text_file, iter_jsonl, list_files
from prorsa.telemetry.importers.timing import SELF_HOSTED_ENGINE, fit_generation
from prorsa.telemetry.schema import detail_json

TASK = "mooncake"
BLOCK_TOKENS = 512  # Mooncake hashes prompts in 512-token blocks
RATES = SELF_HOSTED_ENGINE


def read(src: Path, out: TraceBuilder) -> None:
    """Import one Mooncake JSONL trace (or every ``*.jsonl`` in a folder, each on its own)."""
    out.derive(
        "sessions",
        "rebuilt from shared leading hash_ids (longest shared run with a session's last turn)",
    )
    out.derive("cached_tokens", f"shared leading hash blocks x {BLOCK_TOKENS}, capped at input")
    out.derive("new_tokens", "input_length - derived cached_tokens")
    out.derive("prefill_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive("decode_s", f"estimated from nominal rates: {RATES.describe()}")
    out.derive(
        "tool_latency_s",
        "gap to the session's next arrival minus estimated prefill + decode, floored at 0 "
        "(estimates scaled down to fit where they exceed the gap)",
    )
    for path in list_files(src, "*.jsonl"):
        try:
            check_text_file(path)
        except InputError as exc:
            out.skip(exc, "file")
            continue
        requests = []
        for line, record in iter_jsonl(path):
            try:
                if isinstance(record, InputError):
                    raise record
                requests.append(_parse(record, Fields(str(path), f"line {line}")))
            except InputError as exc:
                out.skip(exc, "line (one request; sessions are rebuilt without it)")
        # Arrival order drives session assignment; keep file order among equal times.
        moved = sum(b[0] < a[0] for a, b in pairwise(requests))
        if moved:
            out.note(f"{path.name}: {moved} request(s) earlier than the line before, sorted")
        requests.sort(key=lambda r: r[0])
        for number, session in enumerate(_sessions(requests)):
            out.add_trajectory(
                f"{path.stem}-s{number:05d}", "", TASK, _turns(session), source=str(path)
            )


def _parse(record: object, rec: Fields) -> tuple[float, int, int, list]:
    if not isinstance(record, dict):
        raise rec.error(None, "expected a JSON object")
    arrival_s = rec.number(record, "timestamp") / 1000.0
    input_length = rec.count(record, "input_length")
    output_length = rec.count(record, "output_length")
    hash_ids = rec.seq(record, "hash_ids")
    for i, block in enumerate(hash_ids):
        if isinstance(block, bool) or not isinstance(block, int):
            raise rec.error(f"hash_ids[{i}]", f"must be an integer block id, got {block!r}")
    return arrival_s, input_length, output_length, hash_ids


def _shared_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _sessions(requests: list[tuple]) -> list[list[tuple]]:
    """Group requests into sessions; each request gets its shared block count appended."""
    sessions: list[list[tuple]] = []
    # Sessions indexed by their first block: any continuation must share it.
    by_first_block: dict[int, list[int]] = {}
    for arrival_s, input_length, output_length, hash_ids in requests:
        best, best_shared = -1, 0
        candidates = by_first_block.get(hash_ids[0], ()) if hash_ids else ()
        for s in candidates:
            shared = _shared_prefix(hash_ids, sessions[s][-1][3])
            # Later sessions come later in the list, so ">=" prefers the most recent.
            if shared >= best_shared and shared > 0:
                best, best_shared = s, shared
        entry = (arrival_s, input_length, output_length, hash_ids, best_shared)
        if best < 0:
            if hash_ids:
                by_first_block.setdefault(hash_ids[0], []).append(len(sessions))
            sessions.append([entry])
        else:
            sessions[best].append(entry)
    return sessions


def _turns(session: list[tuple]) -> list[Turn]:
    turns = []
    last = len(session) - 1
    for i, (arrival, input_length, output_length, _, shared) in enumerate(session):
        cached = min(shared * BLOCK_TOKENS, input_length)
        new = input_length - cached
        gap = session[i + 1][0] - arrival if i < last else None
        prefill_s, decode_s, fitted = fit_generation(
            RATES.prefill_s(new), RATES.decode_s(output_length), gap
        )
        turns.append(
            Turn(
                arrival,
                arrival,
                arrival + prefill_s,
                arrival + prefill_s + decode_s,
                None if gap is None else session[i + 1][0],
                input_length,
                new,
                cached,
                output_length,
                prefill_detail=_TOKENS_DERIVED,
                decode_detail=_FITTED if fitted else _GENERATION_DERIVED,
                tool_detail=_TOOL_DERIVED,
            )
        )
    return turns


_TOKENS_DERIVED = detail_json(derived=["cached_tokens", "new_tokens"])
_GENERATION_DERIVED = detail_json(derived=["prefill_s", "decode_s"])
_FITTED = detail_json(derived=["prefill_s", "decode_s"], fitted_to_gap=True)
_TOOL_DERIVED = detail_json(derived=["tool_latency_s"])

FORMAT = TraceFormat(
    name="mooncake",
    description="Mooncake request trace JSONL (timestamp ms, lengths, 512-token hash_ids)",
    read=read,
    shared_path="traces/mooncake/synthetic_trace.jsonl",
)
