"""Role pools: which engine serves which role, what each is running, and who is alive.

The router reads the pools to pick engines and records every leg it runs as a
:class:`Lease`; the role switcher changes roles and waits on leases to drain. State changes
wake waiters through :meth:`RolePools.wait_until` (all on one asyncio event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from prorsa.errors import ConfigError
from prorsa.runtime.cluster.switching import RoleSwitch
from prorsa.runtime.ray.client import EngineClient


class Role(StrEnum):
    """What an engine does. ``switching`` engines take no new work."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    SWITCHING = "switching"


SERVING_ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE, Role.COLOCATED)


def parse_role(value: str | Role, *, serving: bool = True) -> Role:
    """``value`` as a :class:`Role`; ``serving`` rejects ``switching``."""
    try:
        role = Role(value)
    except ValueError:
        role = None
    if role is None or (serving and role is Role.SWITCHING):
        allowed = SERVING_ROLES if serving else tuple(Role)
        raise ConfigError(
            f"unknown role {value!r}", hint=f"choose one of: {', '.join(r.value for r in allowed)}"
        )
    return role


@dataclass(eq=False)
class Lease:
    """One leg (prefill, decode or a whole colocated turn) running on one engine."""

    request_id: str
    engine_id: int
    role: Role
    trajectory_id: str
    tokens: int  # context the leg holds in KV (what the load estimate reads)
    evicted: bool = False  # a role switch aborted it; the router serves it elsewhere
    #: Tokens a prefill leg computes (its uncached part); None: all of ``tokens``.
    compute_tokens: int | None = None
    #: Tokens a leg that prefills where it decodes (a colocated turn, a local prefill)
    #: still computes before its first token; 0 once that token exists.
    prefill_left: int = 0


@dataclass(eq=False)
class EngineState:
    """What the router knows about one engine."""

    engine_id: int
    client: EngineClient
    role: Role
    max_model_len: int | None = None
    vocab_size: int | None = None
    kv_capacity_tokens: int | None = None
    alive: bool = True
    switch: RoleSwitch | None = None  # the switch in progress (roles, stages, times)
    leases: dict[str, Lease] = field(default_factory=dict)
    # Prefill engines: handoffs whose KV the decode engine has not pulled yet.
    kv_pending: set[str] = field(default_factory=set)
    since_s: float = 0.0  # when the engine entered its current role (router clock)
    switches: int = 0
    owned: int = 0  # live trajectories whose decode side sticks here (routing)
    lost_cause: str | None = None  # why it was marked dead (telemetry), once it is
    #: ``time.monotonic()`` before which the engine gets no new work: Ray could not reach
    #: it (:meth:`RolePools.back_off`), which is not a death.
    unreachable_until: float = 0.0

    @property
    def switching_from(self) -> Role | None:
        """The role a switching engine left (None when not switching)."""
        return Role(self.switch.from_role) if self.switch is not None else None

    @property
    def switching_to(self) -> Role | None:
        """The role a switching engine heads to (None when not switching)."""
        return Role(self.switch.to_role) if self.switch is not None else None

    @property
    def accepting(self) -> bool:
        """Takes new work: alive, not switching roles, not backing off after Ray could not
        reach it."""
        return (
            self.alive
            and self.role is not Role.SWITCHING
            and (not self.unreachable_until or time.monotonic() >= self.unreachable_until)
        )

    @property
    def queued_prefill_tokens(self) -> int:
        """Tokens the prefill running here still computes, cached prefixes left out: prefill
        legs', and those of legs prefilling where they decode until their first token (the
        router's queue view, and the simulator's: its uncached ``prefill_left``)."""
        return sum(
            (x.tokens if x.compute_tokens is None else x.compute_tokens)
            if x.role is Role.PREFILL
            else x.prefill_left
            for x in self.leases.values()
        )

    @property
    def idle(self) -> bool:
        """No leg running and no KV handoff waiting to be pulled."""
        return not self.leases and not self.kv_pending


