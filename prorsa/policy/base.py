"""The Policy interface and the policy registry."""

from __future__ import annotations

import inspect
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TypeVar

import numpy as np

from prorsa.errors import ConfigError
from prorsa.policy.types import (
    SWITCHING,
    Allocation,
    ClusterObservation,
    Forecast,
    switch_latency_s,
)
from prorsa.registry import Registry

T = TypeVar("T")


@dataclass(frozen=True)
class ClusterSpec:
    """Static facts about the cluster a policy controls.

    ``slot_gpus`` GPUs switch roles together; ``role_tp`` is the tensor-parallel degree an
    engine of each role runs with, so a slot hosts ``slot_gpus // role_tp[role]`` engines.
    """

    num_slots: int
    slot_gpus: int
    role_tp: dict[str, int]
    prefill_tokens_per_s_per_gpu: float
    decode_tokens_per_s_per_gpu: float
    switch_latency_s: float
    min_dwell_s: float
    # Data-parallel attention ranks of a colocated engine: its prefill stalls that many ranks.
    dp_attention_ranks: int = 1
    # Extra switch latency when the two roles' parallel layouts differ.
    reshard_latency_s: float = 0.0
    # Parallel layout per role (``tp1-dp8-ep8``); empty: each role's TP is its layout.
    role_layouts: dict[str, str] = field(default_factory=dict)
    # GPU-seconds of colocated capacity one prefill token costs, relative to a prefill
    # engine's (every data-parallel rank stalls while one prefills); None: the ranks.
    colocated_prefill_factor: float | None = None
    # The same when every rank of a colocated engine prefills in the same step (the
    # stall is shared by all their chunks); None: no sharing (the one-rank factor).
    colocated_packed_prefill_factor: float | None = None
    # Prefill tokens/s per GPU colocated engines carry with every rank prefilling every
    # step, over a prefill engine's GPU: how busy with prefill their ranks are at a demand.
    colocated_packed_prefill_ratio: float | None = None
    # Decode tokens/s per GPU of colocated engines when their layout differs from decode's.
    colocated_decode_tokens_per_s_per_gpu: float | None = None
    # The same relative to a decode GPU at several loads: (decode sequences per GPU,
    # context tokens, ratio), a full grid; empty: :attr:`colocated_decode_ratio` always.
    colocated_decode_ratio_by_load: tuple[tuple[float, float, float], ...] = ()
    # Decode tokens/s per GPU of the decode role at several loads: (decode sequences per
    # GPU, context tokens, tokens/s per GPU), a full grid; empty: not known (policies then
    # size decode by a target batch alone).
    decode_tokens_per_s_by_load: tuple[tuple[float, float, float], ...] = ()
    # How a prefill engine gets a trajectory's earlier context (ClusterConfig.reuse_mode):
    # under "reprefill" it recomputes what its own prefix cache lacks.
    reuse_mode: str = "reprefill"
    # How a switching slot's in-flight decodes leave it (ClusterConfig.switch_mode):
    # "drain" lets them finish, up to ``drain_timeout_s``; "migrate" moves them at once.
    switch_mode: str = "drain"
    drain_timeout_s: float = 60.0
    # KV tokens one colocated engine holds (over all its ranks), how many colocated
    # engines the cluster would run with every slot colocated, and a rank's step token
    # budget: what bounds the prefills a colocated engine admits beside its decodes
    # (:func:`prorsa.policy.demand.colocated_prefill_ranks`). Zero: not known.
    colocated_kv_tokens_per_engine: float = 0.0
    colocated_engines: int = 0
    colocated_step_tokens_per_rank: int = 0

    def switch_latency_between(self, old: str, new: str) -> float:
        """Seconds a slot serves nothing when moving from role ``old`` to ``new``."""
        layouts = self.role_layouts or self.role_tp
        return switch_latency_s(
            old, new, layouts, base_s=self.switch_latency_s, reshard_s=self.reshard_latency_s
        )

    @property
    def colocated_decode_ratio(self) -> float:
        """Decode capacity of a colocated GPU relative to a decode GPU."""
        tps = self.colocated_decode_tokens_per_s_per_gpu
        return tps / self.decode_tokens_per_s_per_gpu if tps else 1.0

    def colocated_decode_ratio_at(
        self, sequences_per_gpu: float | None, context_tokens: float | None = None
    ) -> float:
        """:attr:`colocated_decode_ratio` with ``sequences_per_gpu`` decoding per GPU at
        ``context_tokens`` each (interpolated in log load and log context, clamped to the
        quoted range; None: the fixed ratio; no context: the middle one quoted).

        Layouts part most under load: a TP4 engine of Qwen3-235B-A22B holds 18 sequences
        of 8k context, so per GPU it decodes 1.2x a TP2-DP4-EP8 GPU at 1 sequence per
        GPU and 0.14x at 32 (the fixed ratio's load); a light run priced at 32 per GPU
        left colocation, the fastest layout there, for a split (docs/regime_map.md).
        """
        if not self.colocated_decode_ratio_by_load or sequences_per_gpu is None:
            return self.colocated_decode_ratio
        rows = self._decode_ratio_rows
        contexts = list(rows)
        context = context_tokens if context_tokens else contexts[len(contexts) // 2]
        by_context = [(ctx, _interp_log(row, sequences_per_gpu)) for ctx, row in rows.items()]
        return _interp_log(by_context, context)

    @cached_property
    def _decode_ratio_rows(self) -> dict[float, list[tuple[float, float]]]:
        """:attr:`colocated_decode_ratio_by_load` as (load, ratio) rows per context, in
        increasing context and load (grouped once; read every decision)."""
        rows: dict[float, list[tuple[float, float]]] = {}
        for load, context, ratio in sorted(self.colocated_decode_ratio_by_load):
            rows.setdefault(context, []).append((load, ratio))
        return dict(sorted(rows.items()))

    def decode_step_ratio(
        self, sequences_per_gpu: np.ndarray, context_tokens: float, reference_per_gpu: float
    ) -> np.ndarray:
        """How many times longer a decode step is with ``sequences_per_gpu`` decoding per
        decode GPU than with ``reference_per_gpu``, at ``context_tokens`` each: the time
        per generated token of one sequence, ``load / tokens_per_s(load)``, relative
        (:attr:`decode_tokens_per_s_by_load` interpolated in log load and log context,
        clamped to its range; throughput stays at its last quote beyond it). Decode is
        memory-bound: twice the batch costs far less than twice the step until the batch
        or KV limit, past which the extra sequences wait their turn.
        """
        rows = self._decode_tps_rows
        loads = np.asarray(sequences_per_gpu, dtype=float)
        by_context = [(ctx, np.log(ls), np.log(tps)) for ctx, (ls, tps) in rows.items()]

        def log_tps(x: np.ndarray) -> np.ndarray:
            lx = np.log(np.maximum(x, 1e-9))
            at = [(ctx, np.interp(lx, xs, ys)) for ctx, xs, ys in by_context]
            if len(at) == 1 or context_tokens <= at[0][0]:
                return at[0][1]
            for (c0, y0), (c1, y1) in itertools.pairwise(at):
                if context_tokens <= c1:
                    w = (math.log(context_tokens) - math.log(c0)) / (math.log(c1) - math.log(c0))
                    return y0 + w * (y1 - y0)
            return at[-1][1]

        ref = np.array([reference_per_gpu], dtype=float)
        per_token = loads / np.exp(log_tps(loads))
        return per_token / (ref / np.exp(log_tps(ref)))

    @cached_property
    def _decode_tps_rows(self) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        """:attr:`decode_tokens_per_s_by_load` as (loads, tokens/s) arrays per context."""
        rows: dict[float, list[tuple[float, float]]] = {}
        for load, context, tps in sorted(self.decode_tokens_per_s_by_load):
            rows.setdefault(context, []).append((load, tps))
        return {
            c: (np.array([a for a, _ in r]), np.array([b for _, b in r]))
            for c, r in sorted(rows.items())
        }

    @property
    def prefill_interference(self) -> float:
        """How many times its own work a prefill costs on a colocated engine."""
        if self.colocated_prefill_factor is not None:
            return self.colocated_prefill_factor
        return float(self.dp_attention_ranks)

    def prefill_interference_at(
        self, prefill_work_slots: float, prefilling_ranks_cap: float | None = None
    ) -> float:
        """:attr:`prefill_interference` when colocated engines carry ``prefill_work_slots``
        slots of prefill work (tokens/s over one slot's quoted prefill tokens/s, at full
        utilisation: not a need sized at a target utilisation), at most
        ``prefilling_ranks_cap`` ranks of an engine prefilling in one step (None: all of
        them may).

        One rank prefilling stalls the others (``colocated_prefill_factor``, f1); all
        ``r`` ranks prefilling share that stall (``colocated_packed_prefill_factor``,
        fr). Each rank holds a chunk in a share ``q`` of steps (demand over the
        colocated engines' packed prefill capacity), independently of the others; a step
        with any chunk pays the stall ``F`` once, so a token costs ``m + F * P(k >= 1) /
        E[min(k, cap)]`` with ``k ~ Binomial(r, q)``: f1 at light demand, fr at
        saturation, ``m + F / cap`` at saturation when the engine's KV admits prefills
        on only ``cap`` ranks (``m``, ``F`` from f1 and fr: the cost model's step is
        nearly ``m + F / k``).
        """
        ranks = self.dp_attention_ranks
        f1, fr = self.prefill_interference, self.colocated_packed_prefill_factor
        ratio = self.colocated_packed_prefill_ratio
        if fr is None or ratio is None or ranks <= 1 or f1 <= fr:
            return f1
        q = min(max(prefill_work_slots, 0.0) / (self.num_slots * ratio), 1.0)
        if q <= 1e-9:
            return f1
        stall = (f1 - fr) * ranks / (ranks - 1)
        if prefilling_ranks_cap is None or prefilling_ranks_cap >= ranks:
            share_of_steps = (1.0 - (1.0 - q) ** ranks) / (q * ranks)
        else:
            cap = max(prefilling_ranks_cap, 1.0)
            served = sum(
                math.comb(ranks, k) * q**k * (1.0 - q) ** (ranks - k) * min(k, cap)
                for k in range(1, ranks + 1)
            )
            share_of_steps = (1.0 - (1.0 - q) ** ranks) / served
        return f1 - stall + stall * share_of_steps

    @property
    def total_gpus(self) -> int:
        return self.num_slots * self.slot_gpus


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log x through ``points`` (increasing x), clamped at the ends."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    lx = math.log(x)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            w = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


#: ``start="auto"`` colocates unless a colocated prefill costs more than this many times
#: its work (data-parallel attention ranks stalled behind it).
AUTO_COLOCATE_MAX_INTERFERENCE = 1.5


class Policy(ABC):
    """Decides how many GPUs serve prefill, decode or both.

    ``decide`` must be a pure function of the observation, the forecast and the policy's
    own state: no clocks, no I/O, no cluster mutation (actuators do that).
    """

    #: True when the policy needs a forecast at every tick.
    needs_forecast: bool = False
    #: False for fixed allocations: the controller then never ticks (saves time).
    dynamic: bool = True

    #: True while :meth:`resize` runs :meth:`reset`.
    resizing_: bool = False

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        """Forget state; called once before a run (and by :meth:`resize` mid-run)."""
        self.cluster_ = cluster
        self.seed_ = seed

    def resize(self, cluster: ClusterSpec) -> None:
        """Size the policy to ``cluster`` mid-run, when an engine left or came back.

        Runs :meth:`reset` with :attr:`resizing_` set: what a policy learned of the run
        (timers, a mode change under way, measured ratios) is kept where its reset reads
        it through :meth:`kept_on_resize`; the rest is rebuilt for the new size.
        """
        self.resizing_ = True
        try:
            self.reset(cluster, getattr(self, "seed_", 0))
        finally:
            self.resizing_ = False

    def kept_on_resize(self, name: str, fresh: T) -> T:
        """``fresh``, or during :meth:`resize` the value already held as ``name``."""
        return getattr(self, name, fresh) if self.resizing_ else fresh

    @abstractmethod
    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        """Return the target allocation for this tick."""

    def forecast_horizons(self, fitted: Sequence[float]) -> tuple[float, ...] | None:
        """The horizons of ``fitted`` that :meth:`decide` reads (None: all of them).

        The controller then asks its forecaster for these only: every forecaster predicts
        each horizon on its own (a conformance test checks it), so the decisions are the
        same and the tick is cheaper.
        """
        return None

    @classmethod
    def search_space(cls, trial) -> dict:
        """Parameters an Optuna ``trial`` should tune (none by default)."""
        return {}

    @classmethod
    def search_defaults(cls) -> dict:
        """Values of :meth:`search_space`'s Optuna parameters that give the constructor's
        defaults. A new study runs them as its first trial, so tuning never settles on
        parameters worse than the defaults on its own seeds. By default the constructor
        defaults of the parameters named alike; override when a drawn parameter is
        derived (a ratio, say)."""
        return {
            name: p.default
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty
        }


def heading_roles(obs: ClusterObservation) -> set[str]:
    """The roles the slots serve, a switching slot counted in the role it heads to."""
    return {s.target_role if s.role == SWITCHING else s.role for s in obs.slots}


def mixed_modes(obs: ClusterObservation) -> bool:
    """True when some slots serve (or head to) colocation and others prefill or decode:
    a change of mode under way."""
    roles = heading_roles(obs)
    return "colocated" in roles and len(roles) > 1


def colocated_now(obs: ClusterObservation) -> bool:
    """True when no slot serves (or is heading to) prefill or decode alone."""
    return heading_roles(obs) <= {"colocated"}


class SplitPolicy(Policy):
    """Base of policies that split the slots into prefill and decode (no colocated).

    Subclasses store ``prefill_fraction`` (the split before their first real decision)
    and may store ``local_prefill_threshold`` (applied with every allocation when set).
    """

    prefill_fraction: float = 0.25
    local_prefill_threshold: int | None = None

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        name = type(self).__name__
        if not 0 < self.prefill_fraction < 1:
            raise ConfigError(f"{name}: prefill_fraction must be in (0, 1)")
        if cluster.num_slots < 2:
            raise ConfigError(f"{name}: a prefill/decode split needs at least two slots")

    def initial_prefill_slots(self) -> int:
        """``prefill_fraction`` of the slots, at least one on each side."""
        slots = self.cluster_.num_slots
        return min(max(round(self.prefill_fraction * slots), 1), slots - 1)

    def colocate(self, reason: str) -> Allocation:
        """Every slot colocated."""
        return Allocation(
            gpus={"colocated": self.cluster_.total_gpus},
            local_prefill_threshold=self.local_prefill_threshold,
            reason=reason,
        )

    def split(self, prefill_slots: int, reason: str) -> Allocation:
        """An allocation of ``prefill_slots`` prefill slots and the rest decode."""
        size = self.cluster_.slot_gpus
        decode = (self.cluster_.num_slots - prefill_slots) * size
        return Allocation(
            gpus={"prefill": prefill_slots * size, "decode": decode},
            local_prefill_threshold=self.local_prefill_threshold,
            reason=reason,
        )


class ModeChoosingPolicy(SplitPolicy):
    """A split policy that may also colocate every slot (``predictive``, ``mpc``).

    Subclasses store ``start`` (``"auto"``, ``"colocated"`` or ``"split"``: the mode before
    the first forecast) and call :meth:`before_forecast` and :meth:`apply_mode` from
    ``decide``; ``apply_mode`` returns None when the policy should tune its split itself.
    """

    start: str = "auto"

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        if self.start not in ("auto", "colocated", "split"):
            raise ConfigError(
                f"{type(self).__name__}: start must be 'auto', 'colocated' or 'split'"
            )
        # The last mode change ordered (colocate, or disaggregate into a split), kept
        # until every slot has left the old mode.
        change: Allocation | None = self.kept_on_resize("mode_change_", None)
        # A lost engine leaves a change under way to finish, sized to the slots left.
        self.mode_change_ = None if change is None else self._resized(change)

    def _resized(self, change: Allocation) -> Allocation:
        """``change`` ordered again on the cluster as sized now."""
        if change.gpus.get("colocated"):
            return self.colocate(change.reason)
        prefill = change.gpus["prefill"] // self.cluster_.slot_gpus
        return self.split(min(max(prefill, 1), self.cluster_.num_slots - 1), change.reason)

    @staticmethod
    def start_space(trial) -> dict:
        """The start mode and split drawn by tuning: together with the knobs, since in
        many regimes they, not the knobs, decide the outcome."""
        return {
            "start": trial.suggest_categorical("start", ["auto", "colocated", "split"]),
            "prefill_fraction": trial.suggest_float("prefill_fraction", 0.05, 0.75),
        }

    def starts_colocated(self, start: str) -> bool:
        """Resolve a ``start`` parameter: ``"auto"`` colocates unless the colocated engines
        use data-parallel attention, whose prefill stalls every rank."""
        if start == "auto":
            return self.cluster_.prefill_interference <= AUTO_COLOCATE_MAX_INTERFERENCE
        return start == "colocated"

    def before_forecast(
        self, obs: ClusterObservation, current_prefill: int, name: str
    ) -> Allocation:
        """The allocation while no forecast has arrived: colocated if the cluster is and
        ``start`` says so, else the current split (or ``prefill_fraction``)."""
        if colocated_now(obs) and self.starts_colocated(self.start):
            return self.colocate(f"{name}: start colocated")
        return self.split(current_prefill or self.initial_prefill_slots(), f"{name}: no forecast")

    def apply_mode(
        self, obs: ClusterObservation, mode: str | int | None, name: str, why: str = ""
    ) -> Allocation | None:
        """The allocation :func:`~prorsa.policy.demand.choose_mode` asks for: colocate,
        disaggregate into ``mode`` prefill slots, or hold colocation; None when the cluster
        is split and stays split."""
        if mode == "colocated":
            self.mode_change_ = self.colocate(f"{name}: colocate{why}")
            return self.mode_change_
        if mode is not None:
            self.mode_change_ = self.split(mode, f"{name}: disaggregate{why}")
            return self.mode_change_
        if colocated_now(obs):
            return self.colocate(f"{name}: hold colocated")
        if self.mode_change_ is not None and mixed_modes(obs):
            # Slots held back by their dwell time are still in the old mode: finish the
            # change. Tuning the split now would count only the slots already moved and
            # send the rest elsewhere (a colocated slot left behind would reshard to
            # decode instead of joining prefill).
            return replace(self.mode_change_, reason=f"{name}: finishing the mode change{why}")
        return None


POLICIES: Registry[type[Policy]] = Registry("policy")


def make_policy(name: str, **params: object) -> Policy:
    """Instantiate the policy registered as ``name`` with ``params``."""
    import prorsa.policy  # noqa: F401  (registers the built-ins)

    return POLICIES.get(name)(**params)
