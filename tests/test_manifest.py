"""Runs that end early say so, and readers refuse (or flag) their telemetry."""

from __future__ import annotations

import json

import pytest

from prorsa.errors import InputError, PartialRunError
from prorsa.telemetry import Recorder, events_to_table, read_telemetry, write_parquet
from prorsa.telemetry.manifest import (
    MANIFEST_NAME,
    check_complete,
    mark_table,
    read_manifest,
    run_manifest,
)
from tests.conftest import make_two_turn_events


def _record_run(out, *, trajectories: int, finished: int, interrupt: bool) -> None:
    """A run that records ``trajectories`` and ends ``finished`` of them, then maybe Ctrl-C."""
    with (
        run_manifest(out, command="rollout", run_id="r", planned=trajectories) as run,
        Recorder(out / "telemetry", run_id="r") as rec,
    ):
        for i in range(trajectories):
            rec.record(0.0, f"t{i}", "traj_start")
            rec.record(1.0, f"t{i}", "prefill_start", context_tokens=10, new_tokens=10)
        for i in range(finished):
            rec.record(2.0, f"t{i}", "traj_end")
        run.counts["trajectories_started"] = trajectories
        run.counts["trajectories_completed"] = finished
        if interrupt:
            raise KeyboardInterrupt


def test_an_interrupted_run_is_marked_and_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _record_run(tmp_path, trajectories=12, finished=4, interrupt=True)
    manifest = read_manifest(tmp_path)
    assert manifest.status == "interrupted" and "SIGINT" in manifest.cause
    assert manifest.counts == {
        "trajectories_planned": 12,
        "trajectories_started": 12,
        "trajectories_completed": 4,
    }
    for path in (tmp_path, tmp_path / "telemetry"):
        with pytest.raises(PartialRunError, match="interrupted") as info:
            check_complete(path)
        assert "8 of 12 trajectories have no traj_end" in str(info.value)
        assert "--allow-partial" in info.value.hint
    flagged = check_complete(tmp_path / "telemetry", allow_partial=True)
    assert not flagged.complete and flagged.status == "interrupted"
    assert flagged.unfinished_trajectories == 8


def test_a_complete_run_passes(tmp_path):
    _record_run(tmp_path, trajectories=3, finished=3, interrupt=False)
    assert read_manifest(tmp_path).status == "complete"
    result = check_complete(tmp_path / "telemetry")
    assert result.complete and result.trajectories == 3


def test_fewer_completed_than_planned_is_a_failed_run(tmp_path):
    _record_run(tmp_path, trajectories=5, finished=5, interrupt=False)
    with run_manifest(tmp_path, command="rollout", planned=6) as run:
        run.counts["trajectories_completed"] = 5
    manifest = read_manifest(tmp_path)
    assert manifest.status == "failed" and "only 5 of 6" in manifest.cause


def test_an_exception_is_a_failed_run_with_its_cause(tmp_path):
    with pytest.raises(RuntimeError), run_manifest(tmp_path, command="simulate"):
        raise RuntimeError("engine 3 died")
    manifest = read_manifest(tmp_path)
    assert manifest.status == "failed" and manifest.cause == "RuntimeError: engine 3 died"
    assert manifest.ended_at is not None


def test_a_killed_run_stays_running_which_is_partial(tmp_path):
    manager = run_manifest(tmp_path, command="rollout")
    manager.__enter__()  # the process dies here: no exit runs
    assert read_manifest(tmp_path).status == "running"
    write_parquet(events_to_table(make_two_turn_events()), tmp_path / "telemetry.parquet")
    with pytest.raises(PartialRunError, match="says running"):
        check_complete(tmp_path / "telemetry.parquet")


def test_event_level_checks_without_a_manifest(tmp_path):
    events = make_two_turn_events()
    complete = events_to_table(events)
    assert check_complete(complete).complete
    cut = events_to_table(events[:-1])  # no traj_end
    with pytest.raises(PartialRunError, match="1 of 1 trajectories have no traj_end"):
        check_complete(cut)
    ended_early = events_to_table(
        [*events[:-1], _with_detail(events[-1], '{"status":"interrupted"}')]
    )
    with pytest.raises(PartialRunError, match="ended interrupted or failed"):
        check_complete(ended_early)
    assert check_complete(cut.to_pandas(), allow_partial=True).unfinished_trajectories == 1


def _with_detail(event, detail):
    from dataclasses import replace

    return replace(event, detail=detail)


def test_status_travels_with_the_table(tmp_path):
    from prorsa.telemetry.manifest import RunManifest

    manifest = RunManifest(command="rollout")
    manifest.finish("interrupted", "SIGTERM")
    table = mark_table(events_to_table(make_two_turn_events()), manifest)
    write_parquet(table, tmp_path / "elsewhere.parquet")
    with pytest.raises(PartialRunError, match=r"metadata says interrupted \(SIGTERM\)"):
        check_complete(tmp_path / "elsewhere.parquet")


def test_unrelated_or_broken_manifests(tmp_path):
    write_parquet(events_to_table(make_two_turn_events()), tmp_path / "t.parquet")
    (tmp_path / "manifest.json").write_text('{"name": "a model card"}')  # not a run manifest
    assert check_complete(tmp_path / "t.parquet").complete
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"status": "finished?"}))
    with pytest.raises(InputError, match="status must be one of"):
        check_complete(tmp_path / "t.parquet")
    read_back, _ = read_telemetry(tmp_path / "t.parquet")
    assert read_back.num_rows == 16
