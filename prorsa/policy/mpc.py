"""Model-predictive control: plan integer allocations over several forecast steps,
with explicit switch cost and drain time, solved exactly by dynamic programming."""

from __future__ import annotations

import numpy as np

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, ModeChoosingPolicy
from prorsa.policy.demand import (
    DecodePace,
    PrefillWorkMeter,
    Sizing,
    agreed_mode,
    agreed_move,
    band_levels,
    check_quantile,
    choose_mode,
    current_load,
    decode_demand,
    decode_slot_drains_s,
    kv_capacity_per_slot,
    prefill_cache_overflow_slots,
    prefill_slot_rebuilds_s,
    slot_drain_s,
    split_growth_rebuilds_s,
)
from prorsa.policy.types import ROLES, SWITCHING, Allocation, ClusterObservation, Forecast

_HELD = -2  # a plan state carried over unchanged from the interval before
_OWN = object()  # requirements(): the policy's own planning quantile


@POLICIES.register("mpc")
class MPCPolicy(ModeChoosingPolicy):
    """Receding-horizon plan over the forecaster's horizons.

    The forecast's horizons ``h_1 < ... < h_K`` cut the future into intervals. In interval
    ``k`` prefill needs ``r_p[k]`` slots (tokens arriving in it, plus its share of the
    backlog, drained over the horizon) and decode ``r_d[k]`` slots (forecast sequences and
    KV; only the KV of what decodes while no split's prefill could clear the backlog
    within the horizon, :func:`prorsa.policy.demand.decode_demand`). With ``x`` prefill slots the
    interval's cost is the slot-seconds of demand left unserved: the cluster moves at its
    busier side's pace, ``u = max(w_p * r_p / x_eff, w_d * r_d / (N - x)_eff)``, so the
    interval costs ``N * max(u - 1, 0)`` times its length, where slots that switch in this interval
    serve nothing for the switch latency (the reshard latency when prefill and decode run
    different layouts) plus their drain: for decode slots moving to prefill, the time
    their running sequences take to end (:func:`prorsa.policy.demand.decode_slot_drains_s`),
    else ``drain_s``; a switch that outlasts its interval idles its slots in the next
    ones too, and the plan starts no other move before it is through;
    each switched slot also costs ``switch_cost_s``, each decode slot moved to prefill
    the prefill slot-seconds needed to rebuild what prefill read of its contexts
    (:func:`prorsa.policy.demand.split_growth_rebuilds_s`: a colocated slot's, a decode
    slot's only where prefill reads it), and under re-prefill each prefill slot moved to
    decode those that rebuild its prefix cache (prefill priced in slots at the target
    utilisation, the unit of the need); both for the slots taken from each side,
    counted from the current split in the controller's order (least loaded first).
    The stage cost depends only on ``(x_prev, x)`` and when the last switch ends, so
    dynamic programming over ``x`` and that interval finds the exact optimum of this
    model; the first interval's allocation is applied and the plan is redone next tick.

    Args:
        drain_s: expected time a switching slot spends draining its old work, where the
            observation cannot tell: prefill slots moving to decode, decode slots when
            switches migrate or the workload's shape is unknown; it also caps the drain of
            decode slots under a backlog no split clears (their drain then delays the
            saving, not shrinks it).
        switch_cost_s: extra penalty per switched slot (slot-seconds), beyond lost service.
        prefill_weight / decode_weight: relative cost of a short slot-second per side.
        max_step: at most this many slots change in one interval (0: unlimited).
        quantile: plan on this demand quantile when available (None: point forecast).
        robust: plan at both ends of the forecast's band instead (P10 and P90, where the
            forecaster gives them) and move only where both plans move the same way, by
            the smaller of their moves; the mode choice likewise (as
            :class:`PredictivePolicy`'s ``robust``). On by default: on the regime map it
            ends MPC's losses to a burst only the P90 saw, and holds the backlog-bound
            cells (docs/decisions.md).
        start: ``"auto"``, ``"colocated"`` or ``"split"`` before the first forecast (as in
            :class:`PredictivePolicy`); colocation stays in
            the action space either way (see :func:`prorsa.policy.demand.choose_mode`,
            applied to the horizon's average demand over the horizon's length).
        prefill_fraction: split used until the first forecast arrives with ``start="split"``.
        local_prefill_threshold: if set, applied on every tick.
        tail_s: cost-to-go: the split the plan ends in is held and priced for this many
            seconds more at the last interval's demand (0: the plan ends with the
            forecast).
            Without it a plan cannot see a cost that starts just past its horizon: in
            Qwen3-30B-A3B mixed sync 64/GPU the contexts, grown as the workload's shape
            says, outgrow one prefill slot's cache only past 30 s, so a move to one
            prefill slot looked free (the run then collapsed; docs/results.md).
    """

    needs_forecast = True

    def __init__(
        self,
        drain_s: float = 2.0,
        switch_cost_s: float = 1.0,
        prefill_weight: float = 1.0,
        decode_weight: float = 1.0,
        max_step: int = 0,
        quantile: float | None = 0.9,
        start: str = "auto",
        prefill_fraction: float = 0.25,
        local_prefill_threshold: int | None = None,
        target_batch_per_gpu: float = 64.0,
        kv_target_fraction: float = 0.85,
        prefill_target_util: float = 0.8,
        tail_s: float = 30.0,
        robust: bool = True,
    ) -> None:
        self.drain_s = drain_s
        self.switch_cost_s = switch_cost_s
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.max_step = max_step
        self.quantile = quantile
        self.start = start
        self.prefill_fraction = prefill_fraction
        self.local_prefill_threshold = local_prefill_threshold
        self.target_batch_per_gpu = target_batch_per_gpu
        self.kv_target_fraction = kv_target_fraction
        self.prefill_target_util = prefill_target_util
        self.tail_s = tail_s
        self.robust = robust

    #: Whether the forecasts it plans on carry quantiles (the oracle's do not), so that
    #: ``quantile`` and ``robust`` are worth tuning.
    banded_forecast = True

    @classmethod
    def search_space(cls, trial) -> dict:
        space = {
            "drain_s": trial.suggest_float("drain_s", 0.0, 5.0),
            "switch_cost_s": trial.suggest_float("switch_cost_s", 0.0, 10.0),
            "max_step": trial.suggest_categorical("max_step", [0, 1, 2, 4]),
        }
        if cls.banded_forecast:
            space["quantile"] = trial.suggest_categorical("quantile", [0.5, 0.9])
        space["target_batch_per_gpu"] = trial.suggest_float(
            "target_batch_per_gpu", 16.0, 256.0, log=True
        )
        space["tail_s"] = trial.suggest_float("tail_s", 0.0, 120.0)
        if cls.banded_forecast:
            space["robust"] = trial.suggest_categorical("robust", [True, False])
        return {**space, **cls.start_space(trial)}

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        weights = (self.prefill_weight, self.decode_weight)
        if min(self.drain_s, self.switch_cost_s, self.tail_s, *weights) < 0:
            raise ConfigError("mpc: drain_s, switch_cost_s, weights and tail_s must be >= 0")
        if self.max_step < 0:
            raise ConfigError("mpc: max_step must be >= 0")
        check_quantile("mpc", self.quantile)
        self.sizing_ = Sizing(
            self.target_batch_per_gpu, self.kv_target_fraction, self.prefill_target_util
        )
        self.last_plan_: list[int] = []
        # The work ratio is per token, not per slot: a lost engine keeps it.
        self.work_ = self.kept_on_resize("work_", PrefillWorkMeter())

    def requirements(
        self,
        obs: ClusterObservation,
        forecast: Forecast,
        work_ratio: float | None = None,
        quantile: float | object | None = _OWN,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, DecodePace | None]:
        """Interval lengths, the prefill / decode slots each interval needs, with engines
        computing ``work_ratio`` tokens per appended one (default: as measured), and
        decode's pace on any number of slots (None: the spec quotes no decode loads); at
        demand ``quantile`` (default: the policy's own)."""
        spec, sizing = self.cluster_, self.sizing_
        horizons = np.asarray(forecast.horizons_s, dtype=float)
        if len(horizons) == 0 or (horizons <= 0).any() or (np.diff(horizons) <= 0).any():
            raise ConfigError("mpc: forecast horizons must be positive and increasing")
        wanted = self.quantile if quantile is _OWN else quantile
        q = wanted if wanted in forecast.quantiles else None
        table = forecast.quantiles[q] if q is not None else forecast.point
        load = current_load(obs)
        lengths = np.diff(np.concatenate([[0.0], horizons]))
        arriving = np.diff(np.concatenate([[0.0], np.maximum.accumulate(table["prefill_tokens"])]))
        # The backlog is to be drained within the horizon, spread over it: put all in the
        # first (1 s) interval, it cost little there (switching slots serve nothing that
        # soon) and vanished from later ones, so a queue of minutes never won a slot.
        backlog = load.prefill_backlog_tokens * lengths / lengths.sum()
        per_slot = self._prefill_slot_tokens_per_s()
        # Forecasts count appended tokens; engines compute what caches miss of them.
        ratio = self.work_.ratio if work_ratio is None else work_ratio
        need_p = (arriving * ratio + backlog) / lengths / per_slot
        seqs = np.maximum(np.asarray(table["decode_sequences"], dtype=float), 0.0)
        kv = np.maximum(np.asarray(table["decode_kv_tokens"], dtype=float), 0.0)
        # The first interval starts from what decodes now; decode engines also cache
        # the contexts between turns unless prefill is bound over the whole horizon.
        seqs[0] = max(seqs[0], load.decode_sequences)
        kv[0] = max(kv[0], load.decode_kv_tokens)
        # A step's cost follows the contexts that decode, not the idle ones decode also
        # caches (which decode_demand adds to the KV).
        context = kv / np.maximum(seqs, 1.0)
        bound = sizing.prefill_bound(spec, load, float(lengths.sum()))
        seqs, kv = decode_demand(load, seqs, kv, bound, floor_now=False)
        cap = kv_capacity_per_slot(obs)
        need_d = np.array(
            [sizing.decode_slots_needed(spec, s, k, cap) for s, k in zip(seqs, kv, strict=True)]
        )
        pace = None
        if spec.decode_tokens_per_s_by_load:
            pace = DecodePace(
                spec,
                seqs,
                context,
                kv / max(cap * sizing.kv_target_fraction, 1.0),
                sizing.target_batch_per_gpu,
            )
        return lengths, need_p, need_d, pace

    def backlog_slots(self, obs: ClusterObservation, horizon_s: float) -> float:
        """Prefill slots (at the target utilisation) that drain the queued backlog over
        ``horizon_s``: the share :meth:`requirements` adds to every interval's need."""
        per_slot = self._prefill_slot_tokens_per_s()
        return current_load(obs).prefill_backlog_tokens / max(horizon_s, 1e-9) / per_slot

    def _prefill_slot_tokens_per_s(self) -> float:
        """Prefill tokens/s of one slot at the sizing's target utilisation."""
        spec = self.cluster_
        return spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus * self.sizing_.prefill_target_util

    def plan(
        self,
        current: int,
        lengths: np.ndarray,
        need_p: np.ndarray,
        need_d: np.ndarray,
        decode_slot_drains: np.ndarray | None = None,
        switching: tuple[int, int, float] | None = None,
        pace: DecodePace | None = None,
        cache_need_p: np.ndarray | None = None,
        hold_last: bool = False,
        growth_rebuilds: np.ndarray | None = None,
        shrink_rebuilds: np.ndarray | None = None,
    ) -> list[int]:
        """Exact DP over prefill-slot counts 1..N-1 for each interval; returns the plan.

        ``need_p``, ``cache_need_p`` and the rebuilds are in prefill slots run at the
        sizing's target utilisation.
        Slots that switch serve nothing until their switch ends, in whichever later
        intervals that falls, and the plan makes no other move before then (the
        controller does not move switching slots either). Each state is the split and
        the first interval free to move again. ``decode_slot_drains[i]`` (``i`` in
        ``0..N-3``) is the drain of the ``i``-th decode slot the controller moves to
        prefill, counted from ``current`` over the whole plan as the rebuilds are: a move
        drains as long as the longest of the slots it takes (a slot returning to prefill
        is priced as the first ones); without it every switching slot drains for
        ``drain_s``. ``switching`` is a switch already
        under way, ``(slots heading to prefill, slots heading to decode, seconds until
        they serve)``; ``current`` counts them in their new roles (see
        :meth:`switching_now`). With ``pace``, decode's load on its slots is its step
        and KV pressure (:class:`~prorsa.policy.demand.DecodePace`), not ``need_d`` over
        the slots. ``cache_need_p[k][x - 1]``: prefill slots added at split ``x`` in
        interval ``k``; while a move is under way the split with the fewer prefill slots
        counts (the caches of slots joining prefill are cold). ``hold_last``: the last
        interval only holds the split (a cost-to-go, see ``tail_s``), so the plan cannot
        escape what its end state costs by a move no interval after it prices in full.
        ``growth_rebuilds[m]`` / ``shrink_rebuilds[m]`` (``m`` in ``0..N-2``; default
        none): the rebuild of the first ``m`` decode-side / prefill slots the controller
        moves (the least loaded first). Slots are taken in that order counted from
        ``current``, over the whole plan: a move pays for the fuller slots a larger or
        later move takes, and a slot that returns to the role it left rebuilds nothing
        on its way back (leaving again, it is priced as the slot it replaced: the state
        is the split alone).
        """
        n = self.cluster_.num_slots
        xs = np.arange(1, n)  # candidate prefill slots
        moved = np.abs(xs[None, :] - xs[:, None])  # [prev, next]
        gained_p = np.maximum(xs[None, :] - xs[:, None], 0)
        gained_d = np.maximum(xs[:, None] - xs[None, :], 0)
        # A slot moving between prefill and decode reshards when the two layouts differ.
        drains_to_prefill = (
            self.drain_s
            if decode_slot_drains is None
            else _longest_drain_taken(np.asarray(decode_slot_drains), xs, current)
        )
        blocked = self.cluster_.switch_latency_between("decode", "prefill") + np.where(
            gained_p > 0, drains_to_prefill, self.drain_s
        )
        blocked = np.where(moved > 0, blocked, 0.0)
        unpriced = np.zeros(n - 1)
        grow = unpriced if growth_rebuilds is None else np.asarray(growth_rebuilds)
        shrink = unpriced if shrink_rebuilds is None else np.asarray(shrink_rebuilds)
        # What a split has taken from each side so far, priced in the order slots go.
        took_d = grow[np.maximum(xs - current, 0)]
        took_p = shrink[np.maximum(current - xs, 0)]
        rebuilt = np.maximum(took_d[None, :] - took_d[:, None], 0.0) + np.maximum(
            took_p[None, :] - took_p[:, None], 0.0
        )
        stages = len(lengths)
        starts = np.concatenate([[0.0], np.cumsum(lengths)[:-1]])

        def short(k: int, lost: np.ndarray) -> np.ndarray:
            """Slots short in interval ``k`` when the slots entering a role serve nothing
            for a ``lost`` share of it; the cluster moves at its busier side's pace (see
            demand.split_shortage). A move keeps its old slots serving on each side."""
            eff_p = xs[None, :] - lost * gained_p
            eff_d = (n - xs[None, :]) - lost * gained_d
            load_d = need_d[k] / eff_d if pace is None else pace.utilisation(k, eff_d)
            # Prefill's need at the split moved to (what its caches cannot hold added).
            if cache_need_p is None:
                need = need_p[k]
            else:
                c = cache_need_p[k]
                need = need_p[k] + np.where(lost > 0, np.maximum(c[:, None], c[None, :]), c)
            busier = np.maximum(self.prefill_weight * need / eff_p, self.decode_weight * load_d)
            return n * np.maximum(busier - 1.0, 0.0)

        allowed = moved <= (self.max_step or n)
        # cost[u, x]: least cost of reaching split x with moves barred before interval u.
        cost = np.full((stages + 1, len(xs)), np.inf)
        # A switch under way bars moves until the first interval after it ends. What it
        # leaves short before then is the same on every path, so it is not priced.
        free_at = 0 if switching is None else int(np.searchsorted(starts, switching[2]))
        cost[free_at, current - 1] = 0.0
        history: list[tuple[np.ndarray, np.ndarray]] = []  # (cost before k, where from)
        for k in range(stages):
            # A move (or a stay) at k books every interval its switch reaches: the
            # split is held there, the switching slots idle for their overlap with it.
            booked = np.zeros(blocked.shape)
            free_from = np.full(blocked.shape, k + 1)
            for j in range(k, stages):
                overlap = np.clip(blocked - (starts[j] - starts[k]), 0.0, lengths[j])
                reached = (overlap > 0) | (j == k)
                if not reached.any():
                    break
                booked += np.where(reached, short(j, overlap / lengths[j]) * lengths[j], 0.0)
                free_from = np.where(reached, j + 1, free_from)
            booked += self.switch_cost_s * moved + rebuilt
            free = cost[: k + 1].min(axis=0)  # states free to move at k
            may = (moved == 0) if hold_last and k == stages - 1 else allowed
            total = np.where(may, free[:, None] + booked, np.inf)
            nxt = np.full_like(cost, np.inf)
            came_from = np.full(cost.shape, -1)
            for u in np.unique(free_from):
                at_u = np.where(free_from == u, total, np.inf)
                best = np.argmin(at_u, axis=0)
                nxt[u] = at_u[best, np.arange(len(xs))]
                came_from[u] = best
            # States still switching stay put; their interval is already booked.
            held = cost[k + 1 :] < nxt[k + 1 :]
            nxt[k + 1 :] = np.where(held, cost[k + 1 :], nxt[k + 1 :])
            came_from[k + 1 :] = np.where(held, _HELD, came_from[k + 1 :])
            history.append((cost, came_from))
            cost = nxt
        u, x = (int(i) for i in np.unravel_index(int(np.argmin(cost)), cost.shape))
        path = []
        for k in range(stages - 1, -1, -1):
            path.append(x)
            before, came_from = history[k]
            if came_from[u, x] != _HELD:
                x = int(came_from[u, x])
                u = int(np.argmin(before[: k + 1, x]))
        return [int(xs[i]) for i in reversed(path)]

    def switching_now(self, obs: ClusterObservation) -> tuple[int, int, float] | None:
        """Slots switching now, heading to prefill and to decode, and the seconds until
        the last of them serves (None: none switching).

        A drained slot serves once the switch latency has passed from its drain's end. A
        slot still draining serves after the rest of its drain and then the latency: a
        decode slot's drain is estimated as for a move (its longest running sequence),
        any other's as ``drain_s``, each at most what is left of the drain timeout. (A
        planned move under a backlog is priced at a capped drain instead, see
        :meth:`decode_slot_drains`: there the question is what the move saves, here only when
        the slot serves.) Without the role a slot left, the dearest source is assumed.
        """
        spec = self.cluster_
        moving = [s for s in obs.slots if s.role == SWITCHING]
        if not moving:
            return None
        remaining = 0.0
        for slot in moving:
            target = slot.target_role or "decode"
            sources = [slot.source_role] if slot.source_role else [r for r in ROLES if r != target]
            latency = max(spec.switch_latency_between(source, target) for source in sources)
            if slot.drained_s is not None:
                left = latency - (obs.time_s - slot.drained_s)
            else:
                drain = self.drain_s
                if slot.source_role == "decode" and spec.switch_mode == "drain" and obs.workload:
                    drain = slot_drain_s(slot, obs.workload, spec)
                timeout_left = spec.drain_timeout_s - (obs.time_s - slot.since_s)
                left = latency + min(drain, max(timeout_left, 0.0))
            remaining = max(remaining, left)
        to_prefill = sum(s.target_role == "prefill" for s in moving)
        return to_prefill, len(moving) - to_prefill, max(remaining, 0.0)

    def decode_slot_drains(self, obs: ClusterObservation, horizon_s: float) -> np.ndarray | None:
        """Drain of each decode slot in the order the controller moves them to prefill
        (``N-2`` of them); ``None`` where the observation cannot tell (``drain_s`` then
        prices every move)."""
        spec = self.cluster_
        if spec.switch_mode != "drain" or obs.workload is None:
            return None
        drains = decode_slot_drains_s(obs, spec, spec.num_slots - 2)
        load = current_load(obs)
        latency = spec.switch_latency_between("decode", "prefill")
        for drain in np.unique(drains):
            # Under a backlog no split clears even once the move is done, the prefill
            # it adds stays short after it: the drain delays the saving, not shrinks it
            # (as for predictive; see PredictivePolicy.decide). The cap never lowers a
            # longer drain below a shorter one's, so a move's longest drain is capped too.
            if self.sizing_.prefill_bound(spec, load, horizon_s + latency + drain):
                drains[drains == drain] = min(drain, self.drain_s)
        return drains

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        current = current_load(obs).prefill_slots
        self.work_.update(obs)
        if forecast is None:
            return self.before_forecast(obs, current, "mpc")
        levels = band_levels(forecast, self.quantile, self.robust)
        ends = [self.requirements(obs, forecast, quantile=q) for q in levels]
        # Colocation versus disaggregation on the horizon's average demand; within a split,
        # the DP below plans the split itself.
        modes = [
            self._mode(obs, forecast, q, lengths, need_p, need_d, current)
            for q, (lengths, need_p, need_d, _) in zip(levels, ends, strict=True)
        ]
        changed = self.apply_mode(obs, agreed_mode(modes), "mpc")
        if changed is not None:
            return changed
        current = min(max(current, 1), self.cluster_.num_slots - 1)
        terms = self._plan_terms(obs, ends[0][0])  # the same at every end
        backlog_p = self.backlog_slots(obs, float(ends[0][0].sum()))
        plans = [self._plan_ahead(current, terms, *end, backlog_p=backlog_p) for end in ends]
        target = agreed_move(current, [plan[0] for plan in plans])
        chosen = [plan for plan in plans if plan[0] == target]
        if not chosen:  # the ends' plans move in opposite directions
            self.last_plan_ = [current] * len(plans[0])
            return self.split(current, f"mpc: hold (plans {plans} disagree)")
        self.last_plan_ = chosen[-1]
        return self.split(target, f"mpc: plan {self.last_plan_}")

    def _mode(
        self,
        obs: ClusterObservation,
        forecast: Forecast,
        quantile: float | None,
        lengths: np.ndarray,
        need_p: np.ndarray,
        need_d: np.ndarray,
        current: int,
    ) -> str | int | None:
        """:func:`choose_mode` on the horizon's average demand at one quantile."""
        weights = lengths / lengths.sum()
        colocated_ratio = self.work_.ratio_for(colocated=True)
        colocated_p = (
            need_p
            if colocated_ratio == self.work_.ratio
            else self.requirements(obs, forecast, colocated_ratio, quantile=quantile)[1]
        )
        return choose_mode(
            obs,
            self.cluster_,
            float(need_p @ weights),
            float(need_d @ weights),
            current_prefill=max(current, 1),
            payback_s=float(lengths.sum()),
            switch_cost_weight=1.0,
            prefill_target_util=self.sizing_.prefill_target_util,
            colocated_need_p=float(colocated_p @ weights),
        )

    def _plan_terms(self, obs: ClusterObservation, lengths: np.ndarray) -> dict:
        """What the plan prices besides demand (the same whichever quantile plans):
        rebuilds and decode drains by the slots taken from each side, a switch under way,
        and the prefill the caches cannot hold at each split over the intervals of
        ``lengths`` (the cost-to-go's included)."""
        slots = self.cluster_.num_slots
        util = self.sizing_.prefill_target_util
        drains = self.decode_slot_drains(obs, float(lengths.sum()))
        if self.tail_s > 0:
            lengths = np.append(lengths, self.tail_s)
        return {
            "growth_rebuilds": split_growth_rebuilds_s(obs, self.cluster_, slots - 2, util),
            "decode_slot_drains": drains,
            "switching": self.switching_now(obs),
            "shrink_rebuilds": prefill_slot_rebuilds_s(obs, self.cluster_, slots - 2, util),
            "cache_need_p": prefill_cache_overflow_slots(
                obs,
                self.cluster_,
                np.arange(1, slots),
                np.cumsum(lengths) - lengths / 2,
                target_util=util,
            ),
        }

    def _plan_ahead(
        self,
        current: int,
        terms: dict,
        lengths: np.ndarray,
        need_p: np.ndarray,
        need_d: np.ndarray,
        pace: DecodePace | None,
        backlog_p: float = 0.0,
    ) -> list[int]:
        """The plan over the forecast's intervals from ``current`` prefill slots
        (``terms``: :meth:`_plan_terms`); ``backlog_p``: the share of each interval's
        prefill need that drains the backlog (:meth:`backlog_slots`)."""
        horizons = len(lengths)
        if self.tail_s > 0:
            # The split the plan ends in stays for ``tail_s`` more, at the last interval's
            # demand: a cost-to-go, so that what a split costs just past the horizon
            # (contexts outgrowing a smaller prefill pool's caches) counts.
            lengths = np.append(lengths, self.tail_s)
            # The horizon drains the backlog already: the tail holds arrivals only.
            tail_p = max(float(need_p[-1]) - backlog_p, 0.0)
            need_p, need_d = np.append(need_p, tail_p), np.append(need_d, need_d[-1])
            pace = None if pace is None else pace.held_for_one_more()
        return self.plan(
            current, lengths, need_p, need_d, pace=pace, hold_last=self.tail_s > 0, **terms
        )[:horizons]


