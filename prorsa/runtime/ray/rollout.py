"""A real multi-turn rollout: engines + router + controller + agent loop, end to end.

:func:`run_rollout` samples the scenario's specs and fits them to the engines
(:mod:`.specs`), lets the policy's first decision set the engines' roles, starts the
controller on the wall clock (dynamic policies only, as in the simulator), runs every
trajectory through the :class:`~.agent.AgentLoop` (sync: all at once; async: a fixed
number in flight), and writes ``telemetry/`` (recorder segments),
``telemetry.parquet``, ``specs.jsonl``, ``metrics.json`` and ``run-manifest.json`` to the
output folder.

A run that ends early never looks finished. The output folder is checked before any
engine starts. SIGINT and SIGTERM stop it the same way: trajectories in flight end with a
``traj_end`` whose detail says ``"status": "interrupted"`` (or ``"failed"`` after an
error) and how many of their turns ran, switches and the controller stop, the recorder is
closed, what was recorded is written (each file whole or not at all) with the run status
in ``telemetry.parquet``'s metadata, the manifest says ``interrupted`` with the signal,
engines and Ray are shut down, and :class:`RolloutInterrupted` (a ``KeyboardInterrupt``)
is raised. A run in which trajectories failed ends ``failed``. Readers
(:func:`prorsa.telemetry.manifest.check_complete`) refuse such runs unless told otherwise.

An existing :class:`~.cluster.EngineFleet` may be passed in (tests share one); otherwise
one is started (and Ray with it, if needed) and shut down at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from prorsa.errors import ConfigError
from prorsa.policy import ClusterSpec, Policy, make_policy
from prorsa.policy.types import WorkloadShape
from prorsa.runtime.cluster.startup import (
    first_allocation,
    idle_observation,
    make_controller,
    note_start,
)
from prorsa.runtime.controller import ForecastSource
from prorsa.runtime.gc_heap import startup_heap_frozen
from prorsa.runtime.ray import cpu_profile  # noqa: F401  (registers the CPU profile)
from prorsa.runtime.ray.actuator import AsyncioClock, RayActuator
from prorsa.runtime.ray.agent import AgentLoop, TrajectoryOutcome
from prorsa.runtime.ray.barrier import BarrierClient, DispatchBarrier
from prorsa.runtime.ray.monitor import LoadMonitor
from prorsa.runtime.ray.rollout_config import RolloutConfig
from prorsa.runtime.ray.rollout_metrics import rollout_metrics
from prorsa.runtime.ray.router import PDRouter, RouterConfig
from prorsa.runtime.ray.specs import TokenSource, fit_specs
from prorsa.workload.shape import reference_sample, shape_of
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
    #: Trajectories that began (async mode starts them as slots free up).
    started: int = 0
    #: Trajectories cut short by a stop (signal) while running.
    interrupted: int = 0
    #: The signal that stopped the run, None when it ran to its end.
    stopped_by: int | None = None


def sample_specs(config: RolloutConfig, max_context_tokens: int) -> list[TrajectorySpec]:
    """The scenario's specs for this run, fitted to ``max_context_tokens``."""
    from prorsa.workload import get_scenario

    work = config.work
    profile = get_scenario(work.scenario)
    raw = profile.sample(
        work.trajectories,
        work.seed,
        group_size=work.group_size,
        id_prefix=f"{work.scenario}-s{work.seed}",
    )
    return _fit(config, raw, max_context_tokens)


def reference_shape(config: RolloutConfig) -> WorkloadShape:
    """The run's expected shape: the scenario's reference sample
    (:func:`~prorsa.workload.shape.scenario_shape`), fitted to the engines as the run's
    own specs are."""
    raw = reference_sample(config.work.scenario)
    return shape_of(_fit(config, raw, config.max_model_len))


def _fit(
    config: RolloutConfig, raw: list[TrajectorySpec], max_context_tokens: int
) -> list[TrajectorySpec]:
    return fit_specs(
        raw,
        max_context_tokens=max_context_tokens,
        max_output_tokens=config.max_tokens,
        max_turns=config.max_turns,
        tool_time_scale=config.tool_time_scale,
    )


def cluster_spec_for(config: RolloutConfig) -> ClusterSpec:
    """Static cluster facts for the policy, throughputs from the cost profile."""
    from prorsa.runtime.cluster.spec import cluster_spec, load_profiles

    return cluster_spec(config.cluster, load_profiles(config.cluster), config.control.min_dwell_s)


