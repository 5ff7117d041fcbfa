"""The sweep runner: streamed, resumable results; Ray tasks; no worker outlives a SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell, cell_of
from prorsa.experiments.compare import CompareConfig, run_compare
from prorsa.experiments.sweep import Sweep, cell_key, run_sweep
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.workload.config import WorkloadConfig

REPO = Path(__file__).resolve().parents[1]


def _cell(seed: int = 0, **changes) -> Cell:
    base = Cell.of(
        scenario="search",
        mode="sync",
        policy="colocate",
        seed=seed,
        num_slots=4,
        profile="h200-qwen2.5-7b-tp1",
        trajectories=16,
        group_size=4,
        series=False,
    )
    return base.changed(**changes)


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (start-up costs seconds); sweeps reuse it."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _counting(calls: list[int]):
    """``run_cell`` that notes each cell's seed in ``calls`` as it runs."""

    def counted(cell):
        from prorsa.experiments.cells import run_cell

        calls.append(cell.seed)
        return run_cell(cell)

    return counted


def test_cell_key_is_stable_and_covers_every_field():
    assert cell_key(_cell()) == cell_key(_cell())
    keys = {
        cell_key(c)
        for c in (
            _cell(),
            _cell(seed=1),
            _cell(policy="static"),
            _cell(policy_params={"prefill_gpus": 1}),
            _cell(local_prefill_threshold=64),
            _cell(tool_scale=2.0),
            _cell(interval_s=0.5),
        )
    }
    assert len(keys) == 7


def test_resumed_sweep_skips_finished_cells_and_reruns_a_cut_line(tmp_path):
    calls: list[int] = []
    counted = _counting(calls)

    path = tmp_path / "cells.jsonl"
    first = run_sweep([_cell(s) for s in range(3)], results_path=path, workers=1, fn=counted)
    assert calls == [0, 1, 2]
    assert len(path.read_text().splitlines()) == 3
    # A kill in the middle of a write leaves a line without its end.
    with path.open("a") as f:
        f.write('{"key": "' + cell_key(_cell(3)) + '", "result": {"cell"')
    calls.clear()
    with Sweep(results_path=path, workers=1, fn=counted) as sweep:
        again = sweep.map([_cell(s) for s in range(5)])
    assert calls == [3, 4]  # 0-2 read back; 3 was cut short, so it runs again
    assert (sweep.reused, sweep.ran) == (3, 2)
    assert again[:3] == first
    assert [cell_of(r).seed for r in again] == [0, 1, 2, 3, 4]
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines if line.endswith("}}"))
    calls.clear()
    run_sweep([_cell(s) for s in range(5)], results_path=path, workers=1, fn=counted)
    assert calls == []
    calls.clear()
    run_sweep([_cell(0)], results_path=path, workers=1, fn=counted, resume=False)
    assert calls == [0] and len(path.read_text().splitlines()) == 1


@pytest.mark.ray
def test_ray_sweep_streams_each_cell_as_it_finishes(tmp_path, ray_local):
    path = tmp_path / "cells.jsonl"
    seen = []

    def progress(done: int, total: int) -> None:
        # Each finished cell is on disk before progress reports it.
        seen.append((done, total, len(path.read_text().splitlines()) if path.exists() else 0))

    cells = [_cell(s) for s in range(4)]
    with Sweep(results_path=path, workers=2) as sweep:
        assert sweep.backend == "ray"
        results = sweep.map(cells, progress)
    assert ray_local.is_initialized()  # a session the caller started is left running
    assert [cell_of(r).seed for r in results] == [0, 1, 2, 3]
    assert seen[-1] == (4, 4, 4)
    assert all(lines >= done for done, _, lines in seen)
    inline = run_sweep(cells, workers=1)
    assert [r["objective"] for r in results] == [r["objective"] for r in inline]


@pytest.mark.ray
def test_project_errors_from_workers_keep_their_message(ray_local):
    bad = _cell(policy="best-static")  # needs prefill_gpus
    with pytest.raises(ConfigError, match="prefill_gpus") as info:
        run_sweep([_cell(0), bad], workers=2)
    assert info.value.hint and "compare" in info.value.hint


def test_process_pool_backend_gives_the_same_results():
    cells = [_cell(s) for s in range(3)]
    pooled = run_sweep(cells, workers=2, backend="process")
    assert [r["objective"] for r in pooled] == [r["objective"] for r in run_sweep(cells, workers=1)]


