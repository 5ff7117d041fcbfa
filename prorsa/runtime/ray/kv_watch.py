"""Decode legs waiting for a remote prefill's KV, and which of them wait for ever.

A decode leg presents the ``kv_transfer_params`` of its prefill leg; vLLM admits it, starts
loading the KV from the prefill engine and parks it (``WAITING_FOR_REMOTE_KVS``) until the
load ends. A peer that died fails the load (vLLM then recomputes the prompt, see
:func:`prorsa.runtime.ray.config.kv_transfer_config`), but a transfer that never completes
(a hung peer, a stalled link) parks the leg for ever: vLLM has no deadline on it, and the
engine keeps stepping its other requests, so the load monitor's stall watch does not see it.

A leg is given up once either of two clocks has run ``timeout_s``:

* *Nothing explains its wait.* vLLM reports waits as counts, not per request, so this
  clock restarts whenever any request on the engine waited for admission or, its KV
  loaded, for a batch slot (:func:`prorsa.runtime.ray.load.waits_for_more_than_kv`). On
  an engine that always has such a request this clock never runs out.
* *It provably still waits for its KV.* vLLM keeps the legs holding KV blocks in one
  queue in arrival order and, at every step, schedules them from its head before anything
  else, skipping only those whose KV is still loading. So when a request that reached the
  engine after the leg is scheduled while the leg is not, the leg's KV had not arrived at
  that step (the request's ``scheduled_ts``, reported with its first output). The second
  clock runs from the first such step to the latest: its span is time the leg has
  certainly spent loading.

Both clocks restart when the engine was paused, asleep or busy with a control call. The
proofs need one scheduler fed in arrival order: a request counts only if it arrived
``overtake_margin_s`` after the leg, and an engine with data-parallel ranks or several
input-processing workers gives none (the first clock alone decides there). One case can
mislead the second clock: a leg whose KV load failed is recomputed from its prompt, and if
its blocks cannot be allocated it waits in the plain queue while legs behind it whose KV
arrived are scheduled; such a leg is given up after ``timeout_s`` of that and prefilled
again, at worst a second recompute.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Leg:
    since: float  # when it reached the engine
    first_proof: float | None = None  # first step proving it still loads (since a hold)
    last_proof: float | None = None


class KVWaitWatch:
    """Clocks of the decode legs on one engine that wait for remote KV.

    Args:
        timeout_s: a leg is overdue after this many seconds on either clock.
        overtake_margin_s: a request proves anything about a leg only if it reached the
            engine at least this long after it (requests a few milliseconds apart may
            enter the scheduler in either order).
    """

    def __init__(self, timeout_s: float, overtake_margin_s: float = 1.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.overtake_margin_s = overtake_margin_s
        self._legs: dict[str, _Leg] = {}
        self._held_at = float("-inf")  # last time the engine was paused, asleep or busy
        self._queued_at = float("-inf")  # last time a request waited for more than its KV

    def __len__(self) -> int:
        return len(self._legs)

    def add(self, request_id: str, now: float) -> None:
        """A decode leg with remote KV reached the engine at ``now``."""
        self._legs[request_id] = _Leg(now)

    def done(self, request_id: str) -> None:
        """The leg has its first token, ended, or was given up (unknown ids are ignored)."""
        self._legs.pop(request_id, None)

    def hold(self, at: float) -> None:
        """At ``at`` the engine was paused, asleep or busy: both clocks of every leg
        restart from there."""
        self._held_at = max(self._held_at, at)

    def queued(self, at: float) -> None:
        """At ``at`` a request waited for admission or a batch slot: every leg's first
        clock restarts from there (the leg may be that request)."""
        self._queued_at = max(self._queued_at, at)

    def scheduled(self, arrived: float, at: float) -> None:
        """A request that reached the engine at ``arrived`` was first scheduled at ``at``
        (same clock): every leg still waiting that arrived ``overtake_margin_s`` or more
        before it was still loading its KV then."""
        if at < self._held_at:
            return  # before the latest pause: proves nothing about the wait since
        before = arrived - self.overtake_margin_s
        for leg in self._legs.values():
            if leg.since > before:
                continue
            if leg.first_proof is None or leg.first_proof < self._held_at:
                leg.first_proof = leg.last_proof = at
            else:  # first outputs may come back in another order than their steps ran
                leg.first_proof = min(leg.first_proof, at)
                leg.last_proof = max(leg.last_proof, at)

    def overdue(self, now: float) -> list[str]:
        """Legs whose wait nothing explained, or that provably loaded, for ``timeout_s``
        or more, oldest first; they stay watched until :meth:`done`."""
        late = []
        for request_id, leg in self._legs.items():
            unexplained = now - max(leg.since, self._held_at, self._queued_at)
            proven = 0.0
            if leg.first_proof is not None and leg.first_proof >= self._held_at:
                proven = leg.last_proof - leg.first_proof
            if max(unexplained, proven) >= self.timeout_s:
                late.append((leg.since, request_id))
        return [request_id for _, request_id in sorted(late)]
