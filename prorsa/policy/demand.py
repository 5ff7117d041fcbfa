"""Turning observations and forecasts into capacity needs, in slots.

Everything here is pure arithmetic over the cost profile's throughput numbers (as in
Dynamo's planner): how many slots prefill needs to serve the tokens arriving over a
horizon plus the backlog, and how many slots decode needs to hold the live sequences'
KV and keep batches at a target size (only the KV while prefill is the bound stage).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TypeVar

import numpy as np

from prorsa.errors import ConfigError
from prorsa.policy.base import ClusterSpec, colocated_now
from prorsa.policy.types import SWITCHING, ClusterObservation, Forecast, SlotView, WorkloadShape


@dataclass(frozen=True)
class Load:
    """What the cluster carries right now."""

    prefill_backlog_tokens: float  # queued on prefill slots (not yet computed)
    decode_sequences: float  # decoding or waiting to decode
    decode_kv_tokens: float  # KV held by decoding trajectories
    # Contexts of trajectories between turns (in a tool, or queued for their next prefill):
    # in agentic rollouts the decode side keeps them cached so the next turn is cheap.
    idle_context_tokens: float
    prefill_slots: int
    decode_slots: int


T = TypeVar("T")


def _kept_for_last_observation(
    compute: Callable[[ClusterObservation], T],
) -> Callable[[ClusterObservation], T]:
    """``compute(obs)``, kept for the last observation asked about: one decision reads
    such a result several times, each a pass over every slot (512 in large clusters)."""
    last: tuple[ClusterObservation, T] | None = None

    @functools.wraps(compute)
    def kept(obs: ClusterObservation) -> T:
        nonlocal last
        cached = last  # read once: another thread may replace it meanwhile
        if cached is None or cached[0] is not obs:
            cached = last = (obs, compute(obs))
        return cached[1]

    return kept


@_kept_for_last_observation
def current_load(obs: ClusterObservation) -> Load:
    """Backlog, live decode sequences and KV, and the slots per role (switching slots
    counted toward their target)."""
    # Prefill waiting anywhere: on prefill slots, and on colocated or decode slots that
    # prefill locally.
    backlog = sum(s.queued_prefill_tokens for s in obs.slots)
    prefill = sum(
        1 for s in obs.slots if (s.target_role if s.role == SWITCHING else s.role) == "prefill"
    )
    decode_side = len(obs.slots) - prefill
    states = obs.trajectory_state
    tokens = obs.trajectory_tokens
    return Load(
        prefill_backlog_tokens=float(backlog),
        decode_sequences=float(states.get("decoding", 0) + states.get("transferring", 0)),
        decode_kv_tokens=float(tokens.get("decoding", 0) + tokens.get("transferring", 0)),
        idle_context_tokens=float(tokens.get("in_tool", 0) + tokens.get("queued", 0)),
        prefill_slots=prefill,
        decode_slots=decode_side,
    )


def check_quantile(policy: str, quantile: float | None) -> None:
    """ConfigError unless ``quantile`` is None (the point forecast) or in (0, 1)."""
    if quantile is not None and not 0 < quantile < 1:
        raise ConfigError(f"{policy}: quantile must be in (0, 1) or None, got {quantile}")


@dataclass(frozen=True)
class Sizing:
    """Knobs that turn demand into slot counts."""

    target_batch_per_gpu: float = 64.0  # decode sequences per GPU before TPOT suffers
    kv_target_fraction: float = 0.85  # plan decode KV to this share of capacity
    prefill_target_util: float = 0.8  # plan prefill GPUs to this utilisation

    def __post_init__(self) -> None:
        # A zero utilisation divides by zero at the first forecast; a zero batch makes
        # the decode need infinite and the policy hold for ever.
        if not self.target_batch_per_gpu > 0:
            raise ConfigError(f"target_batch_per_gpu must be > 0, got {self.target_batch_per_gpu}")
        for name in ("kv_target_fraction", "prefill_target_util"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")

    def prefill_slots_needed(
        self, spec: ClusterSpec, tokens_per_s: float, backlog_tokens: float, horizon_s: float
    ) -> float:
        """Slots to serve ``tokens_per_s`` arriving plus drain the backlog within the horizon."""
        per_slot = spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus * self.prefill_target_util
        return (tokens_per_s + backlog_tokens / max(horizon_s, 1e-9)) / per_slot

    def decode_slots_needed(
        self, spec: ClusterSpec, sequences: float, kv_tokens: float, kv_capacity_per_slot: float
    ) -> float:
        """Slots to hold ``kv_tokens`` and keep batches at the target size."""
        by_batch = sequences / (self.target_batch_per_gpu * spec.slot_gpus)
        by_kv = kv_tokens / max(kv_capacity_per_slot * self.kv_target_fraction, 1.0)
        return max(by_batch, by_kv)

    def prefill_bound(self, spec: ClusterSpec, load: Load, horizon_s: float) -> bool:
        """Whether no split could clear a split's prefill backlog within ``horizon_s``
        (it needs more than ``num_slots - 1`` prefill slots): prefill then sets the
        pipeline's pace whatever the split (see :func:`decode_demand`).

        Judged against the largest prefill pool, not the current one, so the answer is
        the same for every split a policy weighs and moving slots cannot flip it (a
        flag that cleared once prefill grew would put the waiting contexts back into
        decode's need and pull the slots back). Colocated clusters (no prefill slots)
        are never prefill-bound here: their backlog is priced by ``choose_mode``.
        """
        if load.prefill_slots <= 0 or load.prefill_backlog_tokens <= 0:
            return False
        backlog = self.prefill_slots_needed(spec, 0.0, load.prefill_backlog_tokens, horizon_s)
        return backlog > spec.num_slots - 1


#: Points per slot of the grid on which :class:`DecodePace` tabulates decode's load.
PACE_POINTS_PER_SLOT = 8


@dataclass(frozen=True)
class DecodePace:
    """How short decode runs on a number of decode slots, per planning interval: the
    longer of its step against a step at the target batch
    (:meth:`ClusterSpec.decode_step_ratio`) and its KV over what the slots hold.

    A target batch alone counts twice the batch as twice the need, but a memory-bound
    decode step at twice the batch is far shorter than two steps: Qwen3-30B-A3B on
    ``tp1-dp8-ep8-a2a`` at 2k context decodes 144 sequences per GPU in 1.6x the step of
    64, not 2.25x, so a plan sized by batch moved a prefill slot to decode and starved
    prefill (search sync 128 per GPU: 0.90x of holding the split).

    The load is exact on a grid of :data:`PACE_POINTS_PER_SLOT` points per slot (whole
    slot counts included) and linear between them: a plan asks for it over every pair of
    splits, 261k values per interval at 512 slots.
    """

    spec: ClusterSpec
    sequences: np.ndarray  # decoding, per interval
    context_tokens: np.ndarray  # mean context of a decoding sequence, per interval
    kv_slots: np.ndarray  # slots the KV needs, per interval
    target_batch_per_gpu: float
    tables: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def held_for_one_more(self) -> DecodePace:
        """The same pace with one more interval, at the last one's load."""
        return replace(
            self,
            sequences=np.append(self.sequences, self.sequences[-1]),
            context_tokens=np.append(self.context_tokens, self.context_tokens[-1]),
            kv_slots=np.append(self.kv_slots, self.kv_slots[-1]),
            tables={},
        )

    def utilisation(self, k: int, slots: np.ndarray) -> np.ndarray:
        """Decode's load on ``slots`` decode slots in interval ``k`` (1: at the target)."""
        table = self.tables.get(k)
        if table is None:
            table = self.tables[k] = self.exact(k, self.grid)
        return np.interp(slots, self.grid, table)

    def exact(self, k: int, slots: np.ndarray) -> np.ndarray:
        """:meth:`utilisation` off the grid."""
        slots = np.maximum(np.asarray(slots, dtype=float), 1e-9)
        per_gpu = self.sequences[k] / (slots * self.spec.slot_gpus)
        step = self.spec.decode_step_ratio(
            per_gpu, float(self.context_tokens[k]), self.target_batch_per_gpu
        )
        return np.maximum(step, self.kv_slots[k] / slots)

    @cached_property
    def grid(self) -> np.ndarray:
        points = PACE_POINTS_PER_SLOT * self.spec.num_slots
        return np.arange(1, points + 1) / PACE_POINTS_PER_SLOT


def decode_demand(
    load: Load,
    sequences: float | np.ndarray,
    kv_tokens: float | np.ndarray,
    prefill_bound: bool,
    *,
    floor_now: bool = True,
) -> tuple[float | np.ndarray, float | np.ndarray]:
    """(sequences, KV tokens) to size decode for, given the forecast ``sequences`` and
    ``kv_tokens`` (numbers, or arrays over a plan's intervals) and what decodes now.

    Normally decode is sized for the batch target and for the KV of live sequences plus
    the contexts of trajectories between turns (cached so the next turn is cheap). When
    prefill is the bound stage, only the KV of decoding sequences counts: trajectories
    wait in the prefill queue, so decode's batch size is off their critical path, and
    contexts waiting there are the backlog's, not decode's. Sized with those terms,
    Qwen3-235B-A22B swe sync 64/GPU (a 3-hour backlog-bound run) asked for 13 decode
    slots of 4 out of 2,048 queued contexts, and predictive and the oracle gave decode a
    second slot for 9,400 s (0.78-0.81x against best-static's 1.14x).

    With ``floor_now`` the forecast is raised to what decodes now (a plan does that for
    its first interval only).
    """
    if floor_now:
        sequences = np.maximum(sequences, load.decode_sequences)
        kv_tokens = np.maximum(kv_tokens, load.decode_kv_tokens)
    if prefill_bound:
        return np.zeros_like(sequences, dtype=float), kv_tokens
    return sequences, kv_tokens + load.idle_context_tokens


def kv_capacity_per_slot(obs: ClusterObservation) -> float:
    """KV tokens one slot holds (decode-side slots, as observed)."""
    caps = [s.kv_capacity_tokens for s in obs.slots if s.role in ("decode", "colocated")]
    caps = caps or [s.kv_capacity_tokens for s in obs.slots]
    return max(sum(caps) / len(caps), 1.0)


class PrefillWorkMeter:
    """Prefill tokens engines computed per token turns appended, over the last
    ``window_s`` seconds of observations, kept per mode (colocated or split).

    Forecasts count appended tokens; what prefill engines compute for them differs: near
    one where prefix caches hold earlier context, many times more where KV pressure
    evicts caches (Qwen3-235B-A22B swe at 64 trajectories per GPU computes ~30x what it
    appends, colocated or split) or a prefill engine lacks the context; below one where
    a group's shared prompt is cached. Policies scale forecast prefill by this ratio.
    Until ``min_appended_tokens`` have arrived in the window the ratio stays at its last
    value (1.0 at first).

    The ratio depends on the mode: under re-prefill a split's prefill engines recompute
    contexts the colocated engines kept (235B tau2 async 16/GPU: ~1x colocated, 15-60x
    split). Priced at the split's ratio, colocation looked as short of prefill as the
    split and a policy never went back. The window restarts when the mode changes, and
    :meth:`ratio_for` gives the last ratio measured in a mode (the current one until
    then; a policy adds a split's recompute itself, :func:`split_recompute_slots`).
    """

    def __init__(self, window_s: float = 30.0, min_appended_tokens: float = 10_000.0) -> None:
        if window_s <= 0 or min_appended_tokens <= 0:
            raise ConfigError("PrefillWorkMeter: window_s and min_appended_tokens must be > 0")
        self.window_s = window_s
        self.min_appended_tokens = min_appended_tokens
        self.samples: deque[tuple[float, int, int]] = deque()
        self.ratio = 1.0
        self.colocated: bool | None = None
        self.by_mode: dict[bool, float] = {}

    def update(self, obs: ClusterObservation) -> float:
        """Record ``obs``'s totals; the computed-per-appended ratio over the window."""
        now = obs.time_s
        appended, computed = obs.prefill_tokens_appended_total, obs.prefill_tokens_computed_total
        mode = colocated_now(obs)
        if mode != self.colocated:
            self.samples.clear()
            self.colocated = mode
            self.ratio = self.ratio_for(mode)
        self.samples.append((now, appended, computed))
        # Keep the newest sample at or before the window's start as the baseline.
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
        _, appended0, computed0 = self.samples[0]
        if appended - appended0 >= self.min_appended_tokens:
            self.ratio = (computed - computed0) / (appended - appended0)
            self.by_mode[mode] = self.ratio
        return self.ratio

    def ratio_for(self, colocated: bool) -> float:
        """The last ratio measured while colocated (or split); the current one if none."""
        return self.by_mode.get(colocated, self.ratio)


def forecast_rate(
    forecast: Forecast, target: str, horizon_s: float, quantile: float | None
) -> float:
    """Per-second rate of a cumulative target over ``horizon_s`` (quantile when available)."""
    use_q = quantile is not None and quantile in forecast.quantiles
    return forecast.at(target, horizon_s, quantile if use_q else None) / horizon_s


def may_move(slot: SlotView, now_s: float, min_dwell_s: float) -> bool:
    """Whether the controller may move ``slot`` at ``now_s``: not switching, and in its
    role for ``min_dwell_s`` at least (``plan_switches``)."""
    return slot.role != SWITCHING and now_s - slot.since_s >= min_dwell_s - 1e-9


def donor_order(slot: SlotView) -> tuple[float, int]:
    """The controller's order of donors: least loaded first (``plan_switches``)."""
    return (slot.running_sequences + slot.queued_prefill_tokens / 1000.0, slot.slot_id)


def decode_slots_moved_first(
    obs: ClusterObservation, spec: ClusterSpec, slots: int
) -> list[SlotView]:
    """The ``slots`` decode-side slots the controller would move first: the least loaded
    of those it may move now, then (moved once their dwell is served) the others."""
    return _moved_first(_decode_side_by_load(obs), obs.time_s, spec.min_dwell_s)[: max(slots, 0)]


def _moved_first(by_load: list[SlotView], now_s: float, min_dwell_s: float) -> list[SlotView]:
    """``by_load`` with the slots the controller may move now first (each part in order):
    a slot that has just switched in is empty and least loaded, but stays put."""
    free: list[SlotView] = []
    held: list[SlotView] = []
    for slot in by_load:
        (free if may_move(slot, now_s, min_dwell_s) else held).append(slot)
    return free + held


@_kept_for_last_observation
def _decode_side_by_load(obs: ClusterObservation) -> list[SlotView]:
    return sorted((s for s in obs.slots if s.role in ("decode", "colocated")), key=donor_order)


def decode_slot_rebuild_s(
    obs: ClusterObservation, spec: ClusterSpec, slots: int, target_util: float
) -> float:
    """Slot-seconds of prefill needed to rebuild the KV of the ``slots`` decode slots the
    controller would move first (the least loaded), were they switched away, in slots
    run at ``target_util`` (the unit of the prefill need and shortages it is weighed
    against).

    Their trajectories' contexts (in use and cached between turns) are lost with the role,
    and every one of those trajectories must be prefilled again on its next turn.
    """
    tokens = [
        s.kv_used_tokens + s.cached_tokens for s in decode_slots_moved_first(obs, spec, slots)
    ]
    return float(_rebuilds_by_count(tokens, slots, spec, target_util)[-1])


def split_growth_rebuild_s(
    obs: ClusterObservation, spec: ClusterSpec, slots: int, target_util: float
) -> float:
    """Slot-seconds of prefill (in slots run at ``target_util``) that a split growing its
    prefill side by the ``slots`` decode-side slots the controller would move first costs
    in contexts to rebuild.

    A colocated slot's contexts are lost as when leaving colocation (its turns prefill
    where their context lives). A decode slot's are read by prefill only under
    ``reuse_mode="pull"``, or where decode engines prefill short turns themselves
    (``local_prefill_threshold``): otherwise a split's prefill engine computes what its
    own cache lacks (re-prefill) or reads a KV store, and the decode slot's cache only
    shortened KV transfers (not priced). Leaving colocation, or colocating a split, the
    turns prefill where their contexts live: :func:`decode_slot_rebuild_s` prices those.
    """
    return float(split_growth_rebuilds_s(obs, spec, slots, target_util)[-1])


def split_growth_rebuilds_s(
    obs: ClusterObservation, spec: ClusterSpec, slots: int, target_util: float
) -> np.ndarray:
    """:func:`split_growth_rebuild_s` for every count at once: entry ``m`` (``0..slots``)
    prices the ``m`` slots moved first (the least loaded, in the controller's order),
    for planners that weigh moves of every size. Non-decreasing in ``m``; a later slot
    may add less than an earlier one (slots are ordered by load, priced by contexts)."""
    # A decode engine that prefills short turns itself (local_prefill_threshold) keeps
    # contexts the prefill side then lacks: charged in full, an upper bound.
    read = spec.reuse_mode == "pull" or obs.local_prefill_threshold > 0
    tokens = [
        s.kv_used_tokens + s.cached_tokens if read or s.role == "colocated" else 0
        for s in decode_slots_moved_first(obs, spec, slots)
    ]
    return _rebuilds_by_count(tokens, slots, spec, target_util)


def _rebuilds_by_count(
    tokens: list[int], slots: int, spec: ClusterSpec, target_util: float
) -> np.ndarray:
    """Entry ``m`` (``0..slots``): the first ``m`` of ``tokens`` in prefill slot-seconds at
    ``target_util``; moving more slots than there are adds nothing."""
    out = np.zeros(max(slots, 0) + 1)
    if slots <= 0 or not tokens:
        return out
    per_slot = spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus * target_util
    out[1 : len(tokens) + 1] = np.cumsum(np.asarray(tokens, dtype=np.int64)) / max(per_slot, 1e-9)
    out[len(tokens) + 1 :] = out[len(tokens)]
    return out


def prefill_slot_rebuild_s(
    obs: ClusterObservation, spec: ClusterSpec, slots: int, target_util: float
) -> float:
    """Slot-seconds of prefill (in slots run at ``target_util``) needed to rebuild the
    prefix caches of the ``slots`` prefill slots the controller would move first (the
    least loaded), were they switched to decode: the contexts cached there for the
    trajectories' next turns are dropped with the role, and those turns are prefilled
    again in full elsewhere (re-prefill only: a prefill engine that pulls or reads a KV
    store copies them instead)."""
    return float(prefill_slot_rebuilds_s(obs, spec, slots, target_util)[-1])


def prefill_slot_rebuilds_s(
    obs: ClusterObservation, spec: ClusterSpec, slots: int, target_util: float
) -> np.ndarray:
    """:func:`prefill_slot_rebuild_s` for every count at once (entry ``m``: the ``m``
    prefill slots moved first)."""
    if spec.reuse_mode != "reprefill":
        return np.zeros(max(slots, 0) + 1)  # under pull or a KV store prefill copies it
    by_load = sorted((s for s in obs.slots if s.role == "prefill"), key=donor_order)
    prefill = _moved_first(by_load, obs.time_s, spec.min_dwell_s)[: max(slots, 0)]
    return _rebuilds_by_count([s.cached_tokens for s in prefill], slots, spec, target_util)


def resize_rebuild_s(
    obs: ClusterObservation, spec: ClusterSpec, current: int, target: int, target_util: float
) -> float:
    """Slot-seconds of prefill (in slots run at ``target_util``) that resizing a split from
    ``current`` to ``target`` prefill slots costs in lost contexts: growing prefill
    (:func:`split_growth_rebuild_s`) loses what prefill would have read of the decode
    slots it takes, shrinking it what the prefill slots it gives up cache
    (:func:`prefill_slot_rebuild_s`: those trajectories prefill in full elsewhere, under
    re-prefill)."""
    if target > current:
        return split_growth_rebuild_s(obs, spec, target - current, target_util)
    return prefill_slot_rebuild_s(obs, spec, current - target, target_util)


def decode_drain_s(obs: ClusterObservation, spec: ClusterSpec, slots: int) -> float:
    """Seconds until the ``slots`` decode slots the controller would move first (the least
    loaded) have drained their running sequences, were they switched away in drain mode
    (zero under migration, or without the workload's shape).

    A slot is drained when its longest sequence ends. With ``n`` sequences of mean output
    ``o`` tokens per turn, memoryless lengths leave the longest ``o * H(n)`` tokens to go
    (``H``: the harmonic number), decoded one a step at ``n`` sequences over the slot's
    quoted decode tokens/s; capped at the drain timeout. Found in the regime map
    (Qwen3-235B-A22B mixed sync 16/GPU, half context growth): two DP8 decode slots moved to
    prefill for a burst drained for the full 60 s timeout; priced at the 2 s relabel, the
    move looked to pay back over a 30 s window it never served (0.93x colocation).
    """
    drains = decode_slot_drains_s(obs, spec, slots)
    return float(drains.max()) if len(drains) else 0.0


def decode_slot_drains_s(obs: ClusterObservation, spec: ClusterSpec, slots: int) -> np.ndarray:
    """Drain of each of the ``slots`` decode slots the controller would move first, in the
    order it moves them (:func:`slot_drain_s`; zeros under migration, without the
    workload's shape, and past the decode slots there are), for planners that weigh
    which slots a move takes as well as how many."""
    drains = np.zeros(max(slots, 0))
    if slots <= 0 or spec.switch_mode != "drain" or obs.workload is None:
        return drains
    for i, slot in enumerate(decode_slots_moved_first(obs, spec, slots)):
        drains[i] = slot_drain_s(slot, obs.workload, spec)
    return drains


def slot_drain_s(slot: SlotView, workload: WorkloadShape, spec: ClusterSpec) -> float:
    """Seconds until ``slot``'s longest running sequence ends (see :func:`decode_drain_s`),
    capped at the drain timeout."""
    n = slot.running_sequences
    if n <= 0:
        return 0.0
    per_slot = spec.decode_tokens_per_s_per_gpu * spec.slot_gpus
    harmonic = sum(1.0 / k for k in range(1, n + 1))
    longest = workload.output_tokens_per_turn * harmonic * n / max(per_slot, 1e-9)
    return min(longest, spec.drain_timeout_s)


def busier_utilisation(prefill: int, slots: int, need_p: float, need_d: float) -> float:
    """Utilisation of the busier side of a ``prefill`` / ``slots - prefill`` split; a side
    with no slots (mid-change from or to colocation) is saturated by any need."""
    decode = slots - prefill
    return max(
        need_p / prefill if prefill > 0 else (math.inf if need_p > 0 else 0.0),
        need_d / decode if decode > 0 else (math.inf if need_d > 0 else 0.0),
    )


def split_shortage(prefill: int, slots: int, need_p: float, need_d: float) -> float:
    """Slots of demand a ``prefill`` / ``slots - prefill`` split leaves unserved.

    Prefill and decode form a pipeline, so the cluster moves at its busier side's pace:
    at utilisation ``u > 1`` the horizon's work takes ``u`` times as long, which is
    ``slots * (u - 1)`` slots short, the measure :func:`colocated_shortage` uses for
    pooled slots. (Summing each side's shortfall instead makes every split look alike
    once both sides are short, e.g. under a backlog: a policy then kept one prefill slot
    for a backlog that needed three.)
    """
    return slots * max(busier_utilisation(prefill, slots, need_p, need_d) - 1.0, 0.0)


def best_split(slots: int, need_p: float, need_d: float) -> int:
    """The prefill slots (1 .. slots-1) that leave the least demand unserved; among
    splits that serve it all, the most balanced (then the fewest prefill slots).

    Every split at once: :func:`split_shortage` and :func:`busier_utilisation`
    elementwise, the same float operations (a controller at 512 slots asks every tick).
    """
    if slots < 2:
        raise ValueError(f"a split needs at least 2 slots, got {slots}")
    if math.isnan(need_p) or math.isnan(need_d):  # numpy's max and Python's treat NaN apart
        return min(
            range(1, slots),
            key=lambda x: (
                split_shortage(x, slots, need_p, need_d),
                busier_utilisation(x, slots, need_p, need_d),
                x,
            ),
        )
    prefill = np.arange(1, slots, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        busier = np.maximum(need_p / prefill, need_d / (slots - prefill))
    shortage = slots * np.maximum(busier - 1.0, 0.0)
    return 1 + int(np.lexsort((prefill, busier, shortage))[0])


def colocated_shortage(
    spec: ClusterSpec,
    need_p: float,
    need_d: float,
    decode_sequences_per_gpu: float | None = None,
    decode_context_tokens: float | None = None,
    prefilling_ranks_cap: float | None = None,
    *,
    prefill_target_util: float,
) -> float:
    """Slots of demand left unserved with every slot colocated (``need_p`` in prefill
    slots run at ``prefill_target_util``).

    Colocation pools capacity, but with data-parallel attention a prefill chunk holds every
    rank of its engine, so prefill costs :meth:`ClusterSpec.prefill_interference_at` times
    its work there: several times under light prefill, about once when every rank
    prefills (a sync step's opening burst). Decode runs at the colocated layout's
    throughput relative to decode's at ``decode_sequences_per_gpu``
    (:meth:`ClusterSpec.colocated_decode_ratio_at`). ``prefilling_ranks_cap`` bounds the
    ranks that prefill together (:func:`colocated_prefill_ranks`). How often a rank
    prefills follows the work itself, the need at full utilisation.
    """
    ratio = spec.colocated_decode_ratio_at(decode_sequences_per_gpu, decode_context_tokens)
    need_d = need_d / ratio
    interference = spec.prefill_interference_at(need_p * prefill_target_util, prefilling_ranks_cap)
    return max(need_p * interference + need_d - spec.num_slots, 0.0)


def live_trajectories(obs: ClusterObservation) -> tuple[int, int]:
    """(trajectories, their context tokens) not yet done, over every lifecycle state."""
    live = sum(n for state, n in obs.trajectory_state.items() if state != "done")
    tokens = sum(n for state, n in obs.trajectory_tokens.items() if state != "done")
    return live, tokens


def colocated_prefill_ranks(obs: ClusterObservation, spec: ClusterSpec) -> float | None:
    """Prefills a colocated engine's KV admits at once when the live contexts overflow
    the colocated KV (None when they fit, or what it needs is unknown).

    Then the KV is always full, shared by decoding sequences and prefilling turns, each
    holding its context. Both advance one step at a time in lockstep: a decode for its
    turn's output tokens, a prefill for its context over a rank's step budget (under
    such pressure a turn's cached prefix does not survive until it comes back, so it
    prefills whole). Their shares of the KV follow those step counts, so an engine
    holding ``C`` tokens at live context ``c`` admits ``C / c * p / (p + o)`` prefills
    (``p = c / budget`` steps, ``o`` output tokens per turn from the workload's
    shape); the step time cancels. Qwen3-235B-A22B tau2 sync 128/GPU on tp1-dp8-ep8-a2a
    engines: 3.6 by this at the first tick; 3.3-3.8 ranks prefilling per step in the
    simulator at 64 and 128/GPU (``benchmarks/prefill_concurrency_bench.py``), not the
    eight the packed price assumes.
    """
    shape = obs.workload
    kv = spec.colocated_kv_tokens_per_engine
    engines, budget = spec.colocated_engines, spec.colocated_step_tokens_per_rank
    if shape is None or kv <= 0 or engines <= 0 or budget <= 0 or spec.dp_attention_ranks <= 1:
        return None
    live, tokens = live_trajectories(obs)
    if live <= 0 or tokens <= kv * engines:
        return None
    context = tokens / live
    prefill_steps = context / budget
    decode_steps = max(shape.output_tokens_per_turn, 1.0)
    return kv / context * prefill_steps / (prefill_steps + decode_steps)


#: How soon a live agentic trajectory comes back for its next turn: a decode of a few
#: hundred tokens plus a tool call of 1-4 s median with a tail to tens of seconds (the
#: design's reference numbers, docs: DESIGN section 1).
TURN_CYCLE_S = 10.0


def split_recompute_slots(
    obs: ClusterObservation,
    spec: ClusterSpec,
    target_util: float,
    window_s: float = TURN_CYCLE_S,
) -> float:
    """Prefill slots a split would add under re-prefill (stock vLLM + NIXL), run at
    ``target_util`` (the utilisation the policy sizes prefill to, so that they add to
    its prefill need in the same unit).

    Colocated (and decode) engines keep a trajectory's context between turns; a prefill
    engine reuses only its own prefix cache. Moving to a split, every live trajectory
    that comes back for another turn brings its context to a prefill engine that does
    not hold it; counted as recomputed once per ``window_s`` (a turn cycle). Zero when
    prefill engines can read earlier context (``pull``, ``kv-store``).
    """
    if spec.reuse_mode != "reprefill":
        return 0.0
    _, tokens = live_trajectories(obs)
    per_slot = spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus * target_util
    return float(tokens) / max(window_s, 1e-9) / max(per_slot, 1e-9)


def prefill_cache_overflow_slots(
    obs: ClusterObservation,
    spec: ClusterSpec,
    prefill_slots: np.ndarray,
    at_s: np.ndarray,
    window_s: float = TURN_CYCLE_S,
    *,
    target_util: float,
) -> np.ndarray:
    """Prefill slots that re-prefilling what the prefill engines' prefix caches cannot
    hold adds at ``prefill_slots`` prefill slots, over what it adds at the current split
    (whose cost the measured work ratio already holds), ``at_s`` seconds ahead
    [len(at_s), len(prefill_slots)], in slots run at ``target_util`` (as a policy sizes
    prefill). Zero unless re-prefill (the only reuse a prefill engine has is its own
    prefix cache).

    The live trajectories' contexts (growing by a turn's new and output tokens per turn
    cycle, up to the workload's final context) come back once per ``window_s``; what
    exceeds the pool's cache is prefilled again in full each time (the optimistic count:
    under LRU a cycle longer than the cache misses more). Found in the regime map
    (Qwen3-30B-A3B mixed sync 64/GPU, 5.2M cached tokens per 8-GPU prefill slot): a plan
    that priced prefill at the ratio measured on two prefill slots moved one to decode;
    the remaining cache filled within 5 s, its misses grew the queue to 6.5M tokens and
    the work ratio from 2.5 to 29 (0.91x of holding the split).
    """
    prefill_slots = np.asarray(prefill_slots, dtype=float)
    out = np.zeros((len(at_s), len(prefill_slots)))
    shape = obs.workload
    caches = [s.kv_capacity_tokens for s in obs.slots if s.role == "prefill"]
    if spec.reuse_mode != "reprefill" or not caches:
        return out
    live, tokens = live_trajectories(obs)
    if live <= 0:
        return out
    growth = 0.0
    ceiling = float("inf")
    if shape is not None:
        growth = live * (shape.new_tokens_per_turn + shape.output_tokens_per_turn) / window_s
        ceiling = max(live * shape.final_context_tokens, float(tokens))
    working = np.minimum(tokens + growth * np.asarray(at_s, dtype=float), ceiling)
    cache = float(np.mean(caches))
    per_slot = spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus * target_util
    now = current_load(obs).prefill_slots

    def overflow(x: np.ndarray) -> np.ndarray:
        return np.maximum(working[:, None] - x[None, :] * cache, 0.0)

    extra = overflow(prefill_slots) - overflow(np.array([float(now)]))
    return extra / window_s / max(per_slot, 1e-9)


def paying_s(payback_s: float, switch_s: float) -> float:
    """Seconds of the payback window a switch taking ``switch_s`` still pays back over:
    its slots serve their new role only once it completes."""
    return max(payback_s - switch_s, 0.0)


#: The two ends of the forecast band a switch must pay back at (a policy's ``robust``).
ROBUST_QUANTILES = (0.1, 0.9)


def band_levels(forecast: Forecast, quantile: float | None, robust: bool) -> list[float | None]:
    """The demand quantiles a policy plans at: both ends of the band (``ROBUST_QUANTILES``)
    when ``robust`` and the forecast gives both, else its own ``quantile``."""
    if robust and quantile is not None and all(q in forecast.quantiles for q in ROBUST_QUANTILES):
        return list(ROBUST_QUANTILES)
    return [quantile]


def agreed_mode(modes: Sequence[str | int | None]) -> str | int | None:
    """The change :func:`choose_mode` asks for at every end of the forecast band, or None
    (stay) where they differ: both colocate, both disaggregate, or both stay. When all
    disaggregate, the last end's split count: the band's upper end (P90), sized for the
    demand's high end as the policies' default ``quantile`` is; the split is tuned from
    the next tick on, where both ends must agree on any move."""

    def same(a: str | int | None, b: str | int | None) -> bool:
        return (isinstance(a, int) and isinstance(b, int)) or a == b

    last = modes[-1]
    return last if all(same(m, last) for m in modes) else None


def agreed_move(current: int, targets: Sequence[int]) -> int:
    """The split every end of the forecast band moves toward from ``current``, by the
    smallest of their moves; ``current`` where any end holds or they disagree."""
    moves = [t - current for t in targets]
    if all(m > 0 for m in moves) or all(m < 0 for m in moves):
        return current + min(moves, key=abs)
    return current


def choose_mode(
    obs: ClusterObservation,
    spec: ClusterSpec,
    need_p: float,
    need_d: float,
    *,
    current_prefill: int,
    payback_s: float,
    switch_cost_weight: float,
    prefill_target_util: float,
    colocated_need_p: float | None = None,
) -> str | int | None:
    """Whether to change between colocation and disaggregation.

    Returns ``"colocated"`` to colocate every slot, a prefill slot count to disaggregate,
    or None to stay in the current mode (a split policy then tunes its split). A change
    must save more unserved slot-seconds over ``payback_s`` than it costs: the switching
    slots' latency plus rebuilding the contexts it loses (cached on the decode-side slots
    it moves; from a split, those the router spreads over the slots that join decode);
    from a split it must also net more than re-sizing the split would. Savings start
    only once the switch completes (:func:`paying_s`): a reshard that outlasts the window
    saves nothing.
    Leaving colocation under re-prefill, the split's prefill also recomputes the live
    trajectories' contexts (:func:`split_recompute_slots`). When decode and colocated run
    different layouts, every slot reshards, not only the prefill ones.
    ``prefill_target_util`` is the utilisation ``need_p`` and ``colocated_need_p`` are
    sized at; the recompute and the rebuilds are counted in that unit too, and the
    colocated interference reads the work itself (the need times it).
    ``colocated_need_p`` is the prefill need were the slots colocated (a split's prefill
    engines may compute more per appended token, :class:`PrefillWorkMeter`); default
    ``need_p``.
    """
    n = spec.num_slots
    load = current_load(obs)
    per_gpu = load.decode_sequences / max(spec.total_gpus, 1)
    context = load.decode_kv_tokens / load.decode_sequences if load.decode_sequences else None
    c_need_p = need_p if colocated_need_p is None else colocated_need_p
    cap = colocated_prefill_ranks(obs, spec)
    c_short = colocated_shortage(
        spec, c_need_p, need_d, per_gpu, context, cap, prefill_target_util=prefill_target_util
    )
    if colocated_now(obs):
        # A split must also recompute what the colocated engines cache (re-prefill).
        need_p = need_p + split_recompute_slots(obs, spec, prefill_target_util)
    best_x = best_split(n, need_p, need_d)
    pd_short = split_shortage(best_x, n, need_p, need_d)
    # Decode <-> colocated is a relabel only when both roles run one layout; otherwise
    # those slots restart resharded too and lose the contexts they cache.
    layouts = spec.role_layouts or spec.role_tp
    relabel = layouts.get("decode") == layouts.get("colocated")
    if colocated_now(obs):
        done_s = spec.switch_latency_between("colocated", "prefill")
        latency = best_x * done_s
        moved = best_x
        if not relabel:
            latency += (n - best_x) * spec.switch_latency_between("colocated", "decode")
            done_s = max(done_s, spec.switch_latency_between("colocated", "decode"))
            moved = n
        # The colocated slots that leave drain their running sequences first.
        done_s += decode_drain_s(obs, spec, moved)
        saved = (c_short - pd_short) * paying_s(payback_s, done_s)
        lost = latency + decode_slot_rebuild_s(obs, spec, moved, prefill_target_util)
        return best_x if saved > switch_cost_weight * lost else None
    current_short = split_shortage(current_prefill, n, need_p, need_d)
    # Prefill slots move (decode slots only change how the router uses them, if relabelled).
    # Colocated, every turn prefills where its context lives, so the prefill slots' caches
    # are not missed; but the router spreads the decode side's contexts over the slots
    # that join it, and those are re-prefilled: about as many as the moved slots' share
    # (all of them when the decode slots restart resharded too).
    done_s = spec.switch_latency_between("prefill", "colocated")
    latency = current_prefill * done_s
    moved = current_prefill
    if not relabel:
        latency += (n - current_prefill) * spec.switch_latency_between("decode", "colocated")
        # Decode slots that reshard drain their running sequences first (as leaving
        # colocation does above): colocation serves only once the longest drain ends.
        reshard_s = spec.switch_latency_between("decode", "colocated")
        done_s = max(done_s, reshard_s + decode_drain_s(obs, spec, n - current_prefill))
        moved = n
    saved = (current_short - c_short) * paying_s(payback_s, done_s)
    colocate_net = saved - switch_cost_weight * (
        latency + decode_slot_rebuild_s(obs, spec, moved, prefill_target_util)
    )
    # Colocate only if that nets more than re-sizing the split would (the split policy
    # does that itself when this returns None).
    resize_s = spec.switch_latency_between("decode", "prefill")
    resized = abs(best_x - current_prefill) * resize_s
    resized += resize_rebuild_s(obs, spec, current_prefill, best_x, prefill_target_util)
    # Growing prefill takes decode slots, which drain first, as colocating's do above.
    resize_done_s = resize_s + decode_drain_s(obs, spec, best_x - current_prefill)
    resize_net = (current_short - pd_short) * paying_s(
        payback_s, resize_done_s
    ) - switch_cost_weight * resized
    return "colocated" if colocate_net > max(resize_net, 0.0) else None
