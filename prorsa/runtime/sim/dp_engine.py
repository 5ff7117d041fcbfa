"""An engine of ``r`` data-parallel attention ranks stepping in lock-step (MoE layouts).

Each rank has its own decode batch, context and chunked-prefill budget; a step lasts as
long as its slowest rank plus the MoE layers every rank runs together, priced by a
:class:`~prorsa.runtime.sim.cost.LayoutCost` at the tokens each GPU really processes
(padded in all-gather mode), with the graph-loss penalty on every rank when any rank
prefills and the per-step scheduling time (see docs/cost_model.md). A layout of one rank
(a dense or MoE tensor-parallel engine) runs the same way with ``r = 1``.

What is simplified, and why it matters little: a request is assigned a rank once (the
least loaded, as vLLM's DP coordinator balances by queue length) and keeps it until its
turn ends; KV memory and the prefix cache are pooled over the engine's ranks (a rank's
KV imbalance is not modelled), but one sequence holds no more than one rank's share;
decode-only epochs are priced from the rank with the largest context, growing by the
largest rank batch per step (an upper bound, exact when ranks are balanced).

Semantics (``LayoutCost.semantics``): under vLLM's, a step mixes decode and prefill on
every rank; under SGLang's DP attention, a rank that prefills does not decode that step,
so its sequences finish one step later.
"""

from __future__ import annotations

import heapq
import math

from prorsa.runtime.sim.core import Environment
from prorsa.runtime.sim.engine import EngineEvents, SimEngine, _series_steps
from prorsa.runtime.sim.request import SimTurn


class LayoutStepCosts:
    """A :class:`LayoutCost` as the engine's closed-form decode series and step prices."""

    __slots__ = ("cost", "max_batch_per_rank", "max_step_tokens_per_rank", "ranks")

    def __init__(self, cost) -> None:
        self.cost = cost
        self.ranks = cost.dp_ranks
        self.max_batch_per_rank = cost.max_batch
        self.max_step_tokens_per_rank = cost.max_step_tokens

    def run_time(self, batch_max: int, ctx_max: int, k: int) -> float:
        """Time of ``k`` decode-only steps; the slowest rank holds ``batch_max`` sequences
        and ``ctx_max`` context tokens at the start."""
        return self.cost.decode_run_s(batch_max, ctx_max, k)

    def cut(self, elapsed: float, k_max: int, batch_max: int, ctx_max: int) -> tuple[int, float]:
        """``(boundary, run_time(boundary))``: the step in progress ``elapsed`` seconds into
        an epoch of ``k_max`` steps (whole steps done plus one, at most ``k_max``); see
        :meth:`StepCosts.cut`."""
        base, per_ctx = self.cost.decode_epoch_terms(batch_max)
        first = base + per_ctx * ctx_max
        guess = _series_steps(elapsed, first, per_ctx * batch_max)
        k = min(max(guess, 0), k_max)
        run_time = self.run_time
        tol = elapsed + 1e-12
        while k > 0 and run_time(batch_max, ctx_max, k) > tol:
            k -= 1
        while k < k_max:
            after = run_time(batch_max, ctx_max, k + 1)
            if after > tol:
                return k + 1, after
            k += 1
        return k_max, -1.0


