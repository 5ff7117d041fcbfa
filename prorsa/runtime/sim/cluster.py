"""The simulated cluster: slots of GPUs hosting engines, the router, KV transfers, the
trajectory lifecycle and its telemetry, and the role-switch actuator.

Routing follows the design's cluster model. Each trajectory sticks to one *decode-side*
engine (decode or colocated role), which keeps its full context. A turn is prefilled
either there (colocated engine, a turn under the local-prefill threshold, or no prefill
engine at all) or on a prefill engine, chosen to minimise queued plus uncached tokens
(sticky when the prefix cache makes that cheaper), whose KV is then pulled over a link.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections.abc import Callable

from prorsa.errors import ConfigError
from prorsa.policy.types import ROLES, SWITCHING, ClusterObservation, SlotView
from prorsa.runtime.sim.config import ClusterConfig
from prorsa.runtime.sim.core import PRIORITY_ARRIVAL, PRIORITY_COMPLETE, Environment
from prorsa.runtime.sim.engine import SimEngine, StepCosts
from prorsa.runtime.sim.request import TrajState, TurnRequest
from prorsa.telemetry.views import STATES
from prorsa.workload.spec import TrajectorySpec

logger = logging.getLogger(__name__)

DECODE_SIDE = ("decode", "colocated")


class Slot:
    """``gpus`` GPUs that change role together, hosting ``gpus // tp`` engines."""

    __slots__ = (
        "engines",
        "gpus",
        "history",
        "role",
        "since_s",
        "slot_id",
        "switch",
        "target_role",
    )

    def __init__(self, slot_id: int, gpus: int, role: str) -> None:
        self.slot_id = slot_id
        self.gpus = gpus
        self.role = role
        self.target_role: str | None = None
        self.since_s = 0.0
        self.engines: list[SimEngine] = []
        self.switch: dict | None = None
        self.history: list[tuple[float, str]] = [(0.0, role)]


