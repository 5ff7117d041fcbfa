"""Random corruptions of recorder segments: the reader never raises, returns only records
that were written (each exactly once, in order, unchanged) and counts exactly what it
could not return."""

from __future__ import annotations

import os
import random

import pytest

from prorsa.errors import InputError
from prorsa.telemetry import Recorder, read_telemetry
from tests.fuzz_helpers import corrupt

TOTAL = 1_200
# PRORSA_FUZZ_SEEDS=400 runs a longer sweep; the default keeps the suite fast.
SEEDS = range(int(os.environ.get("PRORSA_FUZZ_SEEDS", 40)))


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """Three segments of 30-row frames; row k has context_tokens == k."""
    folder = tmp_path_factory.mktemp("recording")
    with Recorder(
        folder, run_id="fz", flush_batch=30, segment_max_bytes=20_000, flush_interval_s=30
    ) as rec:
        for k in range(TOTAL):
            rec.record(
                float(k),
                f"t{k % 5}",
                "decode_start" if k % 2 else "prefill_start",
                turn=k // 100,
                engine_id=k % 4,
                context_tokens=k,
                output_tokens=k % 7,
                detail="" if k % 3 else f'{{"k":{k}}}',
            )
    table, report = read_telemetry(folder)
    assert report.clean and table.num_rows == TOTAL
    segments = sorted(folder.glob("segment-*.ptel"))
    assert len(segments) >= 3
    return folder, table.to_pylist(), {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("seed", SEEDS)
def test_corrupted_segment_recovers_exactly(recording, seed, tmp_path):
    _, original, files = recording
    rng = random.Random(seed)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    victim = rng.choice(sorted(n for n in files if n.endswith(".ptel")))
    what, damaged = corrupt(files[victim], rng)
    (tmp_path / victim).write_bytes(damaged)

    table, report = read_telemetry(tmp_path)
    rows = table.to_pylist()
    sequence = [row["context_tokens"] for row in rows]
    context = f"seed {seed}, {victim}: {what}"
    assert sequence == sorted(set(sequence)), f"{context}: repeated or out of order"
    assert all(row == original[row["context_tokens"]] for row in rows), f"{context}: changed"
    assert report.lost_records is not None, context
    assert len(rows) + report.lost_records == TOTAL, f"{context}: {report.describe()}"
    assert report.clean == (len(rows) == TOTAL and damaged == files[victim]), context


@pytest.mark.parametrize("seed", range(10))
def test_corrupted_single_segment_never_raises_unexpectedly(recording, seed, tmp_path):
    _, original, files = recording
    rng = random.Random(1000 + seed)
    name = sorted(n for n in files if n.endswith(".ptel"))[0]
    _, damaged = corrupt(files[name], rng)
    path = tmp_path / name
    path.write_bytes(damaged)
    try:
        table, report = read_telemetry(path)
    except InputError as exc:  # the file header and every frame are gone: not a segment
        assert "not a telemetry segment" in str(exc)
        return
    assert all(row == original[row["context_tokens"]] for row in table.to_pylist())
    assert report.records == table.num_rows