class DpSimEngine(SimEngine):
    """A :class:`SimEngine` whose steps are priced per data-parallel rank."""

    __slots__ = ("prefill_rank_load", "rank_batch", "rank_ctx", "stall_on_prefill")

    per_rank = True

    def __init__(
        self,
        env: Environment,
        events: EngineEvents,
        engine_id: int,
        slot_id: int,
        role: str,
        gpus: int,
        costs: LayoutStepCosts,
        kv_capacity_tokens: int,
    ) -> None:
        ranks = costs.ranks
        super().__init__(
            env,
            events,
            engine_id,
            slot_id,
            role,
            gpus,
            costs,  # type: ignore[arg-type]
            kv_capacity_tokens,
            costs.max_batch_per_rank * ranks,
            costs.max_step_tokens_per_rank,
        )
        self.seq_kv_capacity = kv_capacity_tokens // ranks  # a sequence lives on one rank
        self.rank_batch = [0] * ranks
        self.rank_ctx = [0] * ranks
        self.prefill_rank_load = [0] * ranks  # prefills admitted per rank, not yet done
        self.stall_on_prefill = not costs.cost.mixes_prefill_with_decode

    # ------------------------------------------------------------- ranks
    def _least_loaded_rank(self, with_prefill: bool) -> int:
        """The rank with the least load; without prefill, -1 when every rank is full."""
        best, best_load = -1, math.inf
        cap = self.costs.max_batch_per_rank
        for i, batch in enumerate(self.rank_batch):
            load = batch + (self.prefill_rank_load[i] if with_prefill else 0)
            if load < best_load and (with_prefill or batch < cap):
                best, best_load = i, load
        return best

    def _admit_decodes(self) -> None:
        """Each rank schedules its own batch (vLLM runs one scheduler per DP rank): a turn
        prefilled on a rank waits for room on that rank, whatever room the others have;
        one without a rank joins the least loaded rank with room. Order is kept."""
        waiting = self.decode_waiting
        cap = self.costs.max_batch_per_rank
        rank_batch = self.rank_batch
        blocked = []
        while waiting:
            req = waiting.popleft()
            rank = req.rank if req.rank >= 0 else self._least_loaded_rank(with_prefill=False)
            if rank < 0 or rank_batch[rank] >= cap:
                blocked.append(req)
                if rank < 0:
                    break  # every rank is full: nothing behind it can join either
                continue
            req.rank = rank
            self._join(req)
        waiting.extendleft(reversed(blocked))

    def _join(self, req: SimTurn) -> None:
        if req.rank < 0:
            req.rank = self._least_loaded_rank(with_prefill=False)
        super()._join(req)
        self.rank_batch[req.rank] += 1
        self.rank_ctx[req.rank] += req.ctx_at_join

    def _leave(self, req: SimTurn) -> int:
        ctx = super()._leave(req)
        self.rank_batch[req.rank] -= 1
        self.rank_ctx[req.rank] -= ctx
        return ctx

    def _admit_prefills(self) -> None:
        active_before = len(self.prefill_active)
        super()._admit_prefills()
        for req in list(self.prefill_active)[active_before:]:
            if req.rank < 0:
                req.rank = self._least_loaded_rank(with_prefill=True)
            self.prefill_rank_load[req.rank] += 1

    def _prefill_done(self, req: SimTurn) -> None:
        self.prefill_rank_load[req.rank] -= 1
        local = req.local or req.recomputing
        super()._prefill_done(req)
        if not local:
            req.rank = -1  # its KV leaves for a decode engine, which picks its own rank

    def _take_decodes(self) -> list[tuple[SimTurn, int]]:
        moved = super()._take_decodes()
        for req, _ in moved:
            if req.rank >= 0 and req not in self.running:
                req.rank = -1
        return moved

    # ------------------------------------------------------- cost hooks
    def _select_chunks(self) -> list[tuple[SimTurn, int]]:
        """FCFS per rank into the budget that rank's decodes leave (vLLM: decode first)."""
        budget = [max(self.budget - b, 1) for b in self.rank_batch]
        chunks = []
        for req in self.prefill_active:
            left = budget[req.rank]
            if left <= 0:
                continue
            n = req.prefill_left if req.prefill_left < left else left
            chunks.append((req, n))
            budget[req.rank] = left - n
        return chunks

    def _step_s(self, chunks: list[tuple[SimTurn, int]]) -> float:
        ranks = len(self.rank_batch)
        tokens = [0] * ranks
        prior_weighted = [0.0] * ranks
        for req, n in chunks:
            tokens[req.rank] += n
            prior_weighted[req.rank] += n * (req.cached + req.prefill_tokens - req.prefill_left)
        # Several chunks on one rank: one chunk of their total over their mean prior.
        prior = [int(w / t) if t else 0 for w, t in zip(prior_weighted, tokens, strict=True)]
        return self.costs.cost.step_s(self.rank_batch, self.rank_ctx, tokens, prior)

    def _epoch_shape(self) -> tuple[int, int]:
        return max(self.rank_batch), max(self.rank_ctx)

    def _grow(self, steps: int) -> None:
        if steps == 1 and self.stall_on_prefill and self.step_chunks:
            self._grow_one_step_stalling_prefill_ranks()
            return
        super()._grow(steps)
        for i, batch in enumerate(self.rank_batch):
            self.rank_ctx[i] += steps * batch

    def _grow_one_step_stalling_prefill_ranks(self) -> None:
        """SGLang semantics: ranks that prefilled this step did not decode."""
        stalled = {req.rank for req, _ in self.step_chunks}
        grown = 0
        for i, batch in enumerate(self.rank_batch):
            if i not in stalled:
                self.rank_ctx[i] += batch
                grown += batch
        self.ctx_sum += grown
        self.kv_used += grown
        heap = self._finish_heap
        for req in self.running:
            if req.rank in stalled:
                # It decodes one step later: shift its join so its context stays right, and
                # give it a new finish entry (the old one is recognised as stale).
                req.join_step += 1
                req.finish_step += 1
                self._heap_seq += 1
                req.heap_entry = (req.finish_step, self._heap_seq, req)
                heapq.heappush(heap, req.heap_entry)
