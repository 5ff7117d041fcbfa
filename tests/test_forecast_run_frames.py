"""Datasets built one run at a time: the same dataset whatever shape the telemetry comes in,
clear errors, and the recipe's telemetry streamed to Parquet run by run."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from prorsa.errors import InputError
from prorsa.forecast import build_dataset
from prorsa.forecast.run_frames import RunFrames
from prorsa.forecast.shipping import SimRun, concat_tables, simulate_runs, simulate_to_parquet
from prorsa.forecast.targets import event_frame
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.telemetry import events_to_table
from prorsa.telemetry.schema import ARROW_SCHEMA, conform
from prorsa.workload.config import WorkloadConfig
from tests.conftest import make_two_turn_events
from tests.sim_helpers import random_specs, run


def _relabel(table: pa.Table, run_id: str) -> pa.Table:
    ids = pa.array([run_id] * table.num_rows, pa.string())
    field = pa.field("run_id", pa.string(), nullable=False)
    return table.set_column(table.schema.get_field_index("run_id"), field, ids)


@pytest.fixture(scope="module")
def runs() -> list[pa.Table]:
    """Four simulated runs (allocation and role-switch events included) whose ids do not
    sort in the order given, so tables and run order interleave."""
    out = []
    for seed, run_id in enumerate(["d", "a", "c", "b"]):
        specs = random_specs(20, seed=seed, turns=(2, 5))
        out.append(_relabel(run(specs, "threshold", slots=3, seed=seed).telemetry, run_id))
    return out


def test_the_dataset_is_the_same_whatever_the_shape_of_the_telemetry(runs, tmp_path):
    one_per_run = build_dataset(runs, horizons=[1, 5])
    together = build_dataset([concat_tables([runs[0], runs[2]]), runs[1], runs[3]], horizons=[1, 5])
    as_pandas = build_dataset([t.to_pandas() for t in runs], horizons=[1, 5])
    # Read back with the string ids dictionary-encoded (what shipping does for run ids).
    # One write per run, as shipping streams them: each row group brings its dictionaries.
    with pq.ParquetWriter(tmp_path / "all.parquet", runs[0].schema) as writer:
        for table in runs:
            writer.write_table(table.replace_schema_metadata(runs[0].schema.metadata))
    encoded = pq.read_table(tmp_path / "all.parquet", read_dictionary=["run_id", "task"])
    assert pa.types.is_dictionary(encoded.schema.field("run_id").type)
    assert encoded.column("run_id").num_chunks > 1
    from_parquet = build_dataset(encoded, horizons=[1, 5])
    assert one_per_run.runs == ["a", "b", "c", "d"]
    hashes = {d.data_hash() for d in (one_per_run, together, as_pandas, from_parquet)}
    assert len(hashes) == 1
    assert one_per_run.meta["tasks"] == together.meta["tasks"] == from_parquet.meta["tasks"]
    assert one_per_run.meta["tasks"] == as_pandas.meta["tasks"]
    assert together.sources == one_per_run.sources == from_parquet.sources


def test_conform_can_keep_dictionary_encoded_strings(runs):
    encoded = runs[0].set_column(1, "run_id", pc.dictionary_encode(runs[0].column("run_id")))
    kept = conform(encoded, keep_dictionaries=True)
    assert pa.types.is_dictionary(kept.schema.field("run_id").type)
    assert kept.column("run_id").cast(pa.string()).equals(runs[0].column("run_id"))
    assert conform(encoded).schema.equals(ARROW_SCHEMA, check_metadata=False)


def test_a_run_frame_is_that_run_of_the_whole_tables_frame(runs):
    table = concat_tables([runs[0], runs[1]])
    frames = RunFrames(table, "both.parquet")
    assert frames.run_ids == ["a", "d"]
    whole = event_frame(table, keep_allocations=True)
    for run_id in frames.run_ids:
        expected = whole[whole["run_id"] == run_id].reset_index(drop=True)
        got = frames.frame(run_id).reset_index(drop=True)
        cols = [c for c in expected.columns if c != "_order"]  # its position in the input
        assert got[cols].equals(expected[cols])
    # Cluster events never make a task: the pairs are the trajectories' own.
    assert set(frames.task_pairs["trajectory_id"]) == set(whole["trajectory_id"]) - {""}


def test_bad_tables_name_themselves(runs):
    with pytest.raises(InputError, match="empty") as err:
        RunFrames(events_to_table([]), "empty.parquet")
    assert err.value.source == "empty.parquet"
    cluster = pa.array([not t for t in runs[0].column("trajectory_id").to_pylist()])
    assert 0 < pc.sum(cluster).as_py() < runs[0].num_rows
    with pytest.raises(InputError, match="no trajectory events") as err:
        RunFrames(runs[0].filter(cluster), "cluster.parquet")
    assert err.value.source == "cluster.parquet"
    table = events_to_table(make_two_turn_events("a"))
    times = table.column("time").to_pylist()
    times[1] = math.nan
    broken = table.set_column(0, table.schema.field("time"), pa.array(times, pa.float64()))
    with pytest.raises(InputError, match="non-finite event time") as err:
        build_dataset([events_to_table(make_two_turn_events("b")), broken], names=["ok", "bad"])
    assert err.value.source == "bad" and err.value.field == "time"


def _sim_run(seed: int) -> SimRun:
    work = WorkloadConfig(scenario="math-tool", mode="sync", seed=seed)
    return SimRun.at_load(2, work, ClusterConfig(num_slots=2), ControlConfig(policy="static"))


def test_runs_stream_to_one_parquet_file(tmp_path):
    plan = [_sim_run(1), _sim_run(2)]
    path = tmp_path / "part.parquet"
    events = simulate_to_parquet(plan, path)
    written = pq.read_table(path)
    expected = concat_tables(simulate_runs(plan))
    assert events == written.num_rows == expected.num_rows
    assert written.equals(expected) and written.schema.metadata == expected.schema.metadata
    # A run that fails leaves the earlier file as it was and no partial one.
    before = path.read_bytes()

    class Failing:
        run_id = "boom"

        def simulate(self):
            raise RuntimeError("simulator crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        simulate_to_parquet([_sim_run(3), Failing()], path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.parquet"]
    with pytest.raises(InputError, match="no runs"):
        simulate_to_parquet([], tmp_path / "none.parquet")