class SimCluster:
    """Engines, routing, transfers, switching and telemetry of one simulation."""

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
        self.run_id = run_id
        self.record = record
        self.rows: list[tuple] = []
        self.local_prefill_threshold = config.local_prefill_threshold
        self.slots: list[Slot] = []
        self.engines: dict[int, SimEngine] = {}
        self.retired: list[SimEngine] = []  # engines replaced by a role switch
        # GPU-busy seconds booked when a slot changes role (busy while draining: "switching").
        self.busy_carry_s = dict.fromkeys((*ROLES, SWITCHING), 0.0)
        self.decode_side: list[SimEngine] = []
        self.prefill_side: list[SimEngine] = []
        self.link_free_at: dict[int, float] = {}
        self.state_counts = dict.fromkeys(STATES, 0)
        self.state_tokens = dict.fromkeys(STATES, 0)
        self.live: dict[str, TrajState] = {}
        self.completed = 0
        self.switches = 0
        self.preemptions = 0
        self.migrations = 0
        # Per-turn and per-trajectory results, accumulated as they happen so that run
        # metrics need no pass over the telemetry (tests check both agree).
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []
        self.completion_s: list[float] = []
        self.turns_done = 0
        self.prefill_tokens_computed = 0
        self.prefill_tokens_cached = 0
        self.decode_tokens = 0
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
            self._build_engines(slot)
        self._refresh_eligible()
        if not self.decode_side:
            raise ConfigError("the allocation leaves no decode or colocated engine")

    # ---------------------------------------------------------------- topology
    def _build_engines(self, slot: Slot) -> None:
        cfg = self.config
        tp = cfg.role_tp[slot.role]
        profile = self.profiles[tp]
        ranks = 1
        if slot.role == "colocated" and cfg.dp_attention_ranks > 1:
            ranks = cfg.dp_attention_ranks
            if slot.gpus != ranks * tp:
                raise ConfigError(
                    f"dp_attention_ranks={ranks} needs slots of ranks x tp = {ranks * tp} GPUs "
                    f"(slots have {slot.gpus}); set role_tp so max(role_tp) matches"
                )
        costs = StepCosts(profile, ranks)
        kv = (cfg.kv_capacity_tokens or profile.kv_capacity_tokens) * ranks
        batch = (cfg.max_batch or profile.max_batch) * ranks
        budget = cfg.max_step_tokens or profile.max_step_tokens
        slot.engines = [
            SimEngine(
                self,
                slot.slot_id * slot.gpus + i * tp * ranks,
                slot.slot_id,
                slot.role,
                tp * ranks,
                costs,
                kv,
                batch,
                budget,
            )
            for i in range(slot.gpus // (tp * ranks))
        ]
        for engine in slot.engines:
            self.engines[engine.engine_id] = engine

    def _refresh_eligible(self) -> None:
        decode_side, prefill_side = [], []
        for slot in self.slots:
            if slot.role in DECODE_SIDE:
                decode_side += slot.engines
            elif slot.role == "prefill":
                prefill_side += slot.engines
        self.decode_side = decode_side
        self.prefill_side = prefill_side
        self._rebuild_owner_heap()

    @property
    def kv_capacity_tokens(self) -> int:
        return min(e.kv_capacity for e in self.engines.values())

    # --------------------------------------------------------------- telemetry
    def emit(
        self,
        traj: TrajState | None,
        turn: int,
        kind: str,
        engine: int = -1,
        ctx: int = 0,
        new: int = 0,
        cached: int = 0,
        out: int = 0,
        detail: str = "",
    ) -> None:
        if not self.record:
            return
        if traj is None:
            self.rows.append(
                (self.env.now, self.run_id, "", "", "", turn, kind, engine, 0, 0, 0, 0, detail)
            )
        else:
            self.rows.append(
                (
                    self.env.now,
                    self.run_id,
                    *traj.row_key,
                    turn,
                    kind,
                    engine,
                    ctx,
                    new,
                    cached,
                    out,
                    detail,
                )
            )

    def _set_state(self, traj: TrajState, state: str, tokens: int) -> None:
        counts, sums = self.state_counts, self.state_tokens
        counts[traj.state] -= 1
        sums[traj.state] -= traj.tokens
        counts[state] += 1
        sums[state] += tokens
        traj.state = state
        traj.tokens = tokens
        traj.state_since_s = self.env.now

    # -------------------------------------------------------------- lifecycle
    def start_trajectory(self, spec: TrajectorySpec) -> TrajState:
        """Launch a trajectory now: its first turn is routed immediately."""
        traj = TrajState(spec, self.env.now)
        self.live[spec.trajectory_id] = traj
        self.state_counts["queued"] += 1
        self.emit(traj, 0, "traj_start")
        self._start_turn(traj)
        return traj

    def _start_turn(self, traj: TrajState) -> None:
        spec = traj.spec
        k = traj.turn
        new = int(spec.new_tokens[k])
        context = traj.prev_context + traj.prev_output + new
        req = TurnRequest(traj, k, context, int(spec.output_tokens[k]))
        req.queued_s = self.env.now
        self._set_state(traj, "queued", context)
        self.emit(traj, k, "prefill_queued", -1, context, new, 0)
        self._route(req, new)

    def _route(self, req: TurnRequest, appended: int) -> None:
        traj = req.traj
        decode = self._choose_decode(traj)
        req.decode_engine = decode
        self._assign(traj, decode)
        # A small append is prefilled where the context already lives; if the decode engine
        # has lost that context, recomputing it there would stall its batch, so it goes to a
        # prefill engine like any other turn.
        local = (
            decode.role == "colocated"
            or not self.prefill_side
            or (
                appended < self.local_prefill_threshold
                and decode.cache.peek(traj.traj_key) >= req.context - appended
            )
        )
        req.local = local
        if local:
            req.prefill_engine = decode
            req.prefill_left = req.context - decode.cache.peek(traj.traj_key)
            self._send_prefill(req, decode)
            return
        prefill = self._choose_prefill(traj, req.context)
        req.prefill_engine = prefill
        traj.prefill_engine = prefill
        cached = prefill.cache.peek(traj.traj_key)
        on_decode = min(decode.cache.peek(traj.traj_key), req.context - 1)
        if self.config.reuse_mode == "pull" and on_decode > cached:
            # The decode engine holds the whole previous context (its last output included):
            # copying the part the prefill engine lacks is far cheaper than recomputing it,
            # and the prefill engine then only computes the new tokens.
            tokens = on_decode - cached
            _, end = self._link_slot(decode.engine_id, tokens, decode)
            req.prefill_left = req.context - on_decode
            self.env.schedule(
                end, self._pull_done, req, prefill, on_decode, priority=PRIORITY_ARRIVAL
            )
            return
        req.prefill_left = req.context - cached
        self._send_prefill(req, prefill)

    def _send_prefill(self, req: TurnRequest, engine: SimEngine) -> None:
        """Hand a prefill leg to ``engine`` after the per-request front-end overhead."""
        overhead = self.config.request_overhead_s
        if overhead <= 0:
            engine.submit_prefill(req)
        else:
            self.env.schedule(self.env.now + overhead, self._arrive_prefill, req, engine)

    def _arrive_prefill(self, req: TurnRequest, engine: SimEngine) -> None:
        if engine.accepting:
            engine.submit_prefill(req)
        else:  # the engine began switching while the request was on its way
            self._route(req, int(req.traj.spec.new_tokens[req.turn]))

    def _send_decode(self, req: TurnRequest, engine: SimEngine) -> None:
        """Hand a decode leg (KV pull) to ``engine`` after the front-end overhead."""
        overhead = self.config.request_overhead_s
        if overhead <= 0:
            engine.submit_incoming(req)
        else:
            self.env.schedule(self.env.now + overhead, self._arrive_decode, req, engine)

    def _arrive_decode(self, req: TurnRequest, engine: SimEngine) -> None:
        if not engine.accepting:
            engine = self._choose_decode(req.traj)
            req.decode_engine = engine
            self._assign(req.traj, engine)
        engine.submit_incoming(req)

    def _pull_done(self, req: TurnRequest, prefill: SimEngine, cached: int) -> None:
        # The pulled blocks travel with the request into memory reserved at admission
        # (not into the evictable cache, where a long queue could lose them again).
        req.pulled = cached
        if prefill.accepting:
            prefill.submit_prefill(req)
        else:
            self._route(req, int(req.traj.spec.new_tokens[req.turn]))

    def _choose_decode(self, traj: TrajState) -> SimEngine:
        sticky = traj.decode_engine
        if sticky is not None and sticky.accepting and sticky.role in DECODE_SIDE:
            return sticky
        if not self.decode_side:
            raise ConfigError("no decode or colocated engine is serving")
        # Trajectories come back turn after turn, so balance on who owns them (fewest
        # first, then engine order). A lazy heap keeps this O(log engines): entries whose
        # count changed since they were pushed are skipped.
        heap = self._owner_heap
        while True:
            owned, _, engine = heap[0]
            if owned == engine.owned and engine.accepting and engine.role in DECODE_SIDE:
                return engine
            heapq.heappop(heap)

    def _assign(self, traj: TrajState, engine: SimEngine) -> None:
        old = traj.decode_engine
        if old is engine:
            return
        if old is not None:
            self._owned_changed(old, -1)
        self._owned_changed(engine, +1)
        traj.decode_engine = engine

    def _owned_changed(self, engine: SimEngine, delta: int) -> None:
        engine.owned += delta
        if engine.accepting and engine.role in DECODE_SIDE:
            heapq.heappush(self._owner_heap, (engine.owned, self._order[engine], engine))
            if len(self._owner_heap) > 8 * len(self.decode_side) + 64:
                self._rebuild_owner_heap()

    def _rebuild_owner_heap(self) -> None:
        self._order = {e: i for i, e in enumerate(self.decode_side)}
        self._owner_heap = [(e.owned, i, e) for i, e in enumerate(self.decode_side)]
        heapq.heapify(self._owner_heap)

    def _choose_prefill(self, traj: TrajState, context: int) -> SimEngine:
        engines = self.prefill_side
        if len(engines) <= 8:
            least = min(engines, key=_queued_tokens)
        else:
            # Power of two choices: near-least-loaded at O(1) per turn on large clusters.
            i, j = self.env.rng.integers(len(engines), size=2)
            a, b = engines[i], engines[j]
            least = a if a.queued_prefill_tokens <= b.queued_prefill_tokens else b
        sticky = traj.prefill_engine
        if sticky is None or sticky is least or not sticky.accepting or sticky.role != "prefill":
            return least
        key = traj.traj_key
        sticky_cost = sticky.queued_prefill_tokens + context - sticky.cache.peek(key)
        least_cost = least.queued_prefill_tokens + context - least.cache.peek(key)
        return sticky if sticky_cost <= least_cost else least

    # ----------------------------------------------------------- engine hooks
    def on_prefill_start(self, req: TurnRequest, engine: SimEngine) -> None:
        traj = req.traj
        req.prefill_attempts += 1
        if req.prefill_attempts == 1:
            self.prefill_tokens_computed += req.prefill_tokens
            self.prefill_tokens_cached += req.cached
        self._set_state(traj, "prefilling", req.context)
        detail = (
            json.dumps({"recompute": True})
            if req.recompute_tokens and req.cached == 0 and req.decoded
            else ""
        )
        self.emit(
            traj,
            req.turn,
            "prefill_start",
            engine.engine_id,
            req.context,
            req.prefill_tokens,
            req.cached,
            0,
            detail,
        )

    def on_prefill_end(self, req: TurnRequest, engine: SimEngine, *, local: bool) -> None:
        traj = req.traj
        self.emit(
            traj,
            req.turn,
            "prefill_end",
            engine.engine_id,
            req.context,
            req.prefill_tokens,
            req.cached,
        )
        if traj.group_key and req.turn == 0:
            engine.cache.put(traj.group_key, traj.spec.shared_prompt_tokens)
        if local:
            self._set_state(traj, "decoding", req.context)
            return
        self._set_state(traj, "transferring", req.context)
        decode = req.decode_engine
        if not decode.accepting:
            decode = self._choose_decode(traj)
            req.decode_engine = decode
            self._assign(traj, decode)
        self._send_decode(req, decode)

    def start_transfer(self, req: TurnRequest, decode: SimEngine, cached_on_decode: int) -> None:
        tokens = req.context - cached_on_decode
        source = req.prefill_engine
        start, end = self._link_slot(source.engine_id, tokens, source)
        self.env.schedule(
            start, self._transfer_start_event, req, decode, tokens, priority=PRIORITY_COMPLETE
        )
        self.env.schedule(end, self._transfer_end, req, decode, priority=PRIORITY_COMPLETE)

    def _link_slot(self, source_id: int, tokens: int, engine: SimEngine) -> tuple[float, float]:
        cfg = self.config
        profile = self.profiles[engine.tp if engine.tp in self.profiles else 1]
        seconds = cfg.transfer_base_s + tokens * profile.kv_bytes_per_token / (
            cfg.transfer_bandwidth_gbytes_per_s * 1e9
        )
        now = self.env.now
        start = now
        if cfg.link_contention:
            start = max(now, self.link_free_at.get(source_id, 0.0))
            self.link_free_at[source_id] = start + seconds
        return start, start + seconds

    def _transfer_start_event(self, req: TurnRequest, decode: SimEngine, tokens: int) -> None:
        self.emit(
            req.traj,
            req.turn,
            "kv_transfer_start",
            req.prefill_engine.engine_id,
            req.context,
            0,
            req.context - tokens,
        )

    def _transfer_end(self, req: TurnRequest, decode: SimEngine) -> None:
        self.emit(req.traj, req.turn, "kv_transfer_end", decode.engine_id, req.context)
        req.prefill_engine.release_hold(req)
        decode.transfer_arrived(req)
        self._check_drained(req.prefill_engine)

    def on_decode_start(self, req: TurnRequest, engine: SimEngine) -> None:
        if req.first_decode_s < 0:
            req.first_decode_s = self.env.now
            self.ttft_s.append(self.env.now - req.queued_s)
        self._set_state(req.traj, "decoding", req.context)
        self.emit(req.traj, req.turn, "decode_start", engine.engine_id, req.context)

    def on_preempt(self, req: TurnRequest, engine: SimEngine) -> None:
        self.preemptions += 1
        self._set_state(req.traj, "queued", req.context)
        self.emit(
            req.traj,
            req.turn,
            "prefill_queued",
            engine.engine_id,
            req.context,
            0,
            0,
            0,
            json.dumps({"preempted": True, "recompute_tokens": req.prefill_tokens}),
        )

    def on_decode_end(self, req: TurnRequest, engine: SimEngine) -> None:
        traj = req.traj
        spec = traj.spec
        k = req.turn
        self.emit(traj, k, "decode_end", engine.engine_id, req.context, 0, 0, req.output)
        self.turns_done += 1
        self.decode_tokens += req.output
        self.tpot_s.append((self.env.now - req.first_decode_s) / req.output)
        traj.prev_context = req.context
        traj.prev_output = req.output
        traj.done_turns += 1
        if k + 1 < spec.num_turns:
            self._set_state(traj, "in_tool", req.context + req.output)
            self.emit(traj, k, "tool_start")
            self.env.schedule(
                self.env.now + float(spec.tool_latency_s[k]),
                self._tool_end,
                traj,
                priority=PRIORITY_ARRIVAL,
            )
        else:
            self._set_state(traj, "done", 0)
            self.emit(traj, k, "traj_end")
            self.completed += 1
            self.completion_s.append(self.env.now - traj.start_s)
            self._owned_changed(traj.decode_engine, -1)
            traj.decode_engine = None
            del self.live[spec.trajectory_id]
            if self.on_trajectory_done is not None:
                self.on_trajectory_done(traj)

    def _tool_end(self, traj: TrajState) -> None:
        self.emit(traj, traj.turn, "tool_end")
        traj.turn += 1
        self._start_turn(traj)

    def on_engine_idle(self, engine: SimEngine) -> None:
        self._check_drained(engine)

    def fail_capacity(self, req: TurnRequest, engine: SimEngine) -> None:
        raise ConfigError(
            f"trajectory {req.traj.spec.trajectory_id} turn {req.turn} needs "
            f"{req.context + req.decoded} KV tokens but engine {engine.engine_id} holds only "
            f"{engine.kv_capacity}",
            hint="use a profile with more memory per engine, a higher TP, or shorter contexts",
        )

    def on_migrate(self, engine: SimEngine, moved: list[tuple[TurnRequest, int]]) -> None:
        for req, ctx in moved:
            self.migrations += 1
            candidates = [e for e in self.decode_side if e is not engine]
            if not candidates:
                raise ConfigError("cannot migrate: no other decode-side engine is serving")
            target = min(candidates, key=_ownership_load)
            req.decode_engine = target
            self._assign(req.traj, target)
            if target.reserve_migrated(ctx):
                _, end = self._link_slot(engine.engine_id, ctx, engine)
                self.emit(
                    req.traj,
                    req.turn,
                    "kv_transfer_start",
                    engine.engine_id,
                    ctx,
                    0,
                    0,
                    0,
                    json.dumps({"migrate": True}),
                )
                self.env.schedule(
                    end, self._migration_end, req, target, engine, priority=PRIORITY_COMPLETE
                )
            else:
                # No room anywhere now: recompute on the target when memory frees up.
                req.recomputing = True
                req.local = True
                req.prefill_engine = target
                req.prefill_left = ctx
                req.recompute_tokens += ctx
                target.submit_prefill(req)
        self._check_drained(engine)

    def _migration_end(self, req: TurnRequest, target: SimEngine, source: SimEngine) -> None:
        self.emit(
            req.traj,
            req.turn,
            "kv_transfer_end",
            target.engine_id,
            req.context + req.decoded,
            0,
            0,
            0,
            json.dumps({"migrate": True}),
        )
        target.accept_migrated(req)

    # ------------------------------------------------------------- switching
    def switch_slot(self, slot_id: int, new_role: str) -> bool:
        """Begin moving ``slot_id`` to ``new_role``. Returns False if refused (logged)."""
        if new_role not in ROLES:
            raise ConfigError(f"unknown role '{new_role}'")
        slot = self.slots[slot_id]
        if slot.role == SWITCHING:
            logger.debug("slot %d is already switching; ignored", slot_id)
            return False
        if slot.role == new_role:
            return False
        same_layout = self.config.role_tp[slot.role] == self.config.role_tp[new_role]
        if slot.role in DECODE_SIDE and new_role in DECODE_SIDE and same_layout:
            # Decode and colocated engines are the same engine (vLLM's kv_both): only the
            # router's use of it changes, so the switch is a relabel, with nothing to drain.
            self._relabel(slot, new_role)
            return True
        if slot.role in DECODE_SIDE:
            remaining = [e for e in self.decode_side if e.slot_id != slot_id]
            if not remaining:
                logger.info("refused: switching slot %d would leave no decode-side engine", slot_id)
                return False
        old_role = slot.role
        now = self.env.now
        slot.switch = {"from": old_role, "to": new_role, "start": now, "drained": None}
        slot.role = SWITCHING
        slot.target_role = new_role
        slot.since_s = now
        slot.history.append((now, SWITCHING))
        self.switches += 1
        # Work done from here on is draining, in GPU-time the slot holds as switching.
        self._close_busy(slot, old_role)
        for engine in slot.engines:
            engine.accepting = False
        self._refresh_eligible()
        self.emit(
            None,
            0,
            "role_switch_start",
            slot.engines[0].engine_id,
            detail=json.dumps(
                {
                    "slot": slot_id,
                    "from": old_role,
                    "to": new_role,
                    "stage": "stop_new_work",
                    "mode": self.config.switch_mode,
                }
            ),
        )
        for engine in slot.engines:
            for req in engine.take_queued_prefills():
                self._reroute_queued(req, engine)
            for req in engine.take_incoming():
                target = self._choose_decode(req.traj)
                req.decode_engine = target
                self._assign(req.traj, target)
                target.submit_incoming(req)
            if self.config.switch_mode == "migrate":
                engine.request_migration()
        if self.config.switch_mode == "drain" and self.config.drain_timeout_s < float("inf"):
            self.env.schedule(now + self.config.drain_timeout_s, self._drain_timeout, slot, now)
        self._check_slot(slot)
        return True

    def _relabel(self, slot: Slot, new_role: str) -> None:
        now = self.env.now
        old_role = slot.role
        self.switches += 1
        for stage, kind in (
            ("stop_new_work", "role_switch_start"),
            ("drained", "role_switch_start"),
            ("serving", "role_switch_end"),
        ):
            self.emit(
                None,
                0,
                kind,
                slot.engines[0].engine_id,
                detail=json.dumps(
                    {
                        "slot": slot.slot_id,
                        "from": old_role,
                        "to": new_role,
                        "stage": stage,
                        "relabel": True,
                        "total_s": 0.0,
                    }
                ),
            )
        slot.role = new_role
        slot.since_s = now
        slot.history.append((now, new_role))
        self._close_busy(slot, old_role)
        for engine in slot.engines:
            engine.role = new_role
        self._refresh_eligible()

    def _close_busy(self, slot: Slot, role: str) -> None:
        """Book the slot's busy GPU-seconds so far to ``role`` and restart its count."""
        for engine in slot.engines:
            self.busy_carry_s[role] += engine.busy_s * engine.tp
            engine.busy_s = 0.0

    def _reroute_queued(self, req: TurnRequest, engine: SimEngine) -> None:
        traj = req.traj
        if req.recomputing or (req.local and req.decoded):
            # Its KV (if any) is gone; recompute wherever the trajectory goes next.
            target = self._choose_decode(traj)
            req.decode_engine = req.prefill_engine = target
            self._assign(traj, target)
            target.submit_prefill(req)
            return
        self._route(req, int(traj.spec.new_tokens[req.turn]))

    def _drain_timeout(self, slot: Slot, started: float) -> None:
        if (
            slot.switch is None
            or slot.switch["start"] != started
            or slot.switch["drained"] is not None
        ):
            return
        for engine in slot.engines:
            engine.request_migration()

    def _check_drained(self, engine: SimEngine) -> None:
        slot = self.slots[engine.slot_id]
        if slot.role == SWITCHING:
            self._check_slot(slot)

    def _check_slot(self, slot: Slot) -> None:
        info = slot.switch
        if info is None or info["drained"] is not None:
            return
        if not all(e.is_empty() for e in slot.engines):
            return
        now = self.env.now
        info["drained"] = now
        self.emit(
            None,
            0,
            "role_switch_start",
            slot.engines[0].engine_id,
            detail=json.dumps(
                {
                    "slot": slot.slot_id,
                    "from": info["from"],
                    "to": info["to"],
                    "stage": "drained",
                    "drain_s": now - info["start"],
                }
            ),
        )
        latency = self.config.switch_latency_s
        if self.config.role_tp[info["from"]] != self.config.role_tp[info["to"]]:
            latency += self.config.reshard_latency_s
        self.env.schedule(now + latency, self._finish_switch, slot, priority=PRIORITY_COMPLETE)

    def _finish_switch(self, slot: Slot) -> None:
        info = slot.switch
        now = self.env.now
        old = slot.engines
        same_layout = self.config.role_tp[info["from"]] == self.config.role_tp[info["to"]]
        self._close_busy(slot, SWITCHING)
        for engine in old:
            self.retired.append(engine)
            del self.engines[engine.engine_id]
        slot.role = info["to"]
        slot.target_role = None
        slot.switch = None
        slot.since_s = now
        slot.history.append((now, slot.role))
        self._build_engines(slot)
        if same_layout and not self.config.switch_drops_prefix_cache:
            for new, prev in zip(slot.engines, old, strict=True):
                new.cache = prev.cache
        self._refresh_eligible()
        self.emit(
            None,
            0,
            "role_switch_end",
            slot.engines[0].engine_id,
            detail=json.dumps(
                {
                    "slot": slot.slot_id,
                    "from": info["from"],
                    "to": info["to"],
                    "stage": "serving",
                    "total_s": now - info["start"],
                }
            ),
        )

    def set_local_prefill_threshold(self, tokens: int) -> None:
        if tokens < 0:
            raise ConfigError("local_prefill_threshold must be >= 0")
        self.local_prefill_threshold = tokens

    # ------------------------------------------------------------ observation
    def observe(
        self,
        prefill_tps: dict[str, float],
        decode_tps: dict[str, float],
        total_trajectories: int | None = None,
    ) -> ClusterObservation:
        views = []
        for slot in self.slots:
            engines = slot.engines
            views.append(
                SlotView(
                    slot_id=slot.slot_id,
                    role=slot.role,
                    target_role=slot.target_role,
                    gpus=slot.gpus,
                    engines=len(engines),
                    queued_prefill_tokens=sum(e.queued_prefill_tokens for e in engines),
                    running_sequences=sum(len(e.running) + len(e.decode_waiting) for e in engines),
                    kv_used_tokens=sum(e.kv_used for e in engines),
                    kv_capacity_tokens=sum(e.kv_capacity for e in engines),
                    busy=any(e.phase != 0 for e in engines),
                    since_s=slot.since_s,
                    cached_tokens=sum(e.cache.total for e in engines),
                )
            )
        return ClusterObservation(
            time_s=self.env.now,
            slots=tuple(views),
            trajectory_state=dict(self.state_counts),
            trajectory_tokens=dict(self.state_tokens),
            prefill_tokens_per_s=prefill_tps,
            decode_tokens_per_s=decode_tps,
            completed_trajectories=self.completed,
            total_trajectories=total_trajectories,
            local_prefill_threshold=self.local_prefill_threshold,
            live=self,
        )


def _ownership_load(engine: SimEngine) -> tuple[int, int]:
    return engine.owned, engine.decode_load()


def _queued_tokens(engine: SimEngine) -> int:
    return engine.queued_prefill_tokens
