"""A real multi-turn rollout: engines + router + controller + agent loop, end to end.

:func:`run_rollout` samples the scenario's specs and fits them to the engines
(:mod:`.specs`), lets the policy's first decision set the engines' roles, starts the
controller on the wall clock (dynamic policies only, as in the simulator), runs every
trajectory through the :class:`~.agent.AgentLoop` (sync: all at once; async: a fixed
number in flight), and writes ``telemetry/`` (recorder segments),
``telemetry.parquet``, ``specs.jsonl`` and ``metrics.json`` to the output folder.

An existing :class:`~.cluster.EngineFleet` may be passed in (tests share one); otherwise
one is started (and Ray with it, if needed) and shut down at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from prorsa.errors import ConfigError
from prorsa.policy import ClusterSpec, Policy, make_policy
from prorsa.runtime.cluster.startup import first_allocation, idle_observation, make_controller
from prorsa.runtime.controller import ForecastSource
from prorsa.runtime.ray.actuator import AsyncioClock, RayActuator
from prorsa.runtime.ray.agent import AgentLoop, TrajectoryOutcome
from prorsa.runtime.ray.cpu_profile import CPU_PROFILE
from prorsa.runtime.ray.monitor import LoadMonitor
from prorsa.runtime.ray.rollout_config import RolloutConfig
from prorsa.runtime.ray.rollout_metrics import rollout_metrics
from prorsa.runtime.ray.router import PDRouter, RouterConfig
from prorsa.runtime.ray.specs import TokenSource, fit_specs
from prorsa.workload.spec import TrajectorySpec

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


@dataclass
class RolloutResult:
    """What a rollout produced (also written to ``out_dir``)."""

    metrics: dict[str, Any]
    telemetry: pa.Table
    specs: list[TrajectorySpec]
    outcomes: list[TrajectoryOutcome]
    errors: list[str]
    decisions: list = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None


def sample_specs(config: RolloutConfig, max_context_tokens: int) -> list[TrajectorySpec]:
    """The scenario's specs for this run, fitted to ``max_context_tokens``."""
    from prorsa.workload import get_scenario

    profile = get_scenario(config.scenario)
    raw = profile.sample(
        config.trajectories,
        config.seed,
        group_size=config.group_size,
        id_prefix=f"{config.scenario}-s{config.seed}",
    )
    return fit_specs(
        raw,
        max_context_tokens=max_context_tokens,
        max_output_tokens=config.max_tokens,
        max_turns=config.max_turns,
        tool_time_scale=config.tool_time_scale,
    )


def cluster_spec_for(config: RolloutConfig) -> ClusterSpec:
    """Static cluster facts for the policy, throughputs from the cost profile."""
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.cluster.spec import cluster_spec, load_profiles

    sim_config = ClusterConfig(
        profile=config.profile or CPU_PROFILE,
        num_slots=config.engines,
        switch_latency_s=config.switch_latency_s,
    )
    return cluster_spec(sim_config, load_profiles(sim_config), config.min_dwell_s)


def initial_roles(policy: Policy, spec: ClusterSpec, total: int, kv_capacity: int) -> list[str]:
    """Roles the policy's first decision gives an idle, all-colocated cluster (free, as in
    the simulator)."""
    idle = idle_observation(
        spec, engines_per_slot=1, kv_capacity_per_slot=kv_capacity, total_trajectories=total
    )
    return first_allocation(policy, spec, idle)[0]


def make_forecast_provider(name: str) -> ForecastSource:
    """The online forecast provider called ``name`` (the simulator's, unchanged)."""
    from prorsa.runtime.forecast_provider import make_provider

    return make_provider(name)


