"""`prorsa simulate`: open-loop replay of a trace's arrivals, and safe outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.telemetry import read_telemetry, write_parquet
from prorsa.telemetry.manifest import check_complete, read_manifest
from prorsa.workload.replay import arrivals_from_trace

runner = CliRunner()
AZURE_SLICE = Path(__file__).resolve().parents[1] / "datasets/traces/azure-code-2023-slice.csv"


@pytest.fixture(scope="module")
def azure_trace(tmp_path_factory) -> Path:
    """The shipped Azure code-trace slice (1,000 requests over ~9 minutes) as telemetry."""
    from prorsa.telemetry.importers import import_trace

    path = tmp_path_factory.mktemp("azure") / "azure.parquet"
    write_parquet(import_trace(AZURE_SLICE, "azure").table, path)
    return path


def test_arrivals_replay_starts_each_trajectory_at_its_arrival(azure_trace, tmp_path):
    out = tmp_path / "sim"
    args = ["simulate", "--trace", str(azure_trace), "--arrivals", "--engines", "2"]
    result = runner.invoke(app, [*args, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    replay = arrivals_from_trace(azure_trace)
    arrival = dict(zip((s.trajectory_id for s in replay.specs), replay.arrival_s, strict=True))
    table, _ = read_telemetry(out / "telemetry.parquet")
    first = table.filter(pc.equal(table.column("kind").cast("string"), "prefill_queued"))
    starts: dict[str, float] = {}
    for traj, at, turn in zip(
        first.column("trajectory_id").to_pylist(),
        first.column("time").to_pylist(),
        first.column("turn").to_pylist(),
        strict=True,
    ):
        if turn == 0:
            starts[traj] = min(at, starts.get(traj, at))
    assert set(starts) == set(arrival) and len(starts) == 1000
    # Never before its arrival, and open loop: the last arrives minutes in, not at 0.
    assert all(starts[t] >= arrival[t] - 1e-9 for t in starts)
    assert max(arrival.values()) > 60 and max(starts.values()) >= max(arrival.values())
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["request"]["arrivals"] is True and metrics["trajectories_completed"] == 1000
    assert metrics["makespan_s"] >= max(arrival.values())
    manifest = read_manifest(out)
    assert manifest.status == "complete" and manifest.counts["trajectories_planned"] == 1000
    assert check_complete(out / "telemetry.parquet").complete


def test_arrivals_needs_a_trace(tmp_path):
    result = runner.invoke(app, ["simulate", "--arrivals", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "add --trace" in result.output


@pytest.mark.parametrize("where", ["trace_itself", "folder_holding_trace"])
def test_simulate_refuses_an_output_that_is_its_input_before_simulating(
    azure_trace, tmp_path, where
):
    out = azure_trace if where == "trace_itself" else azure_trace.parent
    before = azure_trace.read_bytes()
    result = runner.invoke(app, ["simulate", "--trace", str(azure_trace), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.output.startswith("error:")
    assert azure_trace.read_bytes() == before
    assert not (azure_trace.parent / "metrics.json").exists()


def test_simulate_rejects_unknown_policy_param_in_one_line(tmp_path):
    args = ["simulate", "--trajectories", "4", "--policy", "static", "--param", "prefil_gpus=2"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    assert "has no parameter 'prefil_gpus'" in result.output and "prefill_gpus" in result.output
    assert not (tmp_path / "o").exists()  # nothing written for a refused run


def test_a_run_that_fails_part_way_leaves_its_own_telemetry_marked_failed(tmp_path, monkeypatch):
    # Found by review: the events lived in memory until the end, so a crash left none,
    # and an earlier run's telemetry.parquet and metrics.json stayed beside the new
    # manifest, read as if they were this run's.
    from prorsa.runtime.sim.simulation import Simulation

    out = tmp_path / "sim"
    args = ["simulate", "--trajectories", "16", "--engines", "2", "--out", str(out), "--json"]
    assert runner.invoke(app, args).exit_code == 0
    earlier, _ = read_telemetry(out / "telemetry.parquet")
    advance = Simulation.advance

    def fail_midway(self, until=None):
        advance(self, 60.0)  # a minute of simulated time, then an error
        raise RuntimeError("boom")

    monkeypatch.setattr(Simulation, "advance", fail_midway)
    result = runner.invoke(app, args)
    assert result.exit_code == 70 and "boom" in result.output  # an internal error
    assert not (out / "metrics.json").exists()  # the earlier run's is gone
    manifest = read_manifest(out)
    assert manifest.status == "failed" and "boom" in manifest.cause
    table, _ = read_telemetry(out / "telemetry.parquet")
    assert 0 < table.num_rows < earlier.num_rows
    assert max(table.column("time").to_pylist()) <= 60.0
    report = check_complete(out / "telemetry.parquet", allow_partial=True)
    assert not report.complete
    with pytest.raises(Exception, match="failed"):
        check_complete(out / "telemetry.parquet")


def test_arrivals_replay_two_runs_that_share_trajectory_ids(azure_trace, tmp_path):
    # Found by review: the cluster tracks live trajectories by id, and the second run's
    # 't0' ended the first's (a KeyError mid-run).
    import pyarrow as pa

    from prorsa.runtime.sim.drivers import ArrivalDriver

    table, _ = read_telemetry(azure_trace)
    first = table.slice(0, 2_000)
    index = first.schema.get_field_index("run_id")
    second = first.set_column(
        index, first.schema.field(index), pa.array(["other"] * len(first), pa.string())
    )
    both = tmp_path / "both.parquet"
    write_parquet(pa.concat_tables([first, second]), both)
    driver = ArrivalDriver.from_trace(both)
    ids = [s.trajectory_id for s in driver.specs]
    assert len(ids) == len(set(ids)) and any(i.endswith("@other") for i in ids)
    out = tmp_path / "sim"
    args = ["simulate", "--trace", str(both), "--arrivals", "--engines", "2", "--out", str(out)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "metrics.json").read_text())["trajectories_completed"] == len(ids)


def test_a_bad_trace_leaves_the_earlier_run_outputs_as_they_were(azure_trace, tmp_path):
    # Found by review: the earlier run's telemetry and metrics were removed before the
    # trace was read, so a bad --trace lost them.
    import pyarrow as pa

    out = tmp_path / "sim"
    args = ["simulate", "--trajectories", "8", "--engines", "2", "--out", str(out), "--json"]
    assert runner.invoke(app, args).exit_code == 0
    before = {name: (out / name).read_bytes() for name in ("telemetry.parquet", "metrics.json")}
    table, _ = read_telemetry(azure_trace)
    column = table.column_names.index("context_tokens")
    tokens = table.column(column).to_pylist()
    tokens[3] = -7
    bad = tmp_path / "bad.parquet"
    write_parquet(table.set_column(column, "context_tokens", pa.array(tokens, pa.int32())), bad)
    result = runner.invoke(app, ["simulate", "--trace", str(bad), "--out", str(out)])
    assert result.exit_code != 0 and "context_tokens" in result.output
    assert {name: (out / name).read_bytes() for name in before} == before
