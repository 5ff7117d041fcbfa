"""A rollout that ends early never looks finished; a lost engine is recorded, not listed.

``run_rollout`` runs here on fake engines (milliseconds, no Ray): the fleet, the
tokenizer and the engines are stand-ins, everything else (agent loop, router, controller,
recorder, manifest, outputs) is the real code path.
"""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from prorsa.errors import OutputError, PartialRunError
from prorsa.runtime.ray import rollout
from prorsa.runtime.ray.agent import AgentLoop
from prorsa.runtime.ray.pools import RolePools
from prorsa.runtime.ray.rollout import RolloutInterrupted, run_rollout
from prorsa.runtime.ray.rollout_config import RolloutConfig
from prorsa.runtime.ray.rollout_metrics import rollout_metrics
from prorsa.runtime.ray.router import PDRouter, RouterConfig
from prorsa.runtime.ray.specs import TokenSource, fit_specs
from prorsa.runtime.ray.tools import make_tools
from prorsa.telemetry import Recorder, read_telemetry
from prorsa.telemetry.manifest import check_complete, read_manifest
from tests.runtime.fakes import FakeEngine


class _Chars:
    """A tokenizer stand-in: one token per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 500 + 3 for c in text]


class LoadFake(FakeEngine):
    """Answers ``load`` like an engine actor, so the load monitor sees a dead one."""

    async def load(self) -> dict:
        self._check()
        return {"kv_capacity_tokens": 4096, "kv_used_tokens": 0, "kv_usage": 0.0,
                "running": 0, "waiting": 0, "steps": 1}  # fmt: skip


class FakeFleet:
    """What ``run_rollout`` needs of an ``EngineFleet``."""

    def __init__(self, n: int, step_s: float = 0.002) -> None:
        self.engines = [LoadFake(i, step_s) for i in range(n)]
        self.clients = {e.engine_id: e for e in self.engines}
        self.start_s = 0.0

    def pools(self) -> RolePools:
        return RolePools(self.engines, dict.fromkeys(self.clients, "colocated"))


@pytest.fixture(autouse=True)
def char_tokenizer(monkeypatch):
    monkeypatch.setattr(rollout, "_tokenizer", lambda model: _Chars())


def config(tmp_path, **changes) -> RolloutConfig:
    base = dict(
        engines=3,
        profile="cpu-tiny-llama-tp1",
        scenario="search",
        trajectories=6,
        group_size=3,
        max_tokens=8,
        max_turns=4,
        max_model_len=600,
        tool_time_scale=0.01,
        interval_s=0.05,
        min_dwell_s=0.0,
        drain_timeout_s=0.05,
        monitor_interval_s=0.02,
    )
    return RolloutConfig.of(str(tmp_path / "model"), **{**base, **changes})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stopped_rollout_is_marked_interrupted_and_readers_refuse_it(tmp_path, signum):
    # Two in flight at a time; the stop comes when the first trajectory ends, so some
    # are mid-way (interrupted) and some never started.
    cfg = config(tmp_path, mode="async", max_in_flight=2, tool_time_scale=0.1)
    out = tmp_path / "out"

    def progress(done: int, total: int) -> None:
        if done == 1:
            signal.raise_signal(signum)

    with pytest.raises(RolloutInterrupted) as stopped:
        run_rollout(cfg, out, fleet=FakeFleet(3), progress=progress)
    assert isinstance(stopped.value, KeyboardInterrupt)  # the CLI exits 130 for both
    name = signal.Signals(signum).name
    manifest = read_manifest(out)
    assert manifest.status == "interrupted" and manifest.cause == f"stopped by {name}"
    counts = manifest.counts
    assert counts["trajectories_planned"] == 6
    assert counts["trajectories_completed"] >= 1 and counts["trajectories_interrupted"] >= 1
    assert counts["trajectories_started"] < 6  # the rest never began

    # Every trajectory that began has a traj_end; the cut ones say so and how far they got.
    table, _ = read_telemetry(out / "telemetry.parquet")
    ends = [json.loads(r["detail"]) for r in table.to_pylist() if r["kind"] == "traj_end"]
    assert len(ends) == counts["trajectories_started"]
    cut = [d for d in ends if d.get("status") == "interrupted"]
    assert len(cut) == counts["trajectories_interrupted"]
    assert all(d["turns"] < d["planned_turns"] for d in cut)
    assert all(d["turns"] == d["planned_turns"] and "status" not in d for d in ends if d not in cut)

    # Readers refuse it: by the manifest beside it, by the table's own metadata, and
    # (an external copy with neither) by the interrupted traj_end rows.
    with pytest.raises(PartialRunError, match="interrupted"):
        check_complete(out / "telemetry.parquet")
    with pytest.raises(PartialRunError, match="interrupted"):
        check_complete(table)
    bare = table.replace_schema_metadata({})
    with pytest.raises(PartialRunError, match="ended interrupted"):
        check_complete(bare)
    from prorsa.forecast.dataset import build_dataset

    with pytest.raises(PartialRunError):
        build_dataset(table, horizons=[0.2], tick_s=0.1)
    assert build_dataset(table, horizons=[0.2], tick_s=0.1, allow_partial=True).meta["partial_runs"]
    # The metrics function flags it and counts only whole trajectories as completed.
    m = rollout_metrics(bare, "async")
    assert m["run_complete"] is False
    assert m["trajectories_completed"] == counts["trajectories_completed"]
    written = json.loads((out / "metrics.json").read_text())
    assert written["run_status"] == "interrupted" and written["run_complete"] is False
    assert len((out / "specs.jsonl").read_text().splitlines()) == 6
    # The run's own signal handlers are gone again.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_complete_rollout_is_marked_complete(tmp_path):
    out = tmp_path / "out"
    result = run_rollout(config(tmp_path), out, fleet=FakeFleet(3))
    assert result.errors == [] and result.stopped_by is None
    assert read_manifest(out).status == "complete"
    assert check_complete(out / "telemetry.parquet").complete
    assert result.metrics["run_complete"] is True and result.metrics["run_status"] == "complete"


@pytest.mark.parametrize("freeze", [True, False])
def test_the_driver_freezes_its_start_up_heap_only_when_configured(tmp_path, freeze):
    import gc

    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(gc.get_freeze_count())  # called on the driver while trajectories run

    before = gc.get_freeze_count()
    cfg = config(tmp_path, freeze_startup_heap=freeze)
    run_rollout(cfg, tmp_path / "out", fleet=FakeFleet(3), progress=progress)
    assert seen and all((n > before) == freeze for n in seen)
    assert gc.get_freeze_count() == before  # undone when the run ends


def test_killed_engine_is_recorded_and_left_out_of_final_roles(tmp_path):
    fleet = FakeFleet(3)
    out = tmp_path / "out"

    def progress(done: int, total: int) -> None:
        if done == 0:  # engines are up, no trajectory has started
            fleet.engines[2].kill()

    cfg = config(tmp_path, policy="static", policy_params={"prefill_gpus": 1})
    result = run_rollout(cfg, out, fleet=fleet, progress=progress)
    m = result.metrics
    assert result.errors == [] and m["trajectories_completed"] == 6
    assert m["initial_roles"] == ["prefill", "decode", "decode"]
    assert m["engines_lost"] == [2]
    assert set(m["final_roles"]) == {0, 1}
    assert 2 not in m["kv_capacity_tokens"]
    allocations = [
        (r["engine_id"], json.loads(r["detail"]))
        for r in result.telemetry.to_pylist()
        if r["kind"] == "allocation"
    ]
    start, *lost = allocations  # the run opens with its starting allocation
    assert start == (-1, {"gpus": {"colocated": 0, "decode": 2, "prefill": 1}, "reason": "start"})
    assert len(lost) == 1 and lost[0][0] == 2
    detail = lost[0][1]
    cause = detail.pop("cause")
    assert detail == {"gpus": {"colocated": 0, "decode": 1, "prefill": 1},
                      "reason": "engine_lost", "role": "decode"}  # fmt: skip
    assert cause.startswith(("request failed", "load poll failed"))  # the real cause
    manifest = read_manifest(out)
    assert manifest.status == "complete" and manifest.counts["engines_lost"] == 1


def test_output_is_checked_before_anything_starts(tmp_path, monkeypatch):
    def no_engines(*_a, **_k):
        raise AssertionError("engines started before the output was checked")

    monkeypatch.setattr(rollout, "start_fleet", no_engines)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = config(tmp_path)
    for bad in (model, tmp_path):  # the model folder itself, or a folder holding it
        with pytest.raises(OutputError, match="is also an input"):
            run_rollout(cfg, bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        run_rollout(cfg, tmp_path / "file")
    assert (model / "config.json").read_text() == "{}"


def test_agent_loop_ends_a_cancelled_trajectory_as_interrupted(tmp_path):
    from prorsa.workload import get_scenario

    engines = [FakeEngine(i, 0.01) for i in range(2)]
    recorder = Recorder(tmp_path / "tel", run_id="cancel")
    router = PDRouter(
        RolePools(engines, {0: "prefill", 1: "decode"}), RouterConfig(), recorder=recorder
    )
    tools = make_tools()
    agent = AgentLoop(router, TokenSource(_Chars(), tools["search"].index.documents), tools)
    raw = get_scenario("search").sample(8, 0, group_size=1)
    fitted = fit_specs(raw, max_context_tokens=600, max_output_tokens=8, tool_time_scale=0.01)
    spec = next(s for s in fitted if s.num_turns >= 3)

    async def run():
        task = asyncio.ensure_future(agent.run(spec))
        # Stop it once its second turn reached the decode engine.
        await router.pools.wait_until(lambda: len(engines[1].calls) >= 2, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    recorder.close()
    table, _ = read_telemetry(tmp_path / "tel")
    (end,) = [json.loads(r["detail"]) for r in table.to_pylist() if r["kind"] == "traj_end"]
    assert end["status"] == "interrupted" and end["error"] == "CancelledError"
    assert 1 <= end["turns"] < end["planned_turns"] == spec.num_turns


def test_start_fleet_builds_engines_from_the_composed_config(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    import ray

    from prorsa.runtime.ray.cluster import EngineFleet

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(EngineFleet, "start", classmethod(lambda cls, spec: spec))
    cfg = config(tmp_path, seed=7, max_model_len=512, connector="example")
    spec, started = rollout.start_fleet(cfg, ["prefill", "decode", "decode"], tmp_path)
    assert not started and list(spec.roles) == ["prefill", "decode", "decode"]
    engine = spec.engine
    assert (engine.seed, engine.max_model_len, engine.connector) == (7, 512, "example")
    assert engine.max_num_seqs == 16  # the CPU profile's batch limit (cluster.max_batch unset)
    cfg = cfg.with_changes(max_batch=4)
    assert rollout.start_fleet(cfg, ["colocated"] * 3, tmp_path)[0].engine.max_num_seqs == 4


def test_a_dynamic_policy_keeps_deciding_after_an_engine_is_lost(tmp_path, caplog):
    # Found by review: a split policy kept sizing for three engines after one died, each
    # tick was refused ("does not add up"), and the first refusal stopped the control
    # loop for the rest of the run without a word in its results.
    fleet = FakeFleet(3)
    out = tmp_path / "out"

    def progress(done: int, total: int) -> None:
        if done == 0:
            fleet.engines[2].kill()

    cfg = config(tmp_path, policy="threshold")
    with caplog.at_level("WARNING"):
        result = run_rollout(cfg, out, fleet=fleet, progress=progress)
    assert result.errors == [] and result.metrics["trajectories_completed"] == 6
    assert result.metrics["engines_lost"] == [2]
    assert "does not add up" not in caplog.text and "control tick failed" not in caplog.text
    assert "the policy was sized for 3: resizing it" in caplog.text


class HangingFake(LoadFake):
    """Once ``hang()`` is called, takes legs and never steps or answers them again (a
    hung GPU: no call fails); its load answers say so."""

    hung = False

    def hang(self) -> None:
        self.hung = True

    async def generate_stream(self, *args, **kwargs):
        if self.hung:
            await asyncio.Event().wait()
        async for item in super().generate_stream(*args, **kwargs):
            yield item

    async def load(self) -> dict:
        answer = await super().load()
        return {**answer, "paused": False, "in_flight": len(self.in_flight) + self.hung}


def test_an_engine_that_hangs_is_found_and_its_turns_go_elsewhere(tmp_path):
    # Found by review: the rollout's legs had no timeout and its monitor no stall check,
    # so a turn on a hung engine was never answered and the run never ended.
    fleet = FakeFleet(3)
    fleet.engines[2] = HangingFake(2, 0.002)
    fleet.clients[2] = fleet.engines[2]

    def progress(done: int, total: int) -> None:
        if done == 0:
            fleet.engines[2].hang()

    cfg = config(tmp_path, policy="colocate", engine_stall_timeout_s=0.3)
    result = asyncio.run(
        asyncio.wait_for(asyncio.to_thread(run_rollout, cfg, tmp_path / "out", fleet=fleet,
                                           progress=progress), 60)
    )  # fmt: skip
    assert result.errors == [] and result.metrics["trajectories_completed"] == 6
    assert result.metrics["engines_lost"] == [2]


def test_a_reused_fleet_in_other_roles_is_set_to_the_runs_roles(tmp_path):
    # Found by review: set-up switched engines in id order, so engine 0 (decode) could
    # not go to prefill while engines 1-2 were still prefill (no decode side left).
    class Reused(FakeFleet):
        def pools(self) -> RolePools:
            return RolePools(self.engines, {0: "decode", 1: "prefill", 2: "prefill"})

    cfg = config(tmp_path, policy="static", policy_params={"prefill_gpus": 1})
    result = run_rollout(cfg, tmp_path / "out", fleet=Reused(3))
    assert result.errors == [] and result.metrics["trajectories_completed"] == 6
    assert result.metrics["initial_roles"] == ["prefill", "decode", "decode"]
