"""The simulated cluster: slots of engines wired to the shared cluster model.

Routing rules, the role-switch state machine, telemetry and the observation are the
cluster model's (:mod:`prorsa.runtime.cluster`); this class wires them to simulator events:
it launches turns, moves KV over :class:`~.links.KvLinks`, receives its engines' reports
(it implements :class:`~.engine.EngineEvents`) and keeps the run's tallies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from heapq import heappush

from prorsa.errors import CapacityError, ConfigError
from prorsa.policy.base import ClusterSpec
from prorsa.policy.types import ROLES, ClusterObservation, SlotView, WorkloadShape
from prorsa.runtime.cluster import telemetry as ev
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.observation import PrefillWork, TrajectoryStates, build_observation
from prorsa.runtime.cluster.routing import (
    DECODE_SIDE,
    DecodePlacement,
    choose_prefill,
    least_owned,
    prefill_locally,
)
from prorsa.runtime.cluster.telemetry import ClusterTelemetry
from prorsa.runtime.sim.core import PRIORITY_ARRIVAL, PRIORITY_COMPLETE, Environment
from prorsa.runtime.sim.engine import SimEngine
from prorsa.runtime.sim.kv_store import KvStore
from prorsa.runtime.sim.links import KvLinks
from prorsa.runtime.sim.request import SimTurn, TrajState
from prorsa.runtime.sim.switcher import SlotSwitcher
from prorsa.runtime.sim.tally import RunTally
from prorsa.runtime.sim.topology import (
    CAPACITY_HINT,
    Slot,
    build_engines,
    check_fits,
    sequence_kv_capacity,
)
from prorsa.telemetry.schema import detail_json
from prorsa.workload.spec import TrajectorySpec
from prorsa.workload.truth import LiveSpecs

logger = logging.getLogger(__name__)


class SimCluster:
    """Engines, routing, KV movement and bookkeeping of one simulation.

    Args:
        env: the simulation's environment (clock, events, RNG).
        config: cluster shape and behaviour.
        profiles: cost profile per tensor-parallel degree used by any role.
        run_id: telemetry ``run_id``.
        record: keep lifecycle telemetry.
        initial_roles: role per slot (default: all colocated).
    """

    def __init__(
        self,
        env: Environment,
        config: ClusterConfig,
        profiles: dict[int, object],
        *,
        run_id: str = "sim",
        record: bool = True,
        initial_roles: list[str] | None = None,
    ) -> None:
        config.validate()
        self.env = env
        self.config = config
        self.profiles = profiles  # tp -> CostProfile
        self.telemetry = ClusterTelemetry(run_id, record=record)
        # Events without detail are written with two C calls (see ClusterTelemetry.pack).
        self._record = record
        self._pack = self.telemetry.pack
        self._write = self.telemetry.write
        self.states = TrajectoryStates()
        self.prefill_work = PrefillWork()
        # The counts behind the observation, updated inline on every lifecycle move.
        self._state_count = self.states.counts
        self._state_tokens = self.states.tokens
        self.truth = LiveSpecs()  # the oracle's ground-truth port
        self.tally = RunTally()
        self.links = KvLinks(config)
        self.kv_store: KvStore | None = None
        self.store_links: KvLinks | None = None
        self.switcher = SlotSwitcher(self)
        self.placement = DecodePlacement()
        self.local_prefill_threshold = config.local_prefill_threshold
        #: What one trajectory may reach, on any engine of any role (topology.py).
        self.sequence_kv_capacity_tokens = sequence_kv_capacity(config, profiles)
        self._heap = env.heap
        self._queue = env.queue
        self._tool_end_cb = self._tool_end
        self._no_overhead = config.request_overhead_s <= 0
        self.slots: list[Slot] = []
        self.engines: dict[int, SimEngine] = {}
        self.retired: list[SimEngine] = []  # engines replaced by a role switch
        self.decode_side: list[SimEngine] = []
        self.prefill_side: list[SimEngine] = []
        self.live: dict[str, TrajState] = {}
        self.on_trajectory_done: Callable[[TrajState], None] | None = None
        roles = initial_roles or ["colocated"] * config.num_slots
        if len(roles) != config.num_slots:
            raise ConfigError(
                f"initial_roles has {len(roles)} entries for {config.num_slots} slots"
            )
        for slot_id, role in enumerate(roles):
            if role not in ROLES:
                raise ConfigError(f"unknown role '{role}' for slot {slot_id}")
            slot = Slot(slot_id, config.slot_gpus, role)
            self.slots.append(slot)
            slot.engines = build_engines(slot, config, profiles, env, self)
            self.adopt(slot.engines)
        self.refresh_routing()
        if not self.decode_side:
            raise ConfigError("the allocation leaves no decode or colocated engine")
        if config.reuse_mode == "kv-store":
            per_token = max(e.kv_bytes_per_token for e in self.engines.values())
            capacity = int(config.kv_store_gbytes_per_node * 1e9 / per_token)
            self.kv_store = KvStore(capacity, config.kv_store_scope)
            self.store_links = KvLinks(config, config.kv_store_bandwidth_gbytes_per_s)

    # ---------------------------------------------------------------- topology
    def adopt(self, engines: list[SimEngine]) -> None:
        for engine in engines:
            self.engines[engine.engine_id] = engine

    def retire(self, engines: list[SimEngine]) -> None:
        for engine in engines:
            self.retired.append(engine)
            del self.engines[engine.engine_id]

    def refresh_routing(self) -> None:
        """Recompute which engines serve each side after a role change."""
        decode_side, prefill_side = [], []
        for slot in self.slots:
            if slot.role in DECODE_SIDE:
                decode_side += slot.engines
            elif slot.role == "prefill":
                prefill_side += slot.engines
        self.decode_side = decode_side
        self.prefill_side = prefill_side
        self.placement.refresh(decode_side)

    @property
    def completed(self) -> int:
        return self.tally.completed

    # -------------------------------------------------------------- lifecycle
    # The hot paths below move a trajectory's state inline (the body of _set_state):
    # a call per lifecycle move is a measurable share of a simulated turn.
    def _set_state(self, traj: TrajState, state: str, tokens: int) -> None:
        count, held = self._state_count, self._state_tokens
        old = traj.state
        count[old] -= 1
        held[old] -= traj.tokens
        count[state] += 1
        held[state] += tokens
        traj.state = state
        traj.tokens = tokens

    def start_trajectory(self, spec: TrajectorySpec) -> TrajState:
        """Launch a trajectory now: its first turn is routed immediately; CapacityError
        if its context will outgrow what one sequence may hold here (a stream's specs
        are not known up front: the simulation checks a known batch before it runs)."""
        check_fits(spec, self.sequence_kv_capacity_tokens)
        now = self.env.now
        key = self.telemetry.key(spec.trajectory_id, spec.group_id, spec.task)
        traj = TrajState(spec, now, key)
        self.live[spec.trajectory_id] = traj
        self.truth.add(spec)
        self.states.enter("queued", 0)
        if self._record:
            self._write(self._pack(now, key, 0, ev.TRAJ_START, -1, 0, 0, 0, 0))
        self._start_turn(traj)
        return traj

    def _start_turn(self, traj: TrajState) -> None:
        k = traj.turn
        new = traj.new_tokens[k]
        context = traj.prev_context + traj.prev_output + new
        req = SimTurn(traj, k, context, traj.output_tokens[k])
        now = req.queued_s = self.env.now
        count, held = self._state_count, self._state_tokens
        old = traj.state
        count[old] -= 1
        held[old] -= traj.tokens
        count["queued"] += 1
        held["queued"] += context
        traj.state = "queued"
        traj.tokens = context
        self.prefill_work.appended_tokens += new
        if self._record:
            self._write(self._pack(now, traj.key, k, ev.PREFILL_QUEUED, -1, context, new, 0, 0))
        self._route(req, new)

    # ---------------------------------------------------------------- routing
    def _decode_for(self, traj: TrajState) -> SimEngine:
        """The trajectory's decode-side engine (sticky, else the least owned), assigned."""
        engine = self.placement.choose(traj.decode_engine)
        if engine is None:
            raise ConfigError("no decode or colocated engine is serving")
        self.placement.move(traj.decode_engine, engine)
        traj.decode_engine = engine
        return engine

    def _route(self, req: SimTurn, appended: int) -> None:
        traj = req.traj
        # The sticky engine, unless it no longer serves decode or is overloaded.
        decode = self._decode_for(traj)
        req.decode_engine = decode
        on_decode = decode.cache.entries.get(traj.traj_key, 0)
        # A colocated engine always prefills its own turns (prefill_locally's first rule).
        local = decode.role == "colocated" or prefill_locally(
            decode.role,
            bool(self.prefill_side),
            appended,
            on_decode,
            req.context,
            self.local_prefill_threshold,
        )
        req.local = local
        if local:
            req.prefill_engine = decode
            req.prefill_left = req.context - on_decode
            if self._no_overhead:
                decode.submit_prefill(req)
            else:
                self._send_prefill(req, decode)
            return
        key = traj.traj_key
        prefill = choose_prefill(
            self.prefill_side,
            traj.prefill_engine,
            req.context,
            lambda engine: engine.cache.peek(key),
            self.env.rng,
        )
        req.prefill_engine = prefill
        traj.prefill_engine = prefill
        cached = prefill.cache.peek(key)
        mode = self.config.reuse_mode
        if mode == "pull":
            on_decode = min(on_decode, req.context - 1)
            if on_decode > cached:
                # The decode engine holds the whole previous context (its last output
                # included): copying the part the prefill engine lacks is far cheaper than
                # recomputing it, and the prefill engine then only computes the new tokens.
                self._read_context(req, prefill, on_decode, cached, self.links, decode)
                return
        elif mode == "kv-store":
            prior = min(req.context - appended, req.context - 1)
            if prior > cached:
                found = self.kv_store.lookup(prefill.engine_id, key, prior)
                if found > cached:
                    self._read_context(req, prefill, found, cached, self.store_links, prefill)
                    return
        req.prefill_left = req.context - cached
        self._send_prefill(req, prefill)

    def _read_context(
        self,
        req: SimTurn,
        prefill: SimEngine,
        tokens: int,
        cached: int,
        links: KvLinks,
        over: SimEngine,
    ) -> None:
        """Copy context tokens ``cached..tokens`` into ``prefill`` over ``over``'s link, then
        prefill the rest there."""
        _, end = links.book(over.engine_id, tokens - cached, over.kv_bytes_per_token, self.env.now)
        req.prefill_left = req.context - tokens
        self.env.schedule(end, self._pull_done, req, prefill, tokens, priority=PRIORITY_ARRIVAL)

    def _send_prefill(self, req: SimTurn, engine: SimEngine) -> None:
        """Hand a prefill leg to ``engine`` after the per-request front-end overhead."""
        overhead = self.config.request_overhead_s
        if overhead <= 0:
            engine.submit_prefill(req)
        else:
            self.env.schedule(self.env.now + overhead, self._arrive_prefill, req, engine)

    def _arrive_prefill(self, req: SimTurn, engine: SimEngine) -> None:
        if engine.accepting:
            engine.submit_prefill(req)
        else:  # the engine began switching while the request was on its way
            self._route(req, req.traj.new_tokens[req.turn])

    def _send_decode(self, req: SimTurn, engine: SimEngine) -> None:
        """Hand a decode leg (KV pull) to ``engine`` after the front-end overhead."""
        overhead = self.config.request_overhead_s
        if overhead <= 0:
            engine.submit_incoming(req)
        else:
            self.env.schedule(self.env.now + overhead, self._arrive_decode, req, engine)

    def _arrive_decode(self, req: SimTurn, engine: SimEngine) -> None:
        if not engine.accepting:
            engine = req.decode_engine = self._decode_for(req.traj)
        engine.submit_incoming(req)

    def _pull_done(self, req: SimTurn, prefill: SimEngine, cached: int) -> None:
        # The pulled blocks travel with the request into memory reserved at admission
        # (not into the evictable cache, where a long queue could lose them again).
        req.pulled = cached
        if prefill.accepting:
            prefill.submit_prefill(req)
        else:
            self._route(req, req.traj.new_tokens[req.turn])

    def reroute_queued(self, req: SimTurn) -> None:
        """A prefill queued on a switching engine goes elsewhere."""
        traj = req.traj
        if req.recomputing or (req.local and req.decoded):
            # Its KV (if any) is gone; recompute wherever the trajectory goes next.
            target = self._decode_for(traj)
            req.decode_engine = req.prefill_engine = target
            target.submit_prefill(req)
            return
        self._route(req, traj.new_tokens[req.turn])

    def redirect_incoming(self, req: SimTurn) -> None:
        """A transfer not yet started into a switching engine goes to another one."""
        target = req.decode_engine = self._decode_for(req.traj)
        target.submit_incoming(req)

    # --------------------------------------------------------- engine events
    def on_prefill_start(self, req: SimTurn, engine: SimEngine) -> None:
        traj = req.traj
        req.prefill_attempts += 1
        tally = self.tally
        self.prefill_work.computed_tokens += req.prefill_tokens
        if req.prefill_attempts == 1:
            tally.prefill_tokens_computed += req.prefill_tokens
            tally.prefill_tokens_cached += req.cached
        context = req.context
        count, held = self._state_count, self._state_tokens
        old = traj.state
        count[old] -= 1
        held[old] -= traj.tokens
        count["prefilling"] += 1
        held["prefilling"] += context
        traj.state = "prefilling"
        traj.tokens = context
        if req.recompute_tokens and req.cached == 0 and req.decoded:
            self.telemetry.turn(
                self.env.now,
                traj.key,
                req.turn,
                ev.PREFILL_START,
                engine.engine_id,
                context,
                req.prefill_tokens,
                req.cached,
                0,
                detail_json(recompute=True),
            )
        elif self._record:
            self._write(
                self._pack(
                    self.env.now,
                    traj.key,
                    req.turn,
                    ev.PREFILL_START,
                    engine.engine_id,
                    context,
                    req.prefill_tokens,
                    req.cached,
                    0,
                )
            )

    def on_prefill_end(self, req: SimTurn, engine: SimEngine, *, local: bool) -> None:
        traj = req.traj
        context = req.context
        if self._record:
            self._write(
                self._pack(
                    self.env.now,
                    traj.key,
                    req.turn,
                    ev.PREFILL_END,
                    engine.engine_id,
                    context,
                    req.prefill_tokens,
                    req.cached,
                    0,
                )
            )
        if traj.group_key and req.turn == 0:
            cache = engine.cache
            cache.put(traj.group_key, traj.spec.shared_prompt_tokens)
            # Each member's own context includes the shared prompt and counts it (as the
            # Ray router's record does); the group's entry is not counted twice.
            cache.retire(traj.group_key)
        if local:
            count, held = self._state_count, self._state_tokens
            old = traj.state
            count[old] -= 1
            held[old] -= traj.tokens
            count["decoding"] += 1
            held["decoding"] += context
            traj.state = "decoding"
            traj.tokens = context
            return
        self._set_state(traj, "transferring", req.context)
        decode = req.decode_engine
        if not decode.accepting:
            decode = req.decode_engine = self._decode_for(traj)
        self._send_decode(req, decode)

    def start_transfer(self, req: SimTurn, decode: SimEngine, cached_on_decode: int) -> None:
        tokens = req.context - cached_on_decode
        source = req.prefill_engine
        start, end = self.links.book(
            source.engine_id, tokens, source.kv_bytes_per_token, self.env.now
        )
        self.env.schedule(
            start, self._transfer_start_event, req, decode, tokens, priority=PRIORITY_COMPLETE
        )
        self.env.schedule(end, self._transfer_end, req, decode, priority=PRIORITY_COMPLETE)

    def _transfer_start_event(self, req: SimTurn, decode: SimEngine, tokens: int) -> None:
        self.telemetry.turn(
            self.env.now,
            req.traj.key,
            req.turn,
            ev.KV_TRANSFER_START,
            req.prefill_engine.engine_id,
            req.context,
            0,
            req.context - tokens,
        )

    def _transfer_end(self, req: SimTurn, decode: SimEngine) -> None:
        if self._record:
            self._write(
                self._pack(
                    self.env.now,
                    req.traj.key,
                    req.turn,
                    ev.KV_TRANSFER_END,
                    decode.engine_id,
                    req.context,
                    0,
                    0,
                    0,
                )
            )
        source = req.prefill_engine
        source.release_hold(req)
        decode.transfer_arrived(req)
        if not source.accepting:  # only a switching slot waits for its engines to settle
            self.switcher.engine_settled(source)

    def on_decode_start(self, req: SimTurn, engine: SimEngine) -> None:
        now = self.env.now
        if req.first_decode_s < 0:
            req.first_decode_s = now
            self.tally.ttft_s.append(now - req.queued_s)
        traj = req.traj
        context = req.context
        if traj.state != "decoding" or traj.tokens != context:
            count, held = self._state_count, self._state_tokens
            old = traj.state
            count[old] -= 1
            held[old] -= traj.tokens
            count["decoding"] += 1
            held["decoding"] += context
            traj.state = "decoding"
            traj.tokens = context
        if self._record:
            self._write(
                self._pack(
                    now, traj.key, req.turn, ev.DECODE_START, engine.engine_id, context, 0, 0, 0
                )
            )

    def on_preempt(self, req: SimTurn, engine: SimEngine) -> None:
        self.tally.preemptions += 1
        self._set_state(req.traj, "queued", req.context)
        self.telemetry.turn(
            self.env.now,
            req.traj.key,
            req.turn,
            ev.PREFILL_QUEUED,
            engine.engine_id,
            req.context,
            0,
            0,
            0,
            detail_json(preempted=True, recompute_tokens=req.prefill_tokens),
        )

    def on_decode_end(self, req: SimTurn, engine: SimEngine) -> None:
        traj = req.traj
        k = req.turn
        now = self.env.now
        tally = self.tally
        context = req.context
        output = req.output
        record = self._record
        if record:
            self._write(
                self._pack(now, traj.key, k, ev.DECODE_END, engine.engine_id, context, 0, 0, output)
            )
        tally.turns_done += 1
        tally.decode_tokens += output
        store = self.kv_store
        if store is not None:
            store.write(engine.engine_id, traj.traj_key, context + output)
        tally.tpot_s.append((now - req.first_decode_s) / output)
        traj.prev_context = context
        traj.prev_output = output
        traj.done_turns += 1
        count, held = self._state_count, self._state_tokens
        old = traj.state
        count[old] -= 1
        held[old] -= traj.tokens
        if k + 1 < traj.num_turns:
            tokens = context + output
            count["in_tool"] += 1
            held["in_tool"] += tokens
            traj.state = "in_tool"
            traj.tokens = tokens
            if record:
                self._write(self._pack(now, traj.key, k, ev.TOOL_START, -1, 0, 0, 0, 0))
            end = now + traj.tool_latency_s[k]
            event = (PRIORITY_ARRIVAL, self._tool_end_cb, (traj,))
            if self._queue.setdefault(end, event) is event:
                heappush(self._heap, end)
            else:
                self.env.tie(end, event)
            return
        count["done"] += 1
        traj.state = "done"
        traj.tokens = 0
        if record:
            self._write(self._pack(now, traj.key, k, ev.TRAJ_END, -1, 0, 0, 0, 0))
            self.telemetry.log.seal_if_full()
        spec = traj.spec
        tally.completed += 1
        tally.completion_s.append(now - traj.start_s)
        self.placement.move(traj.decode_engine, None)
        traj.decode_engine = None
        for cached_on in traj.cached_on:
            cached_on.cache.retire(traj.traj_key)
        traj.cached_on.clear()
        del self.live[spec.trajectory_id]
        self.truth.remove(spec.trajectory_id)
        if store is not None:
            store.drop(traj.traj_key)
        if self.on_trajectory_done is not None:
            self.on_trajectory_done(traj)

    def _tool_end(self, traj: TrajState) -> None:
        if self._record:
            self._write(self._pack(self.env.now, traj.key, traj.turn, ev.TOOL_END, -1, 0, 0, 0, 0))
        traj.turn += 1
        self._start_turn(traj)

    def on_engine_idle(self, engine: SimEngine) -> None:
        if not engine.accepting:  # only a switching slot waits for its engines to settle
            self.switcher.engine_settled(engine)

    def fail_capacity(self, req: SimTurn, engine: SimEngine) -> None:
        raise CapacityError(
            f"trajectory {req.traj.spec.trajectory_id} turn {req.turn} needs "
            f"{req.context + req.decoded} KV tokens but engine {engine.engine_id} holds only "
            f"{engine.seq_kv_capacity} for one sequence",
            hint=CAPACITY_HINT,
        )

    def on_migrate(self, engine: SimEngine, moved: list[tuple[SimTurn, int]]) -> None:
        for req, ctx in moved:
            self.tally.migrations += 1
            target = least_owned(self.decode_side, engine, SimEngine.decode_load)
            if target is None:
                raise ConfigError("cannot migrate: no other decode-side engine is serving")
            self.placement.move(req.traj.decode_engine, target)
            req.decode_engine = req.traj.decode_engine = target
            if target.reserve_migrated(ctx):
                _, end = self.links.book(
                    engine.engine_id, ctx, engine.kv_bytes_per_token, self.env.now
                )
                self.telemetry.turn(
                    self.env.now,
                    req.traj.key,
                    req.turn,
                    ev.KV_TRANSFER_START,
                    engine.engine_id,
                    ctx,
                    detail=detail_json(migrate=True),
                )
                self.env.schedule(end, self._migration_end, req, target, priority=PRIORITY_COMPLETE)
            else:
                # No room anywhere now: recompute on the target when memory frees up.
                req.recomputing = True
                req.local = True
                req.prefill_engine = target
                req.prefill_left = ctx
                req.recompute_tokens += ctx
                target.submit_prefill(req)
        self.switcher.engine_settled(engine)

    def _migration_end(self, req: SimTurn, target: SimEngine) -> None:
        self.telemetry.turn(
            self.env.now,
            req.traj.key,
            req.turn,
            ev.KV_TRANSFER_END,
            target.engine_id,
            req.context + req.decoded,
            detail=detail_json(migrate=True),
        )
        target.accept_migrated(req)

    # ------------------------------------------------------------- actuation
    def switch_slot(self, slot_id: int, new_role: str) -> bool:
        """Begin moving ``slot_id`` to ``new_role``. Returns False if refused (logged)."""
        return self.switcher.switch(slot_id, new_role)

    def set_local_prefill_threshold(self, tokens: int) -> None:
        if tokens < 0:
            raise ConfigError("local_prefill_threshold must be >= 0")
        self.local_prefill_threshold = tokens

    # ------------------------------------------------------------ observation
    def slot_views(self) -> list[SlotView]:
        """Every slot as the controller sees it."""
        return [self._slot_view(slot) for slot in self.slots]

    @staticmethod
    def _slot_view(slot) -> SlotView:
        engines = slot.engines
        if len(engines) == 1:  # the common case, read directly (512 slots per tick)
            (e,) = engines
            queued = e.queued_prefill_tokens
            running = len(e.running) + len(e.decode_waiting)
            kv_used, kv_capacity = e.kv_used, e.kv_capacity
            busy, cached = e.phase != 0, e.cache.live_tokens
        else:
            queued = sum(e.queued_prefill_tokens for e in engines)
            running = sum(len(e.running) + len(e.decode_waiting) for e in engines)
            kv_used = sum(e.kv_used for e in engines)
            kv_capacity = sum(e.kv_capacity for e in engines)
            busy = any(e.phase != 0 for e in engines)
            cached = sum(e.cache.live_tokens for e in engines)
        return SlotView.of(
            slot_id=slot.slot_id,
            role=slot.role,
            target_role=slot.target_role,
            gpus=slot.gpus,
            engines=len(engines),
            queued_prefill_tokens=queued,
            running_sequences=running,
            kv_used_tokens=kv_used,
            kv_capacity_tokens=kv_capacity,
            busy=busy,
            since_s=slot.since_s,
            cached_tokens=cached,
            source_role=slot.switch.from_role if slot.switch is not None else None,
            drained_s=slot.switch.drained_s if slot.switch is not None else None,
        )

    def observe(
        self,
        spec: ClusterSpec,
        total_trajectories: int | None = None,
        workload: WorkloadShape | None = None,
    ) -> ClusterObservation:
        """The cluster now, as policies see it."""
        return build_observation(
            self.env.now,
            self.slot_views(),
            self.states,
            spec,
            completed=self.tally.completed,
            total=total_trajectories,
            local_prefill_threshold=self.local_prefill_threshold,
            work=self.prefill_work,
            workload=workload,
        )
