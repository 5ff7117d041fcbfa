"""Random corruptions of every shipped trace format: a clear error or a clean skip, never a
traceback, never a silent change of accepted data.

Each case imports a folder holding an intact companion file and a corrupted copy of a real
trace (fixed seeds). Whatever the corruption:

* the import returns or raises an ``InputError`` naming a file in the folder, and never
  "please report this importer bug"; with ``--skip-bad`` it always returns (the
  companion is intact) and keeps every companion trajectory exactly as a clean import of
  the companion alone has it;
* a record that cannot be parsed at all (bad UTF-8, bad JSON, a broken CSV) makes the
  strict import fail and the lenient one count a skip: nothing disappears quietly;
* a corruption that does not change the parsed records (a flipped bit in whitespace)
  does not change the imported events;
* a strict import that succeeds equals the lenient one, which then skipped nothing.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pytest

from prorsa.errors import InputError
from prorsa.telemetry.importers import import_trace
from prorsa.telemetry.validation import find_violations
from tests.conftest import SHARED_DATA
from tests.fuzz_helpers import corrupt

# PRORSA_FUZZ_SEEDS=400 runs a longer sweep; the default keeps the suite fast.
SEEDS = range(int(os.environ.get("PRORSA_FUZZ_SEEDS", 14)))
TRACES = SHARED_DATA / "traces"


def _jsonl(path: Path, lines: slice) -> bytes:
    return b"\n".join(path.read_bytes().splitlines()[lines]) + b"\n"


def _tracelab() -> tuple[bytes, bytes]:
    rows = [
        json.loads(x) for x in (TRACES / "tracelab" / "round_trace.jsonl").read_text().splitlines()
    ]
    companion = [{**r, "session_id": "clean-" + r["session_id"]} for r in rows]
    return _lines(companion), _lines(rows)


def _tau2() -> tuple[bytes, bytes]:
    data = json.loads((TRACES / "tau2-bench" / "tau2_telecom_gpt4o.json").read_text())
    head = {"info": data["info"]}
    sims = data["simulations"]
    companion = [{**s, "id": "clean-" + s["id"]} for s in sims[:2]]
    return (
        json.dumps({**head, "simulations": companion}, indent=1).encode(),
        json.dumps({**head, "simulations": sims[2:4]}, indent=1).encode(),
    )


def _azure() -> tuple[bytes, bytes]:
    lines = (
        (TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv").read_bytes().splitlines()
    )
    return b"\n".join([lines[0], *lines[101:161]]) + b"\n", b"\n".join(lines[:61]) + b"\n"


def _lines(rows: list) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _mini() -> tuple[bytes, bytes]:
    folder = TRACES / "mini-swe-agent-swebench"
    return (
        (folder / "django__django-14559.traj.json").read_bytes(),
        (folder / "django__django-16667.traj.json").read_bytes(),
    )


def _swe_agent() -> tuple[bytes, bytes]:
    data = (TRACES / "swe-agent" / "swea_pydicom.traj").read_bytes()
    return data, data


def _mooncake() -> tuple[bytes, bytes]:
    path = TRACES / "mooncake" / "synthetic_trace.jsonl"
    return _jsonl(path, slice(100, 160)), _jsonl(path, slice(0, 60))


# format -> (how to build (companion, victim) bytes, file suffix, record layout)
FORMATS = {
    "tracelab": (_tracelab, ".jsonl", "jsonl"),
    "mooncake": (_mooncake, ".jsonl", "jsonl"),
    "azure": (_azure, ".csv", "csv"),
    "tau2": (_tau2, ".json", "json"),
    "mini-swe-agent": (_mini, ".traj.json", "json"),
    "swe-agent": (_swe_agent, ".traj", "json"),
}


@functools.cache
def _sources(fmt: str) -> tuple[bytes, bytes]:
    return FORMATS[fmt][0]()


def _folder(root: Path, fmt: str, victim: bytes, name: str) -> Path:
    suffix = FORMATS[fmt][1]
    folder = root / name
    folder.mkdir()
    companion, _ = _sources(fmt)
    # Read in name order: the companion first, so a clash of ids lands on the victim.
    (folder / f"a_clean{suffix}").write_bytes(companion)
    (folder / f"b_fuzz{suffix}").write_bytes(victim)
    return folder


@functools.cache
def _reference(fmt: str, root: str) -> tuple[dict, pa.Table]:
    companion_only = Path(root) / f"ref-{fmt}"
    companion_only.mkdir(exist_ok=True)
    suffix = FORMATS[fmt][1]
    (companion_only / f"a_clean{suffix}").write_bytes(_sources(fmt)[0])
    alone = import_trace(companion_only, fmt, run_id="fuzz")
    both = import_trace(
        _folder(Path(root), fmt, _sources(fmt)[1], f"both-{fmt}"), fmt, run_id="fuzz"
    )
    return _by_trajectory(alone.table), both.table


def _by_trajectory(table: pa.Table) -> dict[str, list[tuple]]:
    """Events per trajectory, times relative to the trajectory's first event."""
    out: dict[str, list[tuple]] = {}
    columns = [c for c in table.column_names if c not in ("time", "run_id", "trajectory_id")]
    data = table.to_pydict()
    for i, traj in enumerate(data["trajectory_id"]):
        out.setdefault(traj, []).append((data["time"][i], *(data[c][i] for c in columns)))
    return {
        traj: [(round(e[0] - events[0][0], 6), *e[1:]) for e in events]
        for traj, events in out.items()
    }


