"""`prorsa traces import | summary | formats` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.telemetry.importers import import_trace
from prorsa.telemetry.reader import read_telemetry
from prorsa.telemetry.summary import summarize

runner = CliRunner()
DATA = Path(__file__).resolve().parent / "data" / "importers"


def test_import_then_summary_round_trip(shared_data, tmp_path):
    src = shared_data / "traces" / "mini-swe-agent-swebench"
    out = tmp_path / "msa.parquet"
    result = runner.invoke(
        app, ["traces", "import", str(src), "--format", "mini-swe-agent", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "25 trajectories, 926 turns, 6482 events" in result.output
    assert "tool_latency_s" in result.output and "skipped 0" in result.output

    table, report = read_telemetry(out, validate=True)
    assert report.clean and table.num_rows == 6482
    assert table.equals(import_trace(src, "mini-swe-agent").table)

    shown = runner.invoke(app, ["traces", "summary", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert summary == json.loads(json.dumps(summarize(table)))
    assert (summary["trajectories"], summary["turns"]) == (25, 926)
    assert summary["turns_per_trajectory"]["max"] == 95

    pretty = runner.invoke(app, ["traces", "summary", str(out)])
    assert pretty.exit_code == 0 and "tool_latency_s" in pretty.output


def test_import_skip_bad_reports_examples(tmp_path):
    out = tmp_path / "m.parquet"
    args = ["traces", "import", str(DATA / "mooncake_bad.jsonl"), "-f", "mooncake", "-o", str(out)]
    failed = runner.invoke(app, args)
    assert failed.exit_code == 1
    assert "field 'input_length'" in failed.output and "Traceback" not in failed.output
    result = runner.invoke(app, [*args, "--skip-bad", "--run-id", "bad"])
    assert result.exit_code == 0, result.output
    assert "skipped 4" in result.output and "mooncake_bad.jsonl:2: input_length" in result.output
    assert read_telemetry(out)[0]["run_id"][0].as_py() == "bad"


def test_formats_and_unknown_format(tmp_path):
    listed = runner.invoke(app, ["traces", "formats"])
    assert listed.exit_code == 0
    for name in ("mini-swe-agent", "tracelab", "tau2", "mooncake", "azure", "swe-agent"):
        assert name in listed.output
    bad = runner.invoke(app, ["traces", "import", str(tmp_path), "-f", "nope", "-o", "x.parquet"])
    assert bad.exit_code == 1 and "unknown trace format 'nope'" in bad.output


def test_summary_of_a_recorder_directory(shared_data, tmp_path):
    from prorsa.telemetry import Recorder

    table = import_trace(
        shared_data / "traces" / "tracelab" / "round_trace.jsonl", "tracelab"
    ).table
    with Recorder(tmp_path / "tel", run_id="round_trace") as recorder:
        for row in table.to_pylist():
            recorder.append_row(tuple(row.values()))
    shown = runner.invoke(app, ["traces", "summary", str(tmp_path / "tel"), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["turns"] == 19
