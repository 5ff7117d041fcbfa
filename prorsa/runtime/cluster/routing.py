"""Routing decisions both runtimes make, as pure rules over a small engine view.

A trajectory sticks to one *decode-side* engine (decode or colocated role), which keeps its
full context; new trajectories go to the decode-side engine that owns the fewest live
trajectories (ties: engine order). A turn is prefilled on that engine when it is colocated,
when no prefill engine serves, or when the turn appends fewer than the local-prefill
threshold tokens to a context the engine still caches; otherwise on the prefill engine
with the least queued plus uncached tokens (the trajectory's previous prefill engine when
its cache makes that no dearer).

The simulator and the Ray router call these functions with their own engine objects; both
expose the attributes of :class:`EngineView`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

#: Roles whose engines hold a trajectory's context between turns and decode it.
DECODE_SIDE: tuple[str, ...] = ("decode", "colocated")
#: Beyond this many prefill engines, pick by power of two choices instead of a full scan.
EXACT_PREFILL_CHOICE_MAX = 8
#: Cache affinity yields to load balance when a trajectory's sticky engine owns more than
#: this many trajectories over the least-owned engine and more than this many times as
#: many: the defaults of the cache-aware routers of SGLang and vLLM
#: (``--balance-abs-threshold 64``, ``--balance-rel-threshold 1.5``). Without it, engines
#: that join the decode side (prefill slots switched to colocated) stay idle while every
#: trajectory sticks to the old decode engines.
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


class EngineView(Protocol):
    """What routing reads from an engine (simulated or real)."""

    engine_id: int
    role: str
    accepting: bool  # false while switching roles (or dead)
    owned: int  # live trajectories whose decode side sticks here
    queued_prefill_tokens: int  # prefill tokens waiting or running here


E = TypeVar("E", bound=EngineView)


def serves_decode(engine: EngineView) -> bool:
    """True when ``engine`` takes new decode-side work."""
    return engine.accepting and engine.role in DECODE_SIDE


class DecodePlacement:
    """Chooses decode-side engines by fewest owned trajectories, in O(log engines).

    Callers keep each trajectory's sticky engine themselves and report ownership changes
    through :meth:`move`; a lazy heap skips entries whose count changed since they were
    pushed. Call :meth:`refresh` whenever engines join or leave the decode side.
    """

    def __init__(self) -> None:
        self._eligible: list = []
        self._order: dict[int, int] = {}
        self._heap: list[tuple[int, int, object]] = []

    def refresh(self, engines: Sequence[E]) -> None:
        """Take the decode-side engines among ``engines`` (in order) as the candidates."""
        self._eligible = [e for e in engines if serves_decode(e)]
        self._order = {e.engine_id: i for i, e in enumerate(self._eligible)}
        self._heap = [(e.owned, i, e) for i, e in enumerate(self._eligible)]
        heapq.heapify(self._heap)

    @property
    def candidates(self) -> list:
        return self._eligible

    def choose(self, sticky: E | None) -> E | None:
        """The trajectory's sticky engine if it still serves decode and is not overloaded
        (:func:`overloaded`), else the least owned. Called when a turn begins: a
        trajectory moves only between turns, and its next prefill rebuilds its context."""
        if sticky is not None and serves_decode(sticky):
            least = self._least_owned()
            if least is None or not overloaded(sticky.owned, least.owned):
                return sticky
            return least
        return self._least_owned()

    def _least_owned(self) -> E | None:
        heap = self._heap
        while heap:
            owned, _, engine = heap[0]
            if owned == engine.owned and serves_decode(engine):
                return engine
            heapq.heappop(heap)
        return None

    def move(self, old: E | None, new: E | None) -> None:
        """A trajectory's decode side moves from ``old`` to ``new`` (either may be None)."""
        if old is new:
            return
        if old is not None:
            self._changed(old, -1)
        if new is not None:
            self._changed(new, +1)

    def _changed(self, engine: E, delta: int) -> None:
        engine.owned += delta
        order = self._order.get(engine.engine_id)
        if order is not None and serves_decode(engine):
            heapq.heappush(self._heap, (engine.owned, order, engine))
            if len(self._heap) > 8 * len(self._eligible) + 64:
                self.refresh(self._eligible)


def overloaded(owned: int, least_owned: int) -> bool:
    """True when an engine owning ``owned`` trajectories should hand a trajectory to one
    owning ``least_owned`` (both thresholds exceeded)."""
    return (
        owned - least_owned > BALANCE_ABS_THRESHOLD and owned > BALANCE_REL_THRESHOLD * least_owned
    )


def least_owned(
    engines: Sequence[E],
    exclude: E | None = None,
    load: Callable[[E], int] | None = None,
) -> E | None:
    """Decode-side engine with the fewest owned trajectories, then the least ``load``
    (e.g. sequences decoding), then engine order: where migrated decodes go."""
    candidates = [e for e in engines if e is not exclude and serves_decode(e)]
    if not candidates:
        return None
    if load is None:
        return min(candidates, key=lambda e: e.owned)
    return min(candidates, key=lambda e: (e.owned, load(e)))


def choose_prefill(
    engines: Sequence[E],
    sticky: E | None,
    context_tokens: int,
    cached_tokens: Callable[[E], int],
    rng: np.random.Generator | None = None,
) -> E | None:
    """The prefill engine for a turn of ``context_tokens``.

    Picks the engine with the fewest queued prefill tokens (exactly on small pools; by
    power of two choices beyond :data:`EXACT_PREFILL_CHOICE_MAX` engines, which needs
    ``rng``), then keeps the trajectory's ``sticky`` engine instead when its queue plus
    the tokens its cache lacks is no larger. ``cached_tokens(engine)`` is how much of this
    trajectory's context the engine holds.
    """
    if not engines:
        return None
    if len(engines) <= EXACT_PREFILL_CHOICE_MAX or rng is None:
        least = min(engines, key=_queued_tokens)
    else:
        i, j = rng.integers(len(engines), size=2)
        a, b = engines[i], engines[j]
        least = a if a.queued_prefill_tokens <= b.queued_prefill_tokens else b
    if sticky is None or sticky is least or not sticky.accepting or sticky.role != "prefill":
        return least
    sticky_cost = sticky.queued_prefill_tokens + context_tokens - cached_tokens(sticky)
    least_cost = least.queued_prefill_tokens + context_tokens - cached_tokens(least)
    return sticky if sticky_cost <= least_cost else least


def prefill_locally(
    decode_role: str,
    prefill_engines_serving: bool,
    appended_tokens: int,
    decode_cached_tokens: int,
    context_tokens: int,
    threshold_tokens: int,
) -> bool:
    """Whether a turn is prefilled on its decode-side engine.

    A colocated engine always prefills its own turns; so does a decode engine when no
    prefill engine serves. Otherwise a turn is local only when it appends fewer than
    ``threshold_tokens`` and the decode engine still caches the rest of the context: a
    decode engine that lost the context would stall its batch recomputing it, so that
    turn goes to a prefill engine like any other.
    """
    if decode_role == "colocated" or not prefill_engines_serving:
        return True
    return (
        appended_tokens < threshold_tokens
        and decode_cached_tokens >= context_tokens - appended_tokens
    )


def _queued_tokens(engine: EngineView) -> int:
    return engine.queued_prefill_tokens