def _parse(layout: str, data: bytes) -> object:
    """The records as a plain parser sees them; ``None`` if some record is unreadable."""
    try:
        if layout == "jsonl":
            lines = [line.decode("utf-8") for line in data.split(b"\n")]
            return [json.loads(line) for line in lines if line.strip()]
        text = data.decode("utf-8")
        if layout == "json":
            return json.loads(text)
        rows = list(csv.reader(io.StringIO(text, newline="")))
        return [[cell.strip() for cell in row] for row in rows if row]
    except (UnicodeDecodeError, ValueError, RecursionError, csv.Error):
        return None


def _import(folder: Path, fmt: str, skip_bad: bool):
    try:
        return import_trace(folder, fmt, run_id="fuzz", skip_bad=skip_bad), None
    except InputError as exc:
        assert "importer bug" not in str(exc), exc
        assert exc.source is not None and exc.source.startswith(str(folder)), exc
        return None, exc


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_corrupted_trace_is_an_error_or_a_clean_skip(fmt, seed, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "fuzz-importers"
    root.mkdir(exist_ok=True)
    companion, clean_both = _reference(fmt, str(root))
    victim = _sources(fmt)[1]
    what, damaged = corrupt(victim, random.Random(f"{fmt}-{seed}"))
    folder = _folder(root, fmt, damaged, f"{fmt}-{seed}")
    layout = FORMATS[fmt][2]
    parsed = _parse(layout, damaged)

    strict, strict_error = _import(folder, fmt, skip_bad=False)
    lenient, lenient_error = _import(folder, fmt, skip_bad=True)
    context = f"{fmt}, seed {seed}: {what}"
    assert lenient_error is None, (
        f"{context}: the intact companion was not imported: {lenient_error}"
    )

    if parsed is None:  # an unreadable record must never vanish quietly
        assert strict_error is not None, context
        assert lenient.skipped >= 1, context
    elif parsed == _parse(layout, victim):
        assert strict is not None and strict.table.equals(clean_both), context
    if strict is not None:
        assert lenient.skipped == 0 and lenient.table.equals(strict.table), context

    for result in filter(None, (strict, lenient)):
        assert find_violations(result.table) == [], context
        got = _by_trajectory(result.table)
        for trajectory, events in companion.items():
            assert got.get(trajectory) == events, f"{context}: {trajectory} changed"