def initial_roles(
    policy: Policy,
    spec: ClusterSpec,
    total: int,
    kv_capacity: int,
    workload: WorkloadShape | None = None,
) -> list[str]:
    """Roles the policy's first decision gives an idle, all-colocated cluster (free, as in
    the simulator)."""
    idle = idle_observation(
        spec,
        engines_per_slot=1,
        kv_capacity_per_slot=kv_capacity,
        total_trajectories=total,
        workload=workload,
    )
    return first_allocation(policy, spec, idle)[0]


def make_forecast_provider(name: str) -> ForecastSource:
    """The online forecast provider called ``name`` (the simulator's, unchanged)."""
    from prorsa.runtime.forecast_provider import make_provider

    return make_provider(name)


class RolloutInterrupted(KeyboardInterrupt):
    """A rollout was stopped by SIGINT or SIGTERM after writing what it had.

    A ``KeyboardInterrupt``, so callers and the CLI treat SIGTERM like Ctrl-C; ``result``
    holds the partial :class:`RolloutResult` (also written to its folder).
    """

    def __init__(self, signum: int, result: RolloutResult | None = None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.result = result


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
        config: what to run (validated here).
        out_dir: folder for telemetry, specs, metrics and the run manifest (created;
            checked before anything starts, and never the model folder or inside it).
        fleet: engines to use (left running); None starts and stops its own.
        policy: a policy object instead of ``config.control.policy`` (tests).
        forecaster: a forecast provider instead of ``config.control.forecaster``.
        specs: exact specs to run instead of sampling the scenario (must fit the engines).
        progress: ``progress(completed, total)`` once the engines are ready (0 completed),
            then after every finished trajectory.

    Raises:
        RolloutInterrupted: SIGINT or SIGTERM stopped the run (outputs written, marked).
        ConfigError, OutputError: bad settings or output folder, before any engine starts.
    """
    from prorsa.io import check_output
    from prorsa.telemetry.manifest import run_manifest

    config.validate()
    out = check_output(out_dir, kind="dir", inputs=[config.model])
    spec = cluster_spec_for(config)
    control = config.control
    policy = policy or make_policy(control.policy, **control.policy_params)
    policy.reset(spec, config.work.seed)
    if forecaster is None and policy.needs_forecast:
        if not control.forecaster:
            raise ConfigError(
                f"policy {control.policy} needs a forecaster", hint="pass --forecaster NAME"
            )
        forecaster = make_forecast_provider(control.forecaster)
    work = list(specs) if specs is not None else sample_specs(config, config.max_model_len)
    shape = reference_shape(config)
    roles = initial_roles(policy, spec, len(work), 0, shape)
    owned = fleet is None
    if not owned and len(fleet.clients) != config.engines:
        raise ConfigError(
            f"the fleet has {len(fleet.clients)} engines; the rollout asks for {config.engines}"
        )
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM raises like Ctrl-C while engines start and stop (start_fleet keeps this
    # handler over Ray's); while trajectories run, _run turns both signals into a stop.
    with (
        _sigterm_interrupts() as seen,
        run_manifest(out, command="rollout", run_id=config.run_id, planned=len(work)) as run,
    ):
        ray_started = False
        stop = _StopOnSignal()
        try:
            if owned:
                fleet, ray_started = start_fleet(config, roles, out)
            try:
                run_all = _run(
                    config, fleet, roles, policy, forecaster, work, out, progress, stop, shape
                )
                # This process routes and controls from here on (prorsa.runtime.gc_heap).
                with startup_heap_frozen(config.freeze_startup_heap):
                    result = asyncio.run(run_all)
            finally:
                if owned:
                    fleet.shutdown()
                    if ray_started:
                        import ray

                        ray.shutdown()
        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
            # Ray's wait re-raises a bare KeyboardInterrupt, and a second signal cancels
            # the whole run: say which signal it was.
            signum = stop.signum or (seen[-1] if seen else None)
            if isinstance(exc, RolloutInterrupted) or signum is None:
                raise
            raise RolloutInterrupted(signum) from None
        result.metrics["engine_start_s"] = fleet.start_s
        _finish(run, result)
        _write(out, result, run)
    if result.stopped_by is not None:
        raise RolloutInterrupted(result.stopped_by, result)
    return result


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[list[int]]:
    """While active, SIGTERM raises :class:`RolloutInterrupted` as SIGINT raises
    ``KeyboardInterrupt``, so clean-up runs for both; yields the list of signals seen."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen  # only the main thread may handle signals
        return

    def on_sigterm(signum: int, _frame: object) -> None:
        seen.append(signum)
        raise RolloutInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finish(run: Any, result: RolloutResult) -> None:
    """Set the manifest's final status and counts from what the run did."""
    stopped, failed = result.stopped_by, len(result.errors)
    run.counts.update(
        trajectories_started=result.started,
        trajectories_completed=len(result.outcomes),
        trajectories_failed=failed,
        trajectories_interrupted=result.interrupted,
        engines_lost=len(result.metrics.get("engines_lost", [])),
        events=result.telemetry.num_rows,
    )
    if stopped is not None:
        run.finish("interrupted", f"stopped by {signal.Signals(stopped).name}")
    elif failed:
        run.finish("failed", f"{failed} trajectories failed; first: {result.errors[0]}")
    elif len(result.outcomes) < run.counts.get("trajectories_planned", 0):
        run.finish("failed", f"only {len(result.outcomes)} trajectories completed")
    else:
        run.finish("complete")
    result.metrics.update(run_status=run.status, run_cause=run.cause)


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
        handler = signal.getsignal(signal.SIGTERM)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        started = True
        if callable(handler) and threading.current_thread() is threading.main_thread():
            # Ray's driver handler exits on SIGTERM at once (SystemExit 15); keep the
            # caller's, which stops the run like Ctrl-C and lets the engines shut down.
            signal.signal(signal.SIGTERM, handler)
    engine = EngineConfig(
        model=config.model,
        dtype="float32" if on_cpu else "auto",
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_gib=config.kv_cache_gib if config.kv_cache_gib or not on_cpu else 0.25,
        connector=config.connector,  # type: ignore[arg-type]
        kv_storage_dir=str(out / "kv"),
        seed=config.work.seed,
        freeze_startup_heap=config.freeze_startup_heap,
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
    stop: _StopOnSignal,
    shape: WorkloadShape | None = None,
) -> RolloutResult:
    from prorsa.runtime.ray.tools import make_tools
    from prorsa.runtime.ray.tools.search import project_corpus
    from prorsa.telemetry import Recorder

    pools = fleet.pools()
    # An engine that hangs fails no call: once the monitor takes it out of service, its
    # legs are ended here so the router serves those turns elsewhere.
    barrier = DispatchBarrier()
    for engine in pools.engines():
        engine.client = BarrierClient(engine.client, barrier)
    pools.on_engine_lost(lambda e: barrier.drop_engine(e.engine_id, e.lost_cause))
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
            local_prefill_threshold_tokens=config.cluster.local_prefill_threshold,
            drain_timeout_s=config.cluster.drain_timeout_s,
        ),
        recorder=recorder,
    )
    spec = policy.cluster_
    monitor = LoadMonitor(
        pools,
        interval_s=config.monitor_interval_s,
        stall_timeout_s=config.engine_stall_timeout_s or None,
    )
    monitor.start()
    actuator = RayActuator(
        router,
        spec,
        drain_timeout_s=config.cluster.drain_timeout_s,
        monitor=monitor,
        total_trajectories=len(specs),
        workload=shape,
    )
    note_start(actuator, roles, spec.slot_gpus)
    controller = make_controller(
        policy,
        actuator,
        AsyncioClock(),
        interval_s=config.control.interval_s,
        min_dwell_s=config.control.min_dwell_s,
        forecaster=forecaster,
        keep_running=True,
    )
    agent = AgentLoop(
        router,
        tokens,
        tools,
        seed=config.work.seed,
        vocabulary=vocabulary,
        pad_tool_latency=config.pad_tool_latency,
    )
    done = 0

    def finished() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(specs))

    answers: list[Any] = [None] * len(specs)
    wall = time.perf_counter()
    drive: asyncio.Task | None = None
    try:
        await monitor.poll_once()  # KV capacity known before the first tick
        if controller is not None:
            controller.start()
        if progress is not None:
            progress(0, len(specs))  # engines are up: the rollout starts now
        limit = len(specs) if config.work.mode == "sync" else config.work.max_in_flight
        drive = asyncio.ensure_future(_drive(agent, specs, limit, finished, answers))
        with stop.cancels(drive):
            try:
                await drive
            except asyncio.CancelledError:
                if stop.signum is None:
                    raise  # cancelled from outside: not a stop this run asked for
                logger.warning("rollout stopped by signal %d; writing what it has", stop.signum)
    finally:
        if drive is not None and not drive.done():
            drive.cancel()  # an error or outside cancellation: end the trajectories first
            await asyncio.gather(drive, return_exceptions=True)
        if controller is not None:
            controller.stop()
        await actuator.wait()
        await monitor.stop()
        await recorder.aclose()
    wall = time.perf_counter() - wall
    outcomes = [a for a in answers if isinstance(a, TrajectoryOutcome)]
    errors = [
        f"{s.trajectory_id}: {a!r}" for s, a in zip(specs, answers, strict=True) if _failed(a)
    ]
    table = _read_back(out)
    metrics = rollout_metrics(table, config.work.mode)
    lost = set(actuator.engines_lost)
    metrics.update(
        wall_s=wall,
        trajectories_failed=len(errors),
        engines=len(roles),
        initial_roles=roles,
        # Lost engines serve nothing: they are listed apart, never with a role.
        final_roles={e.engine_id: e.role.value for e in pools.engines() if e.alive},
        engines_lost=actuator.engines_lost,
        policy=config.control.policy if config.control.policy else type(policy).__name__,
        scenario=config.work.scenario,
        kv_source=sorted({monitor.reading(e).source for e in pools.engines() if e.alive}),
        kv_capacity_tokens={
            e.engine_id: e.kv_capacity_tokens for e in pools.engines() if e.engine_id not in lost
        },
        peak_kv_usage=monitor.peak_kv_usage,
        controller_ticks=len(controller.decisions) if controller else 0,
        router_retries=router.retries_total,
        router_reroutes=router.reroutes_total,
        router_kv_handoffs_lost=router.kv_handoffs_lost_total,
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
        started=sum(a is not None for a in answers),
        interrupted=sum(isinstance(a, asyncio.CancelledError) for a in answers),
        stopped_by=stop.signum,
    )


