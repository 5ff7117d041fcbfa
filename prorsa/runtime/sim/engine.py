"""One simulated engine: continuous batching with chunked prefill, advanced in closed form.

An engine alternates between two kinds of segments:

* a *step*: one iteration that decodes every running sequence once and fills the rest of
  the token budget with prefill chunks (decode first, as vLLM schedules). Used while
  prefill work is waiting; one event per step.
* an *epoch*: decode-only iterations while the batch is fixed. Step ``j`` of an epoch
  costs ``max(a + b*B + c*(S + j*B), floor)`` (every sequence grows by one token per
  step), so the time of ``k`` steps is an arithmetic series and the next batch change
  (first completion, or KV exhaustion) is found without ticking per token.

New work during an epoch cuts it at the end of the step in progress, exactly where a
real engine would pick the work up. KV admission waits while memory is short; if running
sequences outgrow memory, the most recently admitted one is preempted and recomputed
(vLLM's default recompute preemption).

This is the simulator's hot path (a few calls per simulated turn), so the common case is
written out inline: events go onto the environment's heap directly, the decode-series
arithmetic lives in :class:`StepCosts`, and the per-rank hooks a data-parallel engine
overrides are only called when ``per_rank`` is set.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Protocol

from prorsa.runtime.sim.core import PRIORITY_COMPLETE, PRIORITY_PLAN, Environment
from prorsa.runtime.sim.prefix_cache import PrefixCache
from prorsa.runtime.sim.request import SimTurn

if TYPE_CHECKING:
    from prorsa.runtime.sim.cost import CostProfile

IDLE, STEP, EPOCH = 0, 1, 2


class EngineEvents(Protocol):
    """What an engine tells the cluster it belongs to (the simulator's cluster implements it).

    Engines only report; the cluster decides what happens next (routing, transfers,
    telemetry, bookkeeping).
    """

    def on_prefill_start(self, req: SimTurn, engine: SimEngine) -> None:
        """The first chunk of ``req``'s prefill is scheduled on ``engine``."""

    def on_prefill_end(self, req: SimTurn, engine: SimEngine, *, local: bool) -> None:
        """``req``'s prefill finished; ``local``: it decodes here, else its KV must move."""

    def start_transfer(self, req: SimTurn, decode: SimEngine, cached_on_decode: int) -> None:
        """``decode`` reserved KV for ``req``: copy it from the prefill engine."""

    def on_decode_start(self, req: SimTurn, engine: SimEngine) -> None:
        """``req`` joined ``engine``'s decode batch."""

    def on_decode_end(self, req: SimTurn, engine: SimEngine) -> None:
        """``req`` decoded its last token on ``engine``."""

    def on_preempt(self, req: SimTurn, engine: SimEngine) -> None:
        """``req`` was preempted (its KV dropped) and will be recomputed on ``engine``."""

    def on_migrate(self, engine: SimEngine, moved: list[tuple[SimTurn, int]]) -> None:
        """``engine`` handed over its decodes (with their current contexts) for migration."""

    def on_engine_idle(self, engine: SimEngine) -> None:
        """``engine`` has nothing left to run."""

    def fail_capacity(self, req: SimTurn, engine: SimEngine) -> None:
        """``req`` can never fit ``engine``'s KV memory (raises)."""


class StepCosts:
    """The cost profile's coefficients as plain floats (attribute access is the hot path).

    :meth:`run_time` is :meth:`CostProfile.decode_run_time_s` written out over these
    floats, operation for operation, so it returns the same bits without the profile's
    argument conversions.
    """

    __slots__ = ("da", "db", "dc", "floor", "mix", "pa", "pb", "pc", "profile")

    def __init__(self, profile: CostProfile, dp_ranks: int = 1) -> None:
        if dp_ranks > 1:
            # With data-parallel attention the batch is spread over the ranks, which step
            # in lock-step: a step costs one rank's share of sequences and context.
            profile = dataclasses.replace(
                profile,
                decode_per_seq_s=profile.decode_per_seq_s / dp_ranks,
                decode_per_ctx_token_s=profile.decode_per_ctx_token_s / dp_ranks,
            )
        self.profile = profile
        self.pa = profile.prefill_base_s
        self.pb = profile.prefill_per_token_s
        self.pc = profile.prefill_attn_s_per_token2
        self.da = profile.decode_base_s
        self.db = profile.decode_per_seq_s
        self.dc = profile.decode_per_ctx_token_s
        self.floor = profile.decode_floor_s
        self.mix = profile.mixed_overhead_s

    def run_time(self, batch: int, ctx_sum: int, k: int) -> float:
        """Time of ``k`` decode-only steps of ``batch`` sequences holding ``ctx_sum`` tokens
        (each step adds ``batch`` tokens), floor included: the profile's closed form."""
        if k <= 0 or batch <= 0:
            return 0.0
        b = float(batch)
        d0 = self.da + self.db * b + self.dc * ctx_sum
        slope = self.dc * b
        floor = self.floor
        # steps below the floor come first (step times only grow); they each cost the floor
        if d0 >= floor:
            at_floor = 0
        elif slope <= 0:
            at_floor = k
        else:
            at_floor = min(k, math.ceil((floor - d0) / slope))
        rest = k - at_floor
        return at_floor * floor + rest * d0 + slope * (k * (k - 1) - at_floor * (at_floor - 1)) / 2

    def chunk(self, tokens: int, prior: int) -> float:
        """Prefill part of a chunk of ``tokens`` on top of ``prior`` tokens of context."""
        return self.pb * tokens + self.pc * tokens * (prior + tokens / 2)

    def cut(self, elapsed: float, k_max: int, batch: int, ctx_sum: int) -> tuple[int, float]:
        """Where a decode epoch of ``k_max`` steps started ``elapsed`` seconds ago can stop:
        ``(boundary, run_time(boundary))`` with ``boundary`` the step in progress (the
        number of whole steps done plus one, at most ``k_max``).

        Inverts the arithmetic series in closed form, then corrects the rounding by at most
        a step either way against :meth:`run_time` (the definition of truth); the time of
        the boundary is the last value that check computed.
        """
        d0 = self.da + self.db * batch + self.dc * ctx_sum
        slope = self.dc * batch
        floor = self.floor
        tol = elapsed + 1e-12
        if d0 >= floor:
            # No step at the floor: run_time(k) is k*d0 + slope*k*(k-1)/2, the same
            # operations run_time performs in this case, inline.
            k = _series_steps(elapsed, d0, slope)
            k = 0 if k < 0 else (k_max if k > k_max else k)
            while k > 0 and k * d0 + slope * (k * (k - 1)) / 2 > tol:
                k -= 1
            while k < k_max:
                after = (k + 1) * d0 + slope * ((k + 1) * k) / 2
                if after > tol:
                    return k + 1, after
                k += 1
            return k_max, -1.0
        at_floor = k_max if slope <= 0 else min(k_max, math.ceil((floor - d0) / slope))
        if elapsed < at_floor * floor:
            guess = int(elapsed / floor)
        else:
            guess = at_floor + _series_steps(
                elapsed - at_floor * floor, d0 + slope * at_floor, slope
            )
        k = min(max(guess, 0), k_max)
        run_time = self.run_time
        while k > 0:
            at = run_time(batch, ctx_sum, k)
            if at <= tol:
                break
            k -= 1
        while k < k_max:
            after = run_time(batch, ctx_sum, k + 1)
            if after > tol:
                return k + 1, after
            k += 1
        return k_max, -1.0


def _series_steps(elapsed: float, first: float, slope: float) -> int:
    """Whole steps of an arithmetic series (first, first+slope, ...) within ``elapsed``."""
    if slope <= 0:
        return int(elapsed / first) if first > 0 else 0
    # slope/2 k^2 + (first - slope/2) k - elapsed = 0
    b = first - slope / 2
    return int((-b + math.sqrt(b * b + 2 * slope * elapsed)) / slope)


class SimEngine:
    """A model replica of tensor-parallel degree ``tp`` in one role."""

    __slots__ = (
        "_end_epoch_cb",
        "_end_step_cb",
        "_epoch_end",
        "_epoch_event",
        "_finish_heap",
        "_heap",
        "_heap_seq",
        "_plan_cb",
        "_queue",
        "accepting",
        "at_boundary",
        "boundary_pending",
        "budget",
        "busy_s",
        "cache",
        "costs",
        "ctx_sum",
        "decode_waiting",
        "engine_id",
        "env",
        "epoch_batch",
        "epoch_ctx",
        "epoch_k",
        "epoch_start",
        "events",
        "held_for_transfer",
        "incoming",
        "incoming_tokens",
        "kv_bytes_per_token",
        "kv_capacity",
        "kv_used",
        "max_batch",
        "migrate_requested",
        "owned",
        "phase",
        "plan_pending",
        "preemptions",
        "prefill_active",
        "prefill_queue",
        "queued_prefill_tokens",
        "recompute_tokens",
        "role",
        "running",
        "seq_kv_capacity",
        "slot_id",
        "step_chunks",
        "step_started",
        "steps",
        "tp",
        "transfers_in",
        "version",
    )

    #: True for engines whose steps are priced per data-parallel rank: the cost hooks
    #: (``_select_chunks``, ``_step_s``, ``_epoch_shape``, ``_grow``) are then called
    #: instead of the inline single-rank arithmetic.
    per_rank = False

    def __init__(
        self,
        env: Environment,
        events: EngineEvents,
        engine_id: int,
        slot_id: int,
        role: str,
        tp: int,
        costs: StepCosts,
        kv_capacity_tokens: int,
        max_batch: int,
        max_step_tokens: int,
    ) -> None:
        self.env = env
        self._heap = env.heap
        self._queue = env.queue
        # Bound once: a bound method is otherwise built for every scheduled event.
        self._plan_cb = self._plan_event
        self._end_step_cb = self._end_step
        self._end_epoch_cb = self._end_epoch
        self._epoch_end = 0.0  # when the current epoch's end event is queued
        self._epoch_event: tuple | None = None
        self.events = events
        self.engine_id = engine_id
        self.slot_id = slot_id
        self.role = role
        self.tp = tp
        self.costs = costs
        self.kv_capacity = kv_capacity_tokens
        # The most KV one sequence may hold: all of it here; one rank's share on an
        # engine of data-parallel ranks (a sequence lives on one rank, as in vLLM).
        self.seq_kv_capacity = kv_capacity_tokens
        self.kv_bytes_per_token = 0.0  # KV bytes one token moves between engines (set at build)
        self.max_batch = max_batch
        self.budget = max_step_tokens
        self.accepting = True  # false while draining for a role switch
        self.owned = 0  # live trajectories whose decode side sticks to this engine
        self.cache = PrefixCache()
        self.prefill_queue: deque[SimTurn] = deque()  # waiting for KV admission
        self.prefill_active: deque[SimTurn] = deque()  # admitted, chunked FCFS
        self.queued_prefill_tokens = 0
        self.decode_waiting: deque[SimTurn] = deque()  # KV present, joins next boundary
        self.incoming: deque[SimTurn] = deque()  # remote KV waiting for room here
        self.incoming_tokens = 0
        self.running: dict[SimTurn, None] = {}  # admission order (for preemption)
        self._finish_heap: list[tuple[int, int, SimTurn]] = []
        self._heap_seq = 0
        self.steps = 0  # decode steps executed so far (sequence finish times key off it)
        self.ctx_sum = 0  # context tokens of running sequences, now
        self.kv_used = 0  # in-use KV tokens: prefills, holds for transfer, decodes, reserves
        self.held_for_transfer = 0
        self.transfers_in = 0  # reserved here, bytes still on the wire
        self.migrate_requested = False
        self.phase = IDLE
        self.version = 0
        self.plan_pending = False
        self.boundary_pending = False
        self.at_boundary = False  # retiring finished sequences; a re-plan follows
        self.epoch_start = 0.0
        self.epoch_k = 0
        self.epoch_batch = 0
        self.epoch_ctx = 0
        self.step_chunks: list[tuple[SimTurn, int]] = []
        self.step_started = 0.0
        self.busy_s = 0.0
        self.preemptions = 0
        self.recompute_tokens = 0

    # ----------------------------------------------------------------- load view
    @property
    def running_count(self) -> int:
        return len(self.running)

    def decode_load(self) -> int:
        """Sequences this engine is or will be decoding (router's balance metric)."""
        return len(self.running) + len(self.decode_waiting) + len(self.incoming)

    def is_empty(self) -> bool:
        return not (
            self.running
            or self.decode_waiting
            or self.incoming
            or self.prefill_queue
            or self.prefill_active
            or self.held_for_transfer
            or self.transfers_in
            or self.phase != IDLE
        )

    # --------------------------------------------------------------- submission
    def submit_prefill(self, req: SimTurn) -> None:
        """Queue ``req``'s prefill here (remote prefill or local prefill-then-decode)."""
        self.prefill_queue.append(req)
        self.queued_prefill_tokens += req.prefill_left
        self._wake()

    def submit_incoming(self, req: SimTurn) -> None:
        """A remote prefill finished: reserve KV here, then pull it over a link."""
        self.incoming.append(req)
        self.incoming_tokens += req.context
        self.pump_incoming()

    def pump_incoming(self) -> None:
        """Start transfers for incoming requests while KV can be reserved (FIFO)."""
        incoming = self.incoming
        cache = self.cache
        while incoming:
            req = incoming[0]
            key = req.traj.traj_key
            cached = cache.take(key)
            if not self._reserve(req.context):
                if cached:
                    cache.put(key, cached)
                return
            incoming.popleft()
            self.incoming_tokens -= req.context
            self.transfers_in += 1
            self.events.start_transfer(req, self, min(cached, req.context))

    def transfer_arrived(self, req: SimTurn) -> None:
        """KV of ``req`` landed here (reserved at pump time); decode from the next boundary."""
        self.transfers_in -= 1
        self.decode_waiting.append(req)
        self._wake()

    def release_hold(self, req: SimTurn) -> None:
        """The KV this prefill engine held for ``req``'s transfer has been copied out."""
        self.kv_used -= req.context
        self.held_for_transfer -= 1
        traj = req.traj
        self.cache.put(traj.traj_key, req.context)
        traj.cached_on.add(self)
        self._after_free()

    # ---------------------------------------------------------------- scheduling
    def _wake(self) -> None:
        phase = self.phase
        if phase == IDLE:
            if not self.plan_pending:
                self.plan_pending = True
                # Planned at PRIORITY_PLAN so that work arriving at the same instant is
                # batched into one step, as a real scheduler would see it.
                now = self.env.now
                event = (PRIORITY_PLAN, self._plan_cb, ())
                if self._queue.setdefault(now, event) is event:
                    heappush(self._heap, now)
                else:
                    self.env.tie(now, event)
        elif phase == EPOCH and not self.boundary_pending:
            # Cut the epoch at the end of the step in progress.
            start = self.epoch_start
            k_max = self.epoch_k
            boundary, end_offset = self.costs.cut(
                self.env.now - start, k_max, self.epoch_batch, self.epoch_ctx
            )
            self.boundary_pending = True
            if boundary < k_max:
                self.epoch_k = boundary
                self.version += 1
                # Withdraw the epoch's old end (Environment.withdraw, inline).
                queue = self._queue
                if queue.get(self._epoch_end) is self._epoch_event:
                    del queue[self._epoch_end]
                end = start + end_offset
                event = (PRIORITY_COMPLETE, self._end_epoch_cb, (self.version,))
                if queue.setdefault(end, event) is event:
                    heappush(self._heap, end)
                else:
                    self.env.tie(end, event)

    def _plan_event(self) -> None:
        self.plan_pending = False
        if self.phase == IDLE:
            self._plan()

    def _plan(self) -> None:
        now = self.env.now
        self.boundary_pending = False
        if self.migrate_requested:
            self.migrate_requested = False
            self.events.on_migrate(self, self._take_decodes())
        running = self.running
        waiting = self.decode_waiting
        if waiting:
            if self.per_rank:
                self._admit_decodes()
            else:
                max_batch = self.max_batch
                join = self._join
                while waiting and len(running) < max_batch:
                    join(waiting.popleft())
        if self.prefill_queue:
            self._admit_prefills()
        if self.prefill_active:
            events = self.events
            if self.per_rank:
                chunks = self._select_chunks()
                for req, _ in chunks:
                    if req.prefill_left == req.prefill_tokens:
                        events.on_prefill_start(req, self)
                duration = self._step_s(chunks)
            else:
                # _select_chunks and _step_s written out in one pass (the reports to the
                # cluster read nothing the pricing changes, and come in the same order).
                costs = self.costs
                pb, pc = costs.pb, costs.pc
                prefill_s = 0.0
                chunks = []
                budget = self.budget - len(running)
                if budget < 1:
                    budget = 1
                for req in self.prefill_active:
                    if budget <= 0:
                        break
                    left = req.prefill_left
                    n = left if left < budget else budget
                    chunks.append((req, n))
                    budget -= n
                    if left == req.prefill_tokens:
                        events.on_prefill_start(req, self)
                    # costs.chunk(n, prior), written out
                    prefill_s += pb * n + pc * n * (req.cached + req.prefill_tokens - left + n / 2)
                if running:
                    decode_s = costs.da + costs.db * len(running) + costs.dc * self.ctx_sum
                    duration = costs.mix + prefill_s + decode_s - costs.da
                    if duration < costs.floor:
                        duration = costs.floor
                else:
                    duration = costs.pa + prefill_s
            self.phase = STEP
            self.step_chunks = chunks
            self.step_started = now
            self.version += 1
            end = now + duration
            event = (PRIORITY_COMPLETE, self._end_step_cb, (self.version,))
            if self._queue.setdefault(end, event) is event:
                heappush(self._heap, end)
            else:
                self.env.tie(end, event)
        elif running:
            batch = len(running)
            heap = self._finish_heap
            top = heap[0]
            while top[2].heap_entry is not top:
                heappop(heap)  # drop stale entries before reading the next finish
                top = heap[0]
            first_finish = top[0] - self.steps
            free = self.kv_capacity - self.kv_used - self.cache.total
            if free < batch:
                # Running sequences grow by one token per step: make room for a stretch
                # of steps at once so eviction does not happen one step at a time.
                free = self.cache.evict_until(batch * 64, free)
            if free < batch:
                self._preempt_last()
                self._plan()
                return
            k_kv = free // batch
            k = first_finish if first_finish < k_kv else k_kv
            self.phase = EPOCH
            self.epoch_start = now
            self.epoch_k = k
            if self.per_rank:
                shape_batch, shape_ctx = self._epoch_shape()
                run_s = self.costs.run_time(shape_batch, shape_ctx, k)
            else:
                shape_batch, shape_ctx = batch, self.ctx_sum
                costs = self.costs
                d0 = costs.da + costs.db * batch + costs.dc * shape_ctx
                if d0 >= costs.floor:
                    # StepCosts.run_time when no step is at the floor, inline
                    run_s = k * d0 + costs.dc * batch * (k * (k - 1)) / 2
                else:
                    run_s = costs.run_time(batch, shape_ctx, k)
            self.epoch_batch = shape_batch
            self.epoch_ctx = shape_ctx
            self.version += 1
            end = self._epoch_end = now + run_s
            event = self._epoch_event = (PRIORITY_COMPLETE, self._end_epoch_cb, (self.version,))
            if self._queue.setdefault(end, event) is event:
                heappush(self._heap, end)
            else:
                self.env.tie(end, event)
        else:
            self.phase = IDLE
            self.events.on_engine_idle(self)

    def _end_step(self, version: int) -> None:
        if version != self.version:
            return
        now = self.env.now
        self.busy_s += now - self.step_started
        running = self.running
        per_rank = self.per_rank
        if running:
            self.steps += 1
            if per_rank:
                self._grow(1)
            else:
                grown = len(running)
                self.ctx_sum += grown
                self.kv_used += grown
        active = self.prefill_active
        for req, n in self.step_chunks:
            req.prefill_left -= n
            self.queued_prefill_tokens -= n
            if req.prefill_left == 0:
                if active[0] is req:
                    active.popleft()
                else:
                    active.remove(req)
                if per_rank:
                    self._prefill_done(req)
                elif req.local or req.recomputing:
                    # _prefill_done, inline: KV stays here, this engine decodes the turn.
                    req.recomputing = False
                    self.events.on_prefill_end(req, self, local=True)
                    self.decode_waiting.append(req)
                else:
                    self.held_for_transfer += 1
                    self.events.on_prefill_end(req, self, local=False)
        self.step_chunks = []
        self.phase = IDLE
        if self._finish_heap and self._finish_heap[0][0] <= self.steps:
            self._complete_finished()
        elif self.incoming:
            self.pump_incoming()
        self._plan()

    def _end_epoch(self, version: int) -> None:
        if version != self.version:
            return
        k = self.epoch_k
        self.busy_s += self.env.now - self.epoch_start
        self.steps += k
        if self.per_rank:
            self._grow(k)
        else:
            grown = k * len(self.running)
            self.ctx_sum += grown
            self.kv_used += grown
        self.phase = IDLE
        if self._finish_heap[0][0] <= self.steps:
            self._complete_finished()
        elif self.incoming:
            self.pump_incoming()
        self._plan()

    # ------------------------------------------------------- cost-model hooks
    # A data-parallel engine (``DpSimEngine``) overrides these to work per rank; the
    # single-rank engine inlines the last three in _plan, _end_step and _end_epoch.
    def _select_chunks(self) -> list[tuple[SimTurn, int]]:
        """Prefill chunks of the next step: FCFS into the budget the decodes leave."""
        budget = self.budget - len(self.running)
        if budget < 1:
            budget = 1
        chunks = []
        for req in self.prefill_active:
            if budget <= 0:
                break
            n = req.prefill_left if req.prefill_left < budget else budget
            chunks.append((req, n))
            budget -= n
        return chunks

    def _step_s(self, chunks: list[tuple[SimTurn, int]]) -> float:
        """Duration of a step decoding the running batch once and prefilling ``chunks``."""
        costs = self.costs
        prefill_s = 0.0
        for req, n in chunks:
            prefill_s += costs.chunk(n, req.cached + req.prefill_tokens - req.prefill_left)
        batch = len(self.running)
        if batch:
            decode_s = costs.da + costs.db * batch + costs.dc * self.ctx_sum
            return max(costs.mix + prefill_s + decode_s - costs.da, costs.floor)
        return costs.pa + prefill_s

    def _epoch_shape(self) -> tuple[int, int]:
        """``(batch, context sum)`` that price the decode-only steps from now."""
        return len(self.running), self.ctx_sum

    def _grow(self, steps: int) -> None:
        """Every running sequence decoded ``steps`` more tokens."""
        grown = steps * len(self.running)
        self.ctx_sum += grown
        self.kv_used += grown

    # -------------------------------------------------------------- prefill side
    def _admit_prefills(self) -> None:
        queue = self.prefill_queue
        cache = self.cache
        active = self.prefill_active
        while queue:
            req = queue[0]
            footprint = req.context + req.decoded if req.recomputing else req.context
            if footprint > self.seq_kv_capacity:
                self.events.fail_capacity(req, self)
            traj = req.traj
            traj_key = traj.traj_key
            pinned = cache.take(traj_key)
            # Keep headroom for the running batch to grow a while, so an admission does not
            # immediately force a preemption (vLLM's watermark plays the same role).
            need = footprint - pinned + 16 * len(self.running)
            free = self.kv_capacity - self.kv_used - cache.total
            if free < need:
                free = cache.evict_until(need, free)
                if free < need:
                    if pinned:
                        cache.put(traj_key, pinned)
                    return
            self.kv_used += footprint  # the reserved part plus the pinned prefix
            queue.popleft()
            if req.recomputing:
                cached = 0
            else:
                group_key = traj.group_key
                shared = cache.entries.get(group_key, 0) if group_key else 0
                # At least one token is always computed: the engine needs fresh logits.
                cached = max(pinned, shared, req.pulled)
                if cached > footprint - 1:
                    cached = footprint - 1
            left = footprint - cached
            self.queued_prefill_tokens += left - req.prefill_left
            req.cached = cached
            req.prefill_tokens = req.prefill_left = left
            active.append(req)

    def _prefill_done(self, req: SimTurn) -> None:
        if req.local or req.recomputing:
            # KV stays here: this engine decodes the turn.
            req.recomputing = False
            self.events.on_prefill_end(req, self, local=True)
            self.decode_waiting.append(req)
        else:
            self.held_for_transfer += 1
            self.events.on_prefill_end(req, self, local=False)

    # --------------------------------------------------------------- decode side
    def _admit_decodes(self) -> None:
        """Join waiting turns FCFS up to the batch cap (engines priced per rank override)."""
        waiting = self.decode_waiting
        while waiting and len(self.running) < self.max_batch:
            self._join(waiting.popleft())

    def _join(self, req: SimTurn) -> None:
        steps = self.steps
        req.join_step = steps
        ctx = req.ctx_at_join = req.context + req.decoded
        finish = req.finish_step = steps + req.output - req.decoded
        self._heap_seq += 1
        # The entry itself marks the join: a request preempted or migrated and admitted
        # again gets a new entry, and the old one is recognised as stale when popped.
        entry = req.heap_entry = (finish, self._heap_seq, req)
        heappush(self._finish_heap, entry)
        self.running[req] = None
        self.ctx_sum += ctx
        self.events.on_decode_start(req, self)

    def _leave(self, req: SimTurn) -> int:
        """Remove ``req`` from the batch; returns its current context length."""
        req.heap_entry = None
        del self.running[req]
        ctx = req.ctx_at_join + (self.steps - req.join_step)
        self.ctx_sum -= ctx
        return ctx

    def _complete_finished(self) -> None:
        """At a step boundary: retire the sequences that decoded their last token."""
        heap = self._finish_heap
        steps = self.steps
        cache = self.cache
        on_decode_end = self.events.on_decode_end
        leave = self._leave
        # The boundary re-plans right after: nothing freed here needs a plan of its own.
        self.at_boundary = True
        while heap and heap[0][0] <= steps:
            entry = heappop(heap)
            req = entry[2]
            if req.heap_entry is not entry:
                continue  # preempted or migrated since; a stale entry
            ctx = leave(req)
            req.decoded = req.output
            self.kv_used -= ctx
            traj = req.traj
            cache.put(traj.traj_key, ctx)
            traj.cached_on.add(self)
            on_decode_end(req, self)
        self.at_boundary = False
        if self.incoming:
            self.pump_incoming()

    def _preempt_last(self) -> None:
        req = next(reversed(self.running))
        ctx = self._leave(req)
        req.decoded = ctx - req.context
        self.kv_used -= ctx
        # Recompute: drop its KV and prefill context plus generated tokens again here.
        req.recomputing = True
        req.cached = 0
        req.prefill_tokens = req.prefill_left = ctx
        req.recompute_tokens += ctx
        self.recompute_tokens += ctx
        self.preemptions += 1
        self.prefill_queue.appendleft(req)
        self.queued_prefill_tokens += ctx
        self.events.on_preempt(req, self)

    def request_migration(self) -> None:
        """Hand every running and waiting decode to the cluster at the next step boundary."""
        self.migrate_requested = True
        self._wake()

    def _take_decodes(self) -> list[tuple[SimTurn, int]]:
        moved = []
        for req in list(self.running):
            ctx = self._leave(req)
            req.decoded = ctx - req.context
            self.kv_used -= ctx
            moved.append((req, ctx))
        while self.decode_waiting:
            req = self.decode_waiting.popleft()
            ctx = req.context + req.decoded
            self.kv_used -= ctx
            moved.append((req, ctx))
        return moved

    def take_queued_prefills(self) -> list[SimTurn]:
        """Remove prefills not yet admitted (they can be routed elsewhere)."""
        taken = list(self.prefill_queue)
        self.prefill_queue.clear()
        for req in taken:
            self.queued_prefill_tokens -= req.prefill_left
        return taken

    def take_incoming(self) -> list[SimTurn]:
        """Remove incoming transfers that have not started (they can go elsewhere)."""
        taken = list(self.incoming)
        self.incoming.clear()
        self.incoming_tokens = 0
        return taken

    # ------------------------------------------------------------------- memory
    def _reserve(self, tokens: int, headroom: int = 0) -> bool:
        free = self.kv_capacity - self.kv_used - self.cache.total
        if free < tokens + headroom:
            free = self.cache.evict_until(tokens + headroom, free)
            if free < tokens + headroom:
                return False
        self.kv_used += tokens
        return True

    def reserve_migrated(self, tokens: int) -> bool:
        return self._reserve(tokens)

    def _after_free(self) -> None:
        if self.incoming:
            self.pump_incoming()
        if self.prefill_queue and self.phase == IDLE and not self.at_boundary:
            self._wake()

    def accept_migrated(self, req: SimTurn) -> None:
        self.decode_waiting.append(req)
        self._wake()

    def drop_prefix_cache(self) -> None:
        self.cache.clear()