def test_compare_resumes_from_its_cells_file(tmp_path):
    cfg = CompareConfig(
        workloads=[("search", None)],
        policies=["colocate", "best-static", "threshold"],
        seeds=2,
        work=WorkloadConfig(trajectories=16, group_size=4),
        cluster=ClusterConfig(num_slots=4),
        workers=1,
        cells_path=tmp_path / "cells.jsonl",
    )
    first = run_compare(cfg)
    assert first["cells"]["run"] == 2 * 3 + 3  # matrix + the three static splits
    again = run_compare(cfg)
    assert (again["cells"]["run"], again["cells"]["reused"]) == (0, first["cells"]["run"])
    assert again["summary"] == first["summary"]
    assert (
        again["best_static"]["search/sync"]["prefill_slots"]
        == (first["best_static"]["search/sync"]["prefill_slots"])
    )


def test_bad_sweep_options_are_config_errors():
    with pytest.raises(ConfigError, match="workers"):
        Sweep(workers=-1)
    with pytest.raises(ConfigError, match="backend"):
        Sweep(backend="threads")


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow  # a fresh Ray instance in a subprocess: 15-40 s on 2 busy cores
@pytest.mark.ray
def test_sigterm_on_compare_leaves_no_child_alive(tmp_path):
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("ray")
    out = tmp_path / "cmp"
    cmd = [
        sys.executable,
        "-m",
        "prorsa.cli.main",
        "compare",
        "--scenario",
        "swe",
        "--policies",
        "colocate,threshold",
        "--engines",
        "8",
        "--trajectories",
        "512",
        "--seeds",
        "6",
        "--workers",
        "2",
        "--out",
        str(out),
        "--json",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ)
    )
    try:
        # Wait until Ray workers are running cells (a worker's title is "ray::<task>").
        deadline = time.monotonic() + 90
        children: list = []
        while time.monotonic() < deadline and proc.poll() is None:
            children = _descendants(proc.pid)
            busy = [c for c in children if _cmdline(c).startswith("ray::_worker_call")]
            if busy:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert busy, "no Ray worker started within 90 s"
        children = _descendants(proc.pid)
        assert len(children) >= 3  # Ray's own processes and the workers
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Everything, the command itself included, is gone within 5 s of the signal.
        assert proc.wait(timeout=5) == 130  # ended like Ctrl-C
        left_s = max(5.0 - (time.monotonic() - signalled), 0.0)
        _, alive = psutil.wait_procs(children, timeout=left_s)
        alive = [p for p in alive if _alive(p)]
        assert not alive, [f"{p.pid}: {_cmdline(p)}" for p in alive]
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(process) -> str:
    try:
        return " ".join(process.cmdline())
    except Exception:  # it exited meanwhile
        return ""


def test_cell_reads_back_from_its_dict_and_from_old_flat_results():
    cell = _cell(3, layouts={"prefill": "tp1", "decode": "tp2", "colocated": "tp2"})
    cell = cell.changed(policy="static", policy_params={"prefill_gpus": 2}, tool_scale=2.0)
    assert Cell.from_dict(json.loads(json.dumps(cell.to_dict()))) == cell
    assert Cell.from_dict(cell.to_dict()).key() == cell.key() == cell_key(cell)
    # A line of a results file written before the cell composed the run configs.
    flat = {
        "scenario": "search",
        "trace": None,
        "mode": "sync",
        "policy": "static",
        "seed": 3,
        "engines": 4,
        "profile": "h200-qwen2.5-7b-tp1",
        "trajectories": 16,
        "group_size": 4,
        "max_in_flight": 128,
        "policy_params": {"prefill_gpus": 2},
        "forecaster": None,
        "cluster_overrides": {"layouts": {"prefill": "tp1", "decode": "tp2", "colocated": "tp2"}},
        "interval_s": 1.0,
        "min_dwell_s": 10.0,
        "series": False,
        "tool_scale": 2.0,
        "growth_scale": 1.0,
        "record": True,
    }
    assert Cell.from_dict(flat) == cell
    assert cell_of({"cell": flat}).cluster.role_tp["decode"] == 2


def test_a_results_file_of_flat_cells_is_run_again(tmp_path):
    # Flat cells are written by code before the simulator entered the key: their
    # results may come from another simulator, so none is reused (found by review).
    cell = _cell(2)
    old = run_sweep([cell], workers=1)[0]
    flat = {
        "scenario": "search",
        "trace": None,
        "mode": "sync",
        "policy": "colocate",
        "seed": 2,
        "engines": 4,
        "profile": "h200-qwen2.5-7b-tp1",
        "trajectories": 16,
        "group_size": 4,
        "series": False,
    }
    path = tmp_path / "cells.jsonl"
    path.write_text(json.dumps({"key": "0123456789abcdef", "result": {**old, "cell": flat}}) + "\n")

    with Sweep(results_path=path, workers=1) as sweep:
        (again,) = sweep.map([cell])
    assert (sweep.reused, sweep.ran) == (0, 1) and again["objective"] == old["objective"]