def _failed(answer: Any) -> bool:
    return isinstance(answer, BaseException) and not isinstance(answer, asyncio.CancelledError)


class _StopOnSignal:
    """While :meth:`cancels` is active, the first SIGINT or SIGTERM cancels one task (the
    trajectories) so the run winds down and writes what it has; a second signal also
    cancels the task running the whole rollout (an impatient user stops the clean-up)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def cancels(self, task: asyncio.Task) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may handle signals
            return
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()

        def on_signal(signum: int, _frame: object) -> None:
            # Runs between bytecodes of the main thread: hand the work to the loop.
            if self.signum is None:
                self.signum = signum
                loop.call_soon_threadsafe(task.cancel)
            elif main is not None:
                loop.call_soon_threadsafe(main.cancel)

        previous = {sig: signal.signal(sig, on_signal) for sig in self.SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _set_roles(pools: Any, roles: list[str]) -> None:
    """Give idle engines their starting roles (a shared fleet may hold others)."""
    setup = PDRouter(pools, RouterConfig())  # no recorder: set-up is not part of the run
    moves = [(eid, role) for eid, role in enumerate(roles) if pools.get(eid).role.value != role]
    # Engines joining the decode side first: a switch that would leave no decode-side
    # engine is refused, and the engines that become one may come later in id order.
    for engine_id, role in sorted(moves, key=lambda move: move[1] == "prefill"):
        await setup.switch_role(engine_id, role, drain_timeout_s=0)
    for engine in pools.engines():
        engine.since_s = 0.0  # as in the simulator, starting roles are free and old


async def _drive(
    agent: AgentLoop,
    specs: list[TrajectorySpec],
    limit: int,
    finished: Callable[[], None],
    answers: list[Any],
) -> None:
    """Run every spec, at most ``limit`` at a time (sync: all; async: the in-flight cap).

    ``answers[i]`` becomes spec ``i``'s outcome, its exception, or the
    ``CancelledError`` that interrupted it; it stays None for a spec never started. It is
    filled as trajectories end, so a cancelled drive still says what happened.
    """
    gate = asyncio.Semaphore(limit)

    async def one(i: int, spec: TrajectorySpec) -> None:
        async with gate:
            try:
                answers[i] = await agent.run(spec)
            except asyncio.CancelledError as exc:
                answers[i] = exc
                raise
            except Exception as exc:
                answers[i] = exc
            finished()

    await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))


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


def _write(out: Path, result: RolloutResult, run: Any) -> None:
    """Write the telemetry table (with the run's status in its metadata), the specs and
    the metrics; each file whole or not at all."""
    from prorsa.io import atomic_open, atomic_write_text
    from prorsa.telemetry import write_parquet
    from prorsa.telemetry.manifest import mark_table

    result.telemetry = mark_table(result.telemetry, run)
    write_parquet(result.telemetry, out / "telemetry.parquet")
    with atomic_open(out / "specs.jsonl") as fh:
        for spec in result.specs:
            fh.write(json.dumps({**spec.to_dict(), "meta": spec.meta}, default=float) + "\n")
    payload = {**result.metrics, "errors": result.errors, "switches": result.switches}
    atomic_write_text(out / "metrics.json", json.dumps(payload, indent=2, default=str) + "\n")
