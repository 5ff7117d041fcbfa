"""CLI error paths of `traces` and `workload`: one clear line, never a traceback, no
output overwriting its input, partial runs refused unless asked for."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.telemetry import Recorder, events_to_table, write_parquet
from prorsa.telemetry.manifest import run_manifest
from tests.conftest import make_two_turn_events

runner = CliRunner()
MINI = "traces/mini-swe-agent-swebench"


def _ok_one_line(result, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("error:"), result.output
    return result.output


def test_summary_of_a_jsonl_trace_is_an_error(shared_data):
    trace = shared_data / "traces" / "tracelab" / "round_trace.jsonl"
    out = _ok_one_line(runner.invoke(app, ["traces", "summary", str(trace)]))
    assert "not telemetry" in out and "traces import" in out


def test_summary_of_a_file_that_is_not_parquet(tmp_path):
    fake = tmp_path / "x.parquet"
    fake.write_text("time,kind\n1,traj_start\n")
    out = _ok_one_line(runner.invoke(app, ["traces", "summary", str(fake)]))
    assert "not a readable Parquet file" in out


def test_summary_of_an_empty_folder(tmp_path):
    out = _ok_one_line(runner.invoke(app, ["traces", "summary", str(tmp_path)]))
    assert "no telemetry segments" in out


def _interrupted_run(folder):
    with (
        pytest.raises(KeyboardInterrupt),
        run_manifest(folder, command="rollout", planned=3) as run,
        Recorder(folder / "telemetry") as rec,
    ):
        for i in range(3):
            rec.record(0.0, f"t{i}", "traj_start")
        rec.record(1.0, "t0", "traj_end")
        run.counts["trajectories_completed"] = 1
        raise KeyboardInterrupt


def test_summary_refuses_a_partial_run_unless_allowed(tmp_path):
    _interrupted_run(tmp_path)
    out = _ok_one_line(runner.invoke(app, ["traces", "summary", str(tmp_path)]))
    assert "partial run (interrupted)" in out and "--allow-partial" in out
    allowed = runner.invoke(app, ["traces", "summary", str(tmp_path), "--allow-partial", "--json"])
    assert allowed.exit_code == 0, allowed.output
    summary = json.loads(allowed.output)
    assert summary["partial"]["status"] == "interrupted"
    assert summary["partial"]["unfinished_trajectories"] == 2
    assert summary["trajectories_unfinished"] == 2
    pretty = runner.invoke(app, ["traces", "summary", str(tmp_path), "--allow-partial"])
    assert pretty.exit_code == 0 and "partial run (interrupted)" in pretty.output


def test_summary_reports_damage(tmp_path):
    with Recorder(tmp_path, flush_batch=10_000) as rec:
        for k in range(3):
            rec.record(float(k), "t", "traj_start" if k == 0 else "decode_start")
            rec.flush()
        rec.record(9.0, "t", "traj_end")
    seg = next(tmp_path.glob("segment-*.ptel"))
    data = bytearray(seg.read_bytes())
    data[60] ^= 0xFF  # inside the first frame's payload
    seg.write_bytes(bytes(data))
    result = runner.invoke(app, ["traces", "summary", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    damage = json.loads(result.output)["damage"]
    assert damage["lost_records"] == 1 and "records 0-0" in damage["losses"][0]


def test_import_never_overwrites_its_input(shared_data, tmp_path):
    src = tmp_path / "round_trace.jsonl"
    src.write_bytes((shared_data / "traces" / "tracelab" / "round_trace.jsonl").read_bytes())
    before = src.read_bytes()
    out = _ok_one_line(
        runner.invoke(app, ["traces", "import", str(src), "-f", "tracelab", "-o", str(src)])
    )
    assert "is also an input" in out
    assert src.read_bytes() == before


def test_import_to_a_folder_path_fails_before_the_work(shared_data, tmp_path):
    src = shared_data / MINI
    out = _ok_one_line(
        runner.invoke(
            app, ["traces", "import", str(src), "-f", "mini-swe-agent", "-o", str(tmp_path)]
        )
    )
    assert "is a directory" in out


def test_workload_fit_refuses_partial_runs_and_its_input(tmp_path):
    events = make_two_turn_events("a") + make_two_turn_events("b", t0=1.0)
    complete = tmp_path / "run" / "telemetry.parquet"
    write_parquet(events_to_table(events), complete)
    out = _ok_one_line(runner.invoke(app, ["workload", "fit", str(complete), "-o", str(complete)]))
    assert "is also an input" in out
    ok = runner.invoke(app, ["workload", "fit", str(complete), "-o", str(tmp_path / "p.json")])
    assert ok.exit_code == 0, ok.output

    partial = tmp_path / "cut.parquet"
    write_parquet(events_to_table(events[:-1]), partial)  # b has no traj_end
    out = _ok_one_line(
        runner.invoke(app, ["workload", "fit", str(partial), "-o", str(tmp_path / "q.json")])
    )
    assert "1 of 2 trajectories have no traj_end" in out
    assert not (tmp_path / "q.json").exists()
    allowed = runner.invoke(
        app, ["workload", "fit", str(partial), "-o", str(tmp_path / "q.json"), "--allow-partial"]
    )
    assert allowed.exit_code == 0, allowed.output


def test_workload_fit_bad_values(tmp_path):
    trace = tmp_path / "t.parquet"
    write_parquet(events_to_table(make_two_turn_events()), trace)
    args = ["workload", "fit", str(trace), "-o", str(tmp_path / "p.json"), "--group-rho", "nan"]
    assert "group-rho" in _ok_one_line(runner.invoke(app, args))
    bad = runner.invoke(
        app, ["workload", "sample", "swe", "-n", "-3", "-o", str(tmp_path / "s.jsonl")]
    )
    assert bad.exit_code == 2 and "Traceback" not in bad.output


@pytest.mark.parametrize(
    "args",
    [["models", "make-tiny", "--out"], ["profile", "fit-aiconfigurator", "--out"]],
)
def test_folder_outputs_are_checked_before_the_work(tmp_path, args):
    a_file = tmp_path / "model.json"
    a_file.write_text("{}")
    out = _ok_one_line(runner.invoke(app, [*args, str(a_file)]))
    assert "is not a directory" in out
    assert a_file.read_text() == "{}"