def run_rollout(
    config: RolloutConfig,
    out_dir: str | os.PathLike[str],
    *,
    fleet: Any = None,
    policy: Policy | None = None,
    forecaster: ForecastSource | None = None,
    specs: Sequence[TrajectorySpec] | None = None,
    progress: Progress | None = None,
) -> RolloutResult:
    """Run one rollout; see the module docstring.

    Args:
        config: what to run.
        out_dir: folder for telemetry, specs and metrics (created).
        fleet: engines to use (left running); None starts and stops its own.
        policy: a policy object instead of ``config.policy`` (tests).
        forecaster: a forecast provider instead of ``config.forecaster``.
        specs: exact specs to run instead of sampling the scenario (must fit the engines).
        progress: ``progress(completed, total)`` once the engines are ready (0 completed),
            then after every finished trajectory.
    """
    config.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = cluster_spec_for(config)
    policy = policy or make_policy(config.policy, **config.policy_params)
    policy.reset(spec, config.seed)
    if forecaster is None and policy.needs_forecast:
        if not config.forecaster:
            raise ConfigError(
                f"policy {config.policy} needs a forecaster", hint="pass --forecaster NAME"
            )
        forecaster = make_forecast_provider(config.forecaster)
    work = list(specs) if specs is not None else sample_specs(config, config.max_model_len)
    roles = initial_roles(policy, spec, len(work), 0)
    owned = fleet is None
    if not owned and len(fleet.clients) != config.engines:
        raise ConfigError(
            f"the fleet has {len(fleet.clients)} engines; the rollout asks for {config.engines}"
        )
    ray_started = False
    if owned:
        fleet, ray_started = start_fleet(config, roles, out)
    try:
        result = asyncio.run(_run(config, fleet, roles, policy, forecaster, work, out, progress))
    finally:
        if owned:
            fleet.shutdown()
            if ray_started:
                import ray

                ray.shutdown()
    result.metrics["engine_start_s"] = fleet.start_s
    _write(out, result)
    return result


def start_fleet(config: RolloutConfig, roles: list[str], out: Path) -> tuple[Any, bool]:
    """Start engines with ``roles`` (and Ray if it is not running). Returns (fleet, started)."""
    import ray

    from prorsa.runtime.ray.cluster import EngineFleet, FleetSpec
    from prorsa.runtime.ray.config import EngineConfig
    from prorsa.runtime.ray.engine import _default_device

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    on_cpu = _default_device() == "cpu"
    started = False
    if not ray.is_initialized():
        # Logical CPUs: several engines share a small machine's cores (one bundle each).
        cpus = max(os.cpu_count() or 1, config.engines + 2) if on_cpu else None
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        started = True
    engine = EngineConfig(
        model=config.model,
        dtype="float32" if on_cpu else "auto",
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_gib=config.kv_cache_gib if config.kv_cache_gib or not on_cpu else 0.25,
        connector=config.connector,  # type: ignore[arg-type]
        kv_storage_dir=str(out / "kv"),
        seed=config.seed,
    )
    try:
        fleet = EngineFleet.start(FleetSpec(engine, roles=roles))
    except BaseException:
        if started:
            ray.shutdown()
        raise
    return fleet, started


