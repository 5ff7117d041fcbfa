"""Decode legs waiting for a remote prefill's KV, and which of them wait for ever.

A decode leg presents the ``kv_transfer_params`` of its prefill leg; vLLM admits it, starts
loading the KV from the prefill engine and parks it (``WAITING_FOR_REMOTE_KVS``) until the
load ends. A peer that died fails the load (vLLM then recomputes the prompt, see
:func:`prorsa.runtime.ray.config.kv_transfer_config`), but a transfer that never completes
(a hung peer, a stalled link) parks the leg for ever: vLLM has no deadline on it, and the
engine keeps stepping its other requests, so the load monitor's stall watch does not see it.

A leg's wait is only suspicious once nothing else can explain it. Its clock restarts
whenever the engine was paused, asleep or busy with a control call, and, until the leg is
*overtaken*, whenever any request on the engine waited for something other than a KV load
in progress (admission, or a batch slot once its KV arrived:
:func:`prorsa.runtime.ray.load.waits_for_more_than_kv`). vLLM reports those waits as
counts, not per request, so on their own they cannot tell the hung leg from a queue. The
order of first tokens can: vLLM admits waiting requests first come, first served, skipping
only those whose KV is still loading (and stopping at one it cannot allocate), so once a
request that reached the engine after the leg has its first token while the leg has none,
the leg is waiting for its KV and nothing else; from then on a queue no longer restarts
its clock. After ``timeout_s`` on a clock that ran uninterrupted the leg is overdue. On an
engine that always has something queued, a hung leg is thus given up ``timeout_s`` after
the first later request overtook it, not only once the queue empties.
"""

from __future__ import annotations


class KVWaitWatch:
    """Clocks of the decode legs on one engine that wait for remote KV.

    Args:
        timeout_s: a leg is overdue after this many seconds of unexplained waiting.
    """

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
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
        """At ``at`` the engine was paused, asleep or busy: every waiting leg's clock
        restarts from there."""
        self._held_at = max(self._held_at, at)

    def queued(self, at: float) -> None:
        """At ``at`` requests waited for admission or a batch slot: the clocks of legs not
        overtaken yet restart from there (the leg may be one of them)."""
        self._queued_at = max(self._queued_at, at)

    def first_token(self, arrived: float, now: float) -> None:
        """A request that reached the engine at ``arrived`` got its first token at ``now``:
        every leg that arrived before it and still waits is overtaken."""
        for request_id, since in self._since.items():
            if since < arrived and request_id not in self._overtaken:
                self._overtaken[request_id] = now

    def overdue(self, now: float) -> list[str]:
        """Legs whose clock has run ``timeout_s`` or more, oldest first; they stay watched
        until :meth:`done`."""
        late = []
        for request_id, since in self._since.items():
            queued_at = self._queued_at
            overtaken = self._overtaken.get(request_id)
            if overtaken is not None:  # a queue after that no longer explains the wait
                queued_at = min(queued_at, overtaken)
            if now - max(since, self._held_at, queued_at) >= self.timeout_s:
                late.append((since, request_id))
        return [request_id for _, request_id in sorted(late)]
