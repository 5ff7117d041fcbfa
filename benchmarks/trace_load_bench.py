"""Trace loading: specs (and arrival times) per request of the Azure code trace.

The Azure LLM inference trace (code, 2023; 8,819 single-turn requests, in
``shared/data/traces/azure-llm-2023/``) is imported into lifecycle telemetry (timed and
reported apart, best of 5: that is the importer's work, and import + specs is the whole
way from the published CSV) and written to Parquet; then
``specs_from_trace`` is timed on the table and on the Parquet file (read + validate +
specs), and ``arrivals_from_trace`` on the table. Best of 5 repetitions each, reported
in microseconds per request. The shipped agent traces (``datasets/traces``) are timed the
same way per trajectory.

Goal (issue 13): ``specs_from_trace`` <= 20 us per request on the Azure code trace.

    .venv/bin/python benchmarks/trace_load_bench.py      (seconds; writes
    benchmarks/results/trace_load.json)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save

REPO = Path(__file__).resolve().parents[1]
GOAL_US = 20.0
REPEATS = 5


def best_of(fn, repeats: int = REPEATS) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        began = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - began)
    return best, out


def main() -> None:
    from prorsa.telemetry.importers import import_trace, shared_data_dir
    from prorsa.telemetry.reader import read_telemetry, write_parquet
    from prorsa.workload.replay import arrivals_from_trace, specs_from_trace

    csv = shared_data_dir() / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv"
    import_s, imported = best_of(lambda: import_trace(csv, "azure"))
    table = imported.table
    n = imported.trajectories
    table_s, specs = best_of(lambda: specs_from_trace(table))
    arrivals_s, replay = best_of(lambda: arrivals_from_trace(table))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "azure-code.parquet"
        write_parquet(table, path)
        file_s, _ = best_of(lambda: specs_from_trace(path))
    assert len(specs) == n == len(replay.arrival_s)
    azure = {
        "requests": n,
        "events": table.num_rows,
        "import_s": round(import_s, 3),
        "import_us_per_request": round(1e6 * import_s / n, 2),
        "csv_to_specs_us_per_request": round(1e6 * (import_s + table_s) / n, 2),
        "specs_from_table_us_per_request": round(1e6 * table_s / n, 2),
        "arrivals_from_table_us_per_request": round(1e6 * arrivals_s / n, 2),
        "specs_from_parquet_us_per_request": round(1e6 * file_s / n, 2),
        "trace_span_s": round(float(replay.arrival_s.max()), 1),
    }
    print(
        f"azure code: {n:,} requests; specs {azure['specs_from_table_us_per_request']:.1f} "
        f"us/request from the table, {azure['specs_from_parquet_us_per_request']:.1f} from "
        f"Parquet (read + validate); arrivals {azure['arrivals_from_table_us_per_request']:.1f};"
        f" import {import_s:.3f} s ({azure['import_us_per_request']:.1f} us/request; CSV to "
        f"specs {azure['csv_to_specs_us_per_request']:.1f})"
    )
    shipped = {}
    for trace in sorted((REPO / "datasets" / "traces").glob("*.parquet")):
        t, _ = read_telemetry(trace)
        seconds, out = best_of(lambda t=t: specs_from_trace(t))
        shipped[trace.stem] = {
            "trajectories": len(out),
            "turns": int(sum(s.num_turns for s in out)),
            "us_per_trajectory": round(1e6 * seconds / len(out), 1),
        }
        print(f"{trace.stem}: {shipped[trace.stem]}")
    met = azure["specs_from_table_us_per_request"] <= GOAL_US
    path = save(
        "trace_load",
        {
            "azure_code": azure,
            "shipped_traces": shipped,
            "goal": {
                "us_per_request": GOAL_US,
                "met": bool(met),
                "met_from_the_csv": bool(azure["csv_to_specs_us_per_request"] <= GOAL_US),
            },
            "repeats": REPEATS,
        },
    )
    print(f"goal <= {GOAL_US:g} us/request: {'met' if met else 'NOT met'}; wrote {path}")


if __name__ == "__main__":
    main()