async def _run(
    config: RolloutConfig,
    fleet: Any,
    roles: list[str],
    policy: Policy,
    forecaster: ForecastSource | None,
    specs: list[TrajectorySpec],
    out: Path,
    progress: Progress | None,
) -> RolloutResult:
    from prorsa.runtime.ray.tools import make_tools
    from prorsa.runtime.ray.tools.search import project_corpus
    from prorsa.telemetry import Recorder

    pools = fleet.pools()
    await _set_roles(pools, roles)
    if (out / "telemetry").exists():
        # A previous run's segments would be read back with this one's (same ids).
        shutil.rmtree(out / "telemetry")
    tools = make_tools(config.tools)
    search = tools.get("search")
    passages = search.index.documents if search is not None else project_corpus()
    vocabulary = search.index.vocabulary if search is not None else ["agent", "tool"]
    tokens = TokenSource(_tokenizer(config.model), passages)
    recorder = Recorder(out / "telemetry", run_id=config.run_id)
    router = PDRouter(
        pools,
        RouterConfig(
            local_prefill_threshold_tokens=config.local_prefill_threshold,
            drain_timeout_s=config.drain_timeout_s,
        ),
        recorder=recorder,
    )
    spec = policy.cluster_
    monitor = LoadMonitor(pools, interval_s=config.monitor_interval_s)
    monitor.start()
    actuator = RayActuator(
        router,
        spec,
        drain_timeout_s=config.drain_timeout_s,
        monitor=monitor,
        total_trajectories=len(specs),
    )
    controller = make_controller(
        policy,
        actuator,
        AsyncioClock(),
        interval_s=config.interval_s,
        min_dwell_s=config.min_dwell_s,
        forecaster=forecaster,
    )
    agent = AgentLoop(
        router,
        tokens,
        tools,
        seed=config.seed,
        vocabulary=vocabulary,
        pad_tool_latency=config.pad_tool_latency,
    )
    done = 0

    def finished() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(specs))

    wall = time.perf_counter()
    try:
        await monitor.poll_once()  # KV capacity known before the first tick
        if controller is not None:
            controller.start()
        if progress is not None:
            progress(0, len(specs))  # engines are up: the rollout starts now
        limit = len(specs) if config.mode == "sync" else config.max_in_flight
        answers = await _drive(agent, specs, limit, finished)
    finally:
        if controller is not None:
            controller.stop()
        await actuator.wait()
        await monitor.stop()
        await recorder.aclose()
    wall = time.perf_counter() - wall
    outcomes = [a for a in answers if isinstance(a, TrajectoryOutcome)]
    errors = [
        f"{s.trajectory_id}: {a!r}"
        for s, a in zip(specs, answers, strict=True)
        if not isinstance(a, TrajectoryOutcome)
    ]
    table = _read_back(out)
    metrics = rollout_metrics(table, config.mode)
    metrics.update(
        wall_s=wall,
        trajectories_failed=len(errors),
        engines=len(roles),
        initial_roles=roles,
        final_roles={e.engine_id: e.role.value for e in pools.engines()},
        policy=config.policy if config.policy else type(policy).__name__,
        scenario=config.scenario,
        kv_source=sorted({monitor.reading(e).source for e in pools.engines() if e.alive}),
        kv_capacity_tokens={e.engine_id: e.kv_capacity_tokens for e in pools.engines()},
        peak_kv_usage=monitor.peak_kv_usage,
        controller_ticks=len(controller.decisions) if controller else 0,
        router_retries=router.retries_total,
        router_reroutes=router.reroutes_total,
        tool_calls=_count(t for o in outcomes for t in o.tools),
        tool_errors=sum(o.tool_errors for o in outcomes),
        tool_time_scale=config.tool_time_scale,
    )
    return RolloutResult(
        metrics=metrics,
        telemetry=table,
        specs=specs,
        outcomes=outcomes,
        errors=errors,
        decisions=controller.decisions if controller else [],
        switches=list(actuator.results),
        out_dir=out,
    )


async def _set_roles(pools: Any, roles: list[str]) -> None:
    """Give idle engines their starting roles (a shared fleet may hold others)."""
    setup = PDRouter(pools, RouterConfig())  # no recorder: set-up is not part of the run
    for engine_id, role in enumerate(roles):
        if pools.get(engine_id).role.value != role:
            await setup.switch_role(engine_id, role, drain_timeout_s=0)
    for engine in pools.engines():
        engine.since_s = 0.0  # as in the simulator, starting roles are free and old


async def _drive(
    agent: AgentLoop, specs: list[TrajectorySpec], limit: int, finished: Callable[[], None]
) -> list[Any]:
    """Run every spec, at most ``limit`` at a time (sync: all; async: the in-flight cap)."""
    gate = asyncio.Semaphore(limit)

    async def one(spec: TrajectorySpec) -> TrajectoryOutcome:
        async with gate:
            try:
                return await agent.run(spec)
            finally:
                finished()

    return await asyncio.gather(*(one(s) for s in specs), return_exceptions=True)


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, local_files_only=True)


def _read_back(out: Path) -> pa.Table:
    from prorsa.telemetry import read_telemetry

    table, report = read_telemetry(out / "telemetry", validate=True)
    if not report.clean:
        logger.warning("telemetry had a truncated tail: %s", report)
    # Marks real-engine telemetry (the simulator writes "simulator" here).
    meta = {**(table.schema.metadata or {}), b"prorsa.source": b"ray-vllm"}
    return table.replace_schema_metadata(meta)


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _write(out: Path, result: RolloutResult) -> None:
    from prorsa.telemetry import write_parquet

    write_parquet(result.telemetry, out / "telemetry.parquet")
    with open(out / "specs.jsonl", "w") as fh:
        for spec in result.specs:
            fh.write(json.dumps({**spec.to_dict(), "meta": spec.meta}, default=float) + "\n")
    payload = {**result.metrics, "errors": result.errors, "switches": result.switches}
    (out / "metrics.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