def test_cell_fields_are_named_once_and_checked():
    cell = _cell()
    assert (cell.workload, cell.mode, cell.policy, cell.seed) == ("search", "sync", "colocate", 0)
    assert Cell.of(trace="t.parquet").work.scenario is None  # a trace replaces the scenario
    with pytest.raises(ConfigError, match="no field 'engines'") as info:
        cell.changed(engines=8)
    assert "num_slots" in info.value.hint
    with pytest.raises(ConfigError, match="no field 'seeds'") as info:
        cell.changed(seeds=2)
    assert "seed" in info.value.hint


def _forecast_threads_env(_cell) -> dict:
    import os

    return {"threads": os.environ.get("PRORSA_FORECAST_THREADS")}


def test_sweep_workers_forecast_on_one_thread_unless_told(monkeypatch):
    from prorsa.experiments import sweep

    monkeypatch.setenv("PRORSA_FORECAST_THREADS", "x")  # restored after the test
    monkeypatch.delenv("PRORSA_FORECAST_THREADS")
    assert sweep._worker_call(_forecast_threads_env, None) == ("ok", {"threads": "1"})
    monkeypatch.setenv("PRORSA_FORECAST_THREADS", "2")
    assert sweep._worker_call(_forecast_threads_env, None) == ("ok", {"threads": "2"})


def test_sweep_names_the_forecast_threads_variable_the_forecasters_read():
    from prorsa.experiments import sweep
    from prorsa.forecast import threads

    assert sweep.FORECAST_THREADS_ENV == threads.ENV


def test_cell_key_covers_the_simulator_and_the_trained_model(tmp_path, monkeypatch):
    # Found by review: results of other simulator code, profiles or a retrained model
    # were reused on resume (the key held the package version, fixed at 0.1.0).
    import prorsa.runtime.sim.version as version
    from prorsa.experiments.cells import Cell

    cell = Cell.from_dict(_cell().to_dict())
    before = cell.key()
    monkeypatch.setattr(version, "simulator_hash", lambda: "another simulator")
    assert cell.key() != before and cell_key(cell) == cell.key()
    model = tmp_path / "model"
    model.mkdir()
    (model / "manifest.json").write_text('{"data_hash": "a"}')
    with_model = dataclasses.replace(
        cell, control=dataclasses.replace(cell.control, forecaster=str(model))
    )
    first = with_model.key()
    (model / "manifest.json").write_text('{"data_hash": "b"}')  # retrained
    assert with_model.key() != first


def test_a_recorded_failure_runs_again_on_resume(tmp_path):
    calls: list[int] = []
    counted = _counting(calls)

    path = tmp_path / "cells.jsonl"
    failed = {"cell": _cell(0).to_dict(), "metrics": {}, "objective": "inf", "error": "boom"}
    path.write_text(json.dumps({"key": cell_key(_cell(0)), "result": failed}) + "\n")
    results = run_sweep([_cell(0)], results_path=path, workers=1, fn=counted)
    assert calls == [0] and "error" not in results[0]


def test_an_infeasible_draw_is_kept_on_resume(tmp_path):
    # Found by review: a layout that cannot hold a draw was simulated again on every
    # resume, to fail the same way.
    calls: list[int] = []
    counted = _counting(calls)
    path = tmp_path / "cells.jsonl"
    lines = []
    for seed, extra in ((0, {"infeasible": True}), (1, {})):  # the older form: named only
        failed = {"cell": _cell(seed).to_dict(), "metrics": {}, "objective": "inf",
                  "error": "CapacityError: trajectory t reaches 9 tokens", **extra}  # fmt: skip
        lines.append(json.dumps({"key": cell_key(_cell(seed)), "result": failed}))
    path.write_text("\n".join(lines) + "\n")
    results = run_sweep([_cell(0), _cell(1)], results_path=path, workers=1, fn=counted)
    assert calls == [] and all(r["error"].startswith("CapacityError") for r in results)


