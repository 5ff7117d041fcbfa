"""Telemetry throughput: recorder events/s from 8 threads, a run's EventLog persisted in
bulk (``append_batch``), trace import speed, and whole-table validation
(``find_violations``, what every validated read runs).

Goals: >= 500k events/s sustained from 8 threads, < 2 us per event on the caller's side;
import throughput (trajectories/s) of the mini-swe-agent slice. Writes
benchmarks/results/telemetry.json.

    .venv/bin/python benchmarks/telemetry_bench.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from prorsa.telemetry import Recorder, read_telemetry
from prorsa.telemetry.columns import KIND_CODE, EventLog
from prorsa.telemetry.importers import import_trace, shared_data_dir

THREADS = 8
EVENTS_PER_THREAD = 250_000
REPEATS = 3


def recorder_run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, run_id="bench")

        def work(i: int) -> None:
            record = rec.record
            traj = f"traj-{i}"
            for k in range(EVENTS_PER_THREAD):
                record(
                    k * 1e-3,
                    traj,
                    "decode_start",
                    turn=k // 100,
                    engine_id=i,
                    context_tokens=k,
                    new_tokens=1,
                    cached_tokens=2,
                    output_tokens=3,
                )

        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        recorded = time.perf_counter() - start
        rec.close()  # includes writing whatever is still buffered
        total = time.perf_counter() - start
        table, report = read_telemetry(tmp)
        events = THREADS * EVENTS_PER_THREAD
        assert table.num_rows == events and report.clean
        return {
            "events": events,
            "sustained_events_per_s": events / total,
            # Wall time of the recording phase per event across all threads: under the GIL
            # this is what one record() call costs a caller, flusher contention included.
            "caller_us_per_event": recorded / events * 1e6,
            "wall_s": total,
            "segments": report.segments,
        }


def bulk_run() -> dict[str, float]:
    """A simulator-sized EventLog (the same 2M events) persisted with one append_batch."""
    log = EventLog("bench")
    code = KIND_CODE["decode_start"]
    for i in range(THREADS):
        key = log.key(f"traj-{i}")
        for k in range(EVENTS_PER_THREAD):
            log.append(k * 1e-3, key, k // 100, code, i, k, 1, 2, 3)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        rec = Recorder(tmp, run_id="bench")
        rec.append_batch(log.batch())
        rec.close()
        total = time.perf_counter() - start
        table, report = read_telemetry(tmp)
        assert table.num_rows == len(log) and report.clean
    return {"events": len(log), "events_per_s": len(log) / total, "wall_s": total}


def validation_run() -> dict[str, float]:
    """``find_violations`` over a table shaped like the forecasters' training telemetry:
    4 runs with ~100-character run ids, 20,000 interleaved trajectories, 4M events."""
    import resource

    from prorsa.telemetry import find_violations

    tables, code = [], KIND_CODE["decode_start"]
    for r in range(4):
        log = EventLog(f"bench-run-{r}-" + "x" * 90)
        keys = [log.key(f"traj-{i}") for i in range(5_000)]
        for k in range(200):  # trajectories interleave, as in a cluster's log
            for i, key in enumerate(keys):
                log.append(k + i * 1e-4, key, k // 20, code, i % 64, k, 1, 2, 3)
        tables.append(log.to_table())
    table = pa.concat_tables(tables)
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        problems = find_violations(table, limit=1)
        runs.append(time.perf_counter() - t0)
    assert problems == []
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "events": table.num_rows,
        "best_s": min(runs),
        "events_per_s": table.num_rows / min(runs),
        # Peak RSS above what the process held with the table built (0: under that peak).
        "extra_peak_rss_mb": max(0.0, peak_mb - before_mb),
    }


def import_run() -> dict[str, float]:
    src = shared_data_dir() / "traces" / "mini-swe-agent-swebench"
    import_trace(src, "mini-swe-agent")  # warm imports and caches
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        result = import_trace(src, "mini-swe-agent")
        runs.append(time.perf_counter() - t0)
    best = min(runs)
    return {
        "trajectories": result.trajectories,
        "events": result.events,
        "best_s": best,
        "trajectories_per_s": result.trajectories / best,
        "events_per_s": result.events / best,
    }


def main() -> None:
    runs = [recorder_run() for _ in range(REPEATS)]
    best = max(runs, key=lambda r: r["sustained_events_per_s"])
    bulk = max((bulk_run() for _ in range(REPEATS)), key=lambda r: r["events_per_s"])
    imports = import_run()
    validation = validation_run()
    goals = {
        "sustained_events_per_s >= 500k": best["sustained_events_per_s"] >= 500_000,
        "caller_us_per_event < 2": best["caller_us_per_event"] < 2.0,
    }
    path = save(
        "telemetry",
        {
            "recorder": best,
            "recorder_runs": runs,
            "append_batch": bulk,
            "import": imports,
            "find_violations": validation,
            "goals": goals,
        },
    )
    print(
        f"recorder: {best['sustained_events_per_s']:,.0f} events/s sustained "
        f"from {THREADS} threads, "
        f"{best['caller_us_per_event']:.2f} us/event on the caller side ({REPEATS} runs, best)"
    )
    print(f"append_batch: {bulk['events_per_s']:,.0f} events/s ({bulk['events']:,} events)")
    print(
        f"import mini-swe-agent: {imports['trajectories_per_s']:,.0f} trajectories/s "
        f"({imports['events_per_s']:,.0f} events/s)"
    )
    print(
        f"find_violations: {validation['events']:,} events in {validation['best_s']:.2f} s "
        f"(+{validation['extra_peak_rss_mb']:,.0f} MB peak)"
    )
    for goal, ok in goals.items():
        print(f"  goal {goal}: {'met' if ok else 'NOT met'}")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
