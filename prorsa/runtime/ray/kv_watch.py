"""Decode legs waiting for a remote prefill's KV, and which of them wait for ever.

A decode leg presents the ``kv_transfer_params`` of its prefill leg; vLLM admits it, starts
loading the KV from the prefill engine and parks it (``WAITING_FOR_REMOTE_KVS``) until the
load ends. A peer that died fails the load (vLLM then recomputes the prompt, see
:func:`prorsa.runtime.ray.config.kv_transfer_config`), but a transfer that never completes
(a hung peer, a stalled link) parks the leg for ever: vLLM has no deadline on it, and the
engine keeps stepping its other requests, so the load monitor's stall watch does not see it.

A leg's wait is only suspicious once nothing else can explain it. Its clock therefore
restarts whenever any request on the engine waited for something other than a KV load in
progress (admission, or a batch slot once its KV arrived:
:func:`prorsa.runtime.ray.load.waits_for_more_than_kv`), and whenever the engine was
paused, asleep or busy with a control call. vLLM reports these as counts, not per
request, so the rule is conservative: after ``timeout_s`` on a clock that ran
uninterrupted, every remote-KV request on the engine had been loading all that while.
The price is late detection on an engine that always has something queued: a hung leg
there is given up once its queue empties (at the latest at the end of a sync step).
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
        self._since: dict[str, float] = {}  # request id -> when its clock (re)started
        self._held_at = float("-inf")  # last time the engine's state explained a wait

    def __len__(self) -> int:
        return len(self._since)

    def add(self, request_id: str, now: float) -> None:
        """A decode leg with remote KV reached the engine at ``now``."""
        self._since[request_id] = now

    def done(self, request_id: str) -> None:
        """The leg has its first token, ended, or was given up (unknown ids are ignored)."""
        self._since.pop(request_id, None)

    def hold(self, at: float) -> None:
        """At ``at`` the engine queued requests for admission, was paused, asleep or busy:
        every waiting leg's clock restarts from there."""
        self._held_at = max(self._held_at, at)

    def overdue(self, now: float) -> list[str]:
        """Legs whose clock has run ``timeout_s`` or more, oldest first; they stay watched
        until :meth:`done`."""
        late = [
            (since, rid)
            for rid, since in self._since.items()
            if now - max(since, self._held_at) >= self.timeout_s
        ]
        return [rid for _, rid in sorted(late)]