@POLICIES.register("oracle")
class OraclePolicy(MPCPolicy):
    """MPC fed the oracle forecaster (simulation only): what MPC's plan makes of the true
    future. It bounds what better forecasts could give MPC, not every policy: where the
    plan's model of the cluster is off, a policy that plans differently can beat it."""

    #: The forecaster this policy must run with.
    forecaster_name = "oracle"
    banded_forecast = False  # the true future has no band


def _longest_drain_taken(slot_drains: np.ndarray, xs: np.ndarray, current: int) -> np.ndarray:
    """``[prev, next]``: the longest drain among the decode slots a move from ``prev`` to
    ``next`` prefill slots takes, slots taken in order counted from ``current``
    (``slot_drains[i]``: the ``i``-th). Slots that left prefill earlier in the plan and
    return are priced as the first ones taken."""
    count = len(slot_drains)
    # longest[a, b]: the longest drain among slots a..b-1 (zero when there are none):
    # slot b-1's drain where b > a, accumulated along b (drains are never negative).
    upper = np.triu(np.ones((count + 1, count + 1), bool), 1)
    longest = np.maximum.accumulate(
        np.where(upper, np.concatenate([[0.0], slot_drains])[None, :], 0.0), axis=1
    )
    taken = np.clip(xs - current, 0, count)
    returning = np.clip(np.minimum(current, xs[None, :]) - xs[:, None], 0, count)
    return np.maximum(longest[taken[:, None], taken[None, :]], longest[0, returning])
