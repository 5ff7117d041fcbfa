"""Decode legs waiting for a remote prefill's KV, and which of them wait for ever.

A decode leg presents the ``kv_transfer_params`` of its prefill leg; vLLM admits it, starts
loading the KV from the prefill engine and parks it (``WAITING_FOR_REMOTE_KVS``) until the
load ends. A peer that died fails the load (vLLM then recomputes the prompt, see
:func:`prorsa.runtime.ray.config.kv_transfer_config`), but a transfer that never completes
(a hung peer, a stalled link) parks the leg for ever: vLLM has no deadline on it, and the
engine keeps stepping its other requests, so the load monitor's stall watch does not see it.

A leg's wait is only suspicious once nothing else can explain it. Its clock restarts
whenever the engine was paused, asleep or busy with a control call, or a request whose KV
had arrived waited for a batch slot, or a request was preempted (the leg may be that
request). Until the leg is *overtaken* its clock also restarts whenever any request on the
engine waited for admission (:func:`prorsa.runtime.ray.load.waits_for_more_than_kv`).
vLLM reports these waits as counts, not per request, so on their own they cannot tell a
hung leg from a queue. The order of first tokens can: vLLM admits waiting requests first
come, first served (skipping those whose KV is still loading, and stopping at one it
cannot allocate blocks for), so once a request that reached the engine a clear margin
after the leg has its first token while the leg has none, the leg has been admitted and
its KV has not arrived; from then on requests waiting for admission no longer restart its
clock. On an engine that always has requests waiting for admission, a hung leg is thus
given up ``timeout_s`` after it was overtaken instead of only once that queue empties. The
premise needs one scheduler fed in arrival order: an engine with data-parallel ranks or
several input-processing workers watches without overtaking (the counts alone).
"""

from __future__ import annotations


class KVWaitWatch:
    """Clocks of the decode legs on one engine that wait for remote KV.

    Args:
        timeout_s: a leg is overdue after this many seconds of unexplained waiting.
        overtake_margin_s: a request overtakes a leg only if it reached the engine at
            least this long after it (requests a few milliseconds apart may enter the
            scheduler in either order).
    """

    def __init__(self, timeout_s: float, overtake_margin_s: float = 1.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.overtake_margin_s = overtake_margin_s
        self._since: dict[str, float] = {}  # request id -> when it reached the engine
        self._overtaken: dict[str, float] = {}  # request id -> when a later one got a token
        self._held_at = float("-inf")  # last time the engine was paused, asleep or busy
        self._queued_at = float("-inf")  # last time a request waited for more than its KV

    def __len__(self) -> int:
        return len(self._since)

    def add(self, request_id: str, now: float) -> None:
        """A decode leg with remote KV reached the engine at ``now``."""
        self._since[request_id] = now

    def done(self, request_id: str) -> None:
        """The leg has its first token, ended, or was given up (unknown ids are ignored)."""
        self._since.pop(request_id, None)
        self._overtaken.pop(request_id, None)

    def hold(self, at: float) -> None:
        """At ``at`` the engine was paused, asleep or busy, or a request whose KV arrived
        waited for a batch slot or was preempted: every waiting leg's clock restarts from
        there."""
        self._held_at = max(self._held_at, at)

    def queued(self, at: float) -> None:
        """At ``at`` requests waited for admission: the clocks of legs not overtaken yet
        restart from there (the leg may be one of them)."""
        self._queued_at = max(self._queued_at, at)

    def first_token(self, arrived: float, now: float) -> None:
        """A request that reached the engine at ``arrived`` got its first token at ``now``:
        every leg that arrived ``overtake_margin_s`` or more before it and still waits is
        overtaken."""
        before = arrived - self.overtake_margin_s
        for request_id, since in self._since.items():
            if since <= before and request_id not in self._overtaken:
                self._overtaken[request_id] = now

    def overdue(self, now: float) -> list[str]:
        """Legs whose clock has run ``timeout_s`` or more, oldest first; they stay watched
        until :meth:`done`."""
        late = []
        for request_id, since in self._since.items():
            queued_at = self._queued_at
            overtaken = self._overtaken.get(request_id)
            if overtaken is not None:  # admission after that no longer explains the wait
                queued_at = min(queued_at, overtaken)
            if now - max(since, self._held_at, queued_at) >= self.timeout_s:
                late.append((since, request_id))
        return [request_id for _, request_id in sorted(late)]