class RolePools:
    """All engines of one cluster, grouped by role.

    Args:
        engines: the engines' clients.
        roles: initial role per engine id (serving roles only).
        limits: optional per-engine ``{"max_model_len": ..., "vocab_size": ...,
            "kv_capacity_tokens": ...}`` (what ``EngineServer.health`` reports), used to
            reject requests before dispatch and to report KV capacity.
    """

    def __init__(
        self,
        engines: Iterable[EngineClient],
        roles: Mapping[int, str | Role],
        limits: Mapping[int, Mapping[str, int | None]] | None = None,
    ) -> None:
        self._engines: dict[int, EngineState] = {}
        limits = limits or {}
        for client in engines:
            if client.engine_id in self._engines:
                raise ConfigError(f"engine id {client.engine_id} is used twice")
            if client.engine_id not in roles:
                raise ConfigError(f"no role given for engine {client.engine_id}")
            limit = limits.get(client.engine_id, {})
            self._engines[client.engine_id] = EngineState(
                engine_id=client.engine_id,
                client=client,
                role=parse_role(roles[client.engine_id]),
                max_model_len=limit.get("max_model_len"),
                vocab_size=limit.get("vocab_size"),
                kv_capacity_tokens=limit.get("kv_capacity_tokens"),
            )
        unknown = set(roles) - set(self._engines)
        if unknown:
            raise ConfigError(f"roles given for unknown engine(s) {sorted(unknown)}")
        self._changed = asyncio.Event()
        #: Bumped whenever an engine's role or liveness changes (routing re-reads the pools).
        self.roles_version = 0
        self._lost_listeners: list[Callable[[EngineState], None]] = []

    # ------------------------------------------------------------------ queries
    def get(self, engine_id: int) -> EngineState:
        """The engine's state; :class:`ConfigError` for an unknown id."""
        try:
            return self._engines[engine_id]
        except (KeyError, TypeError):
            raise ConfigError(
                f"unknown engine id {engine_id!r}", hint=f"engines are {sorted(self._engines)}"
            ) from None

    def engines(self) -> list[EngineState]:
        return list(self._engines.values())

    def members(self, role: Role) -> list[EngineState]:
        """Live engines that currently serve ``role``."""
        return [e for e in self._engines.values() if e.alive and e.role is role]

    def roles(self) -> dict[int, Role]:
        """Current role of every live engine (``switching`` while a switch runs)."""
        return {e.engine_id: e.role for e in self._engines.values() if e.alive}

    def out_of_service(self) -> dict[int, str]:
        """Why each engine that left service did (its ``lost_cause``), by engine id."""
        return {
            e.engine_id: e.lost_cause or "unknown" for e in self._engines.values() if not e.alive
        }

    def counts(self) -> dict[str, int]:
        """Live engines per role, plus ``dead``."""
        out = {role.value: 0 for role in Role}
        out["dead"] = 0
        for e in self._engines.values():
            out[e.role.value if e.alive else "dead"] += 1
        return out

    @property
    def max_model_len(self) -> int | None:
        lens = [e.max_model_len for e in self._engines.values() if e.max_model_len]
        return min(lens) if lens else None

    @property
    def vocab_size(self) -> int | None:
        sizes = [e.vocab_size for e in self._engines.values() if e.vocab_size]
        return min(sizes) if sizes else None

    # ------------------------------------------------------------------ changes
    def set_role(self, engine_id: int, role: Role, at: float | None = None) -> None:
        """Change the role; ``at`` (router clock) marks when the engine entered it."""
        engine = self.get(engine_id)
        engine.role = role
        if at is not None:
            engine.since_s = at
        self.roles_version += 1
        self.notify()

    def mark_dead(self, engine_id: int, cause: str = "unknown") -> bool:
        """Take the engine out of every pool. True when it was alive until now; then
        ``cause`` is kept on the engine and every :meth:`on_engine_lost` listener is
        told, once."""
        engine = self.get(engine_id)
        was_alive, engine.alive = engine.alive, False
        if was_alive:
            engine.lost_cause = cause
        self.roles_version += 1
        self.notify()
        if was_alive:
            for listener in self._lost_listeners:
                listener(engine)
        return was_alive

    def back_off(self, engine_id: int, seconds: float) -> None:
        """Give the engine no new work for ``seconds`` (Ray could not reach it this time);
        routing sees it leave and come back like a role change."""
        engine = self.get(engine_id)
        engine.unreachable_until = time.monotonic() + seconds
        self.roles_version += 1
        self.notify()
        # A little late rather than early: the engine must accept again when this runs.
        asyncio.get_running_loop().call_later(seconds + 0.01, self._backed_off, engine)

    def _backed_off(self, engine: EngineState) -> None:
        if engine.accepting:
            self.roles_version += 1
            self.notify()

    def on_engine_lost(self, listener: Callable[[EngineState], None]) -> None:
        """Call ``listener(engine)`` when a live engine is marked dead (telemetry, metrics);
        the engine's ``role`` is still the one it had."""
        self._lost_listeners.append(listener)

    def lease(
        self,
        engine: EngineState,
        request_id: str,
        role: Role,
        trajectory_id: str,
        tokens: int,
        compute_tokens: int | None = None,
        prefill_left: int = 0,
    ) -> Lease:
        lease = Lease(
            request_id,
            engine.engine_id,
            role,
            trajectory_id,
            tokens,
            compute_tokens=compute_tokens,
            prefill_left=prefill_left,
        )
        engine.leases[request_id] = lease
        self.notify()
        return lease

    def release(self, lease: Lease) -> None:
        self._engines[lease.engine_id].leases.pop(lease.request_id, None)
        self.notify()

    def add_kv_pending(self, engine_id: int, request_id: str) -> None:
        self._engines[engine_id].kv_pending.add(request_id)
        self.notify()

    def clear_kv_pending(self, engine_id: int, request_id: str) -> None:
        self._engines[engine_id].kv_pending.discard(request_id)
        self.notify()

    def notify(self) -> None:
        """Wake everything waiting in :meth:`wait_until`."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float | None) -> bool:
        """Wait until ``predicate()`` holds after some change; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not predicate():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return predicate()
        return True