def test_a_replay_cell_has_the_same_key_in_another_checkout(tmp_path, monkeypatch):
    # Found by review: the trace's absolute path was in the key, so a second checkout
    # ran every replay cell again; datasets/ is hashed by content with the simulator.
    import shutil

    from prorsa.workload.scenarios import datasets_dir

    def replay(folder):
        cell = _cell()
        trace = str(folder / "traces" / "swe-agent.parquet")
        return dataclasses.replace(cell, work=dataclasses.replace(cell.work, trace=trace))

    here = replay(datasets_dir()).key()
    other = tmp_path / "checkout" / "datasets"
    shutil.copytree(datasets_dir(), other)
    monkeypatch.setenv("PRORSA_DATASETS", str(other))
    assert replay(other).key() == here


def test_cells_finished_beside_a_failing_one_are_kept(tmp_path):
    # Found by review: a failing cell cancelled every task not yet read, finished ones
    # included, so a resume simulated them again. Ray is stood in for by a fake whose
    # second task fails while the third has already finished.
    from prorsa.experiments import sweep as sweeping

    class Ref:
        def __init__(self, cell, outcome):
            self.cell, self.outcome = cell, outcome

    cancelled: list = []

    class FakeRay:
        def put(self, value):
            return value

        def wait(self, refs, num_returns=1, timeout=None):
            return refs[:num_returns], refs[num_returns:]

        def get(self, ref):
            return ref.outcome

    class Remote:
        def remote(self, fn, cell):
            if cell.seed == 1:
                return Ref(cell, ("error", RuntimeError("cell 1 broke")))
            return Ref(cell, ("ok", _counting([])(cell)))

    monkey = pytest.MonkeyPatch()
    monkey.setattr(sweeping, "cancel_ray_tasks", lambda ray, refs: cancelled.extend(refs))
    try:
        path = tmp_path / "cells.jsonl"
        with Sweep(results_path=path, workers=1, fn=_counting([])) as sweep:
            sweep._ray, sweep._remote, sweep.backend = FakeRay(), Remote(), "ray"
            with pytest.raises(RuntimeError, match="cell 1 broke"):
                sweep.map([_cell(s) for s in range(3)])
    finally:
        monkey.undo()
    kept = [json.loads(line)["result"]["cell"]["work"]["seed"] for line in path.open()]
    assert sorted(kept) == [0, 2] and cancelled == []


def test_a_trace_outside_datasets_is_keyed_by_its_content(tmp_path, monkeypatch):
    # Found by review: keyed by its path, a trace imported again to the same path (other
    # filters, other data) reused the old results.
    import shutil

    from prorsa.workload.scenarios import datasets_dir

    source = datasets_dir() / "traces" / "swe-agent.parquet"
    trace = tmp_path / "mine.parquet"
    shutil.copy(source, trace)
    cell = _cell()
    cell = dataclasses.replace(cell, work=dataclasses.replace(cell.work, trace=str(trace)))
    first = cell.key()
    shutil.copy(datasets_dir() / "traces" / "tau2-telecom-gpt4o.parquet", trace)
    assert cell.key() != first
    monkeypatch.chdir(tmp_path)  # the same file by a relative path: the same key
    relative = dataclasses.replace(cell, work=dataclasses.replace(cell.work, trace="mine.parquet"))
    assert relative.key() == cell.key()


def test_an_rl_cell_is_keyed_by_its_trained_agent(tmp_path):
    # Found by review: only a forecaster's model was in the key, so a retrained agent
    # reused the old agent's cells.
    import shutil

    from prorsa.policy.rl import resolve_model_dir

    agent = tmp_path / "agent"
    shutil.copytree(resolve_model_dir("rl-ppo"), agent)
    cell = _cell()
    control = dataclasses.replace(cell.control, policy="rl", policy_params={"model": str(agent)})
    rl = dataclasses.replace(cell, control=control)
    first = rl.key()
    (agent / "opening.txt").write_text((agent / "opening.txt").read_text() + "\\n")
    assert rl.key() != first


def test_a_reused_result_is_described_as_the_cell_asked_for(tmp_path):
    # Found by review: compare grouped reused results by the trace path they were stored
    # with, so the same trace by another path made a second workload row.
    from prorsa.workload.scenarios import datasets_dir

    def replay(trace):
        cell = _cell()
        work = dataclasses.replace(cell.work, trace=trace, scenario=None, trajectories=8)
        return dataclasses.replace(cell, work=work)

    absolute = str(datasets_dir() / "traces" / "swe-agent.parquet")
    path = tmp_path / "cells.jsonl"
    run_sweep([replay(absolute)], results_path=path, workers=1)
    relative = os.path.relpath(absolute)
    (again,) = run_sweep([replay(relative)], results_path=path, workers=1)
    assert cell_of(again).work.trace == relative
