"""Token-granular LRU prefix cache of one engine.

Entries are keyed by trajectory (its context so far) or by GRPO group (the shared
prompt). A pinned entry leaves the cache while a request uses its blocks, as vLLM keeps
referenced blocks out of the free (evictable) list. A finished trajectory's entry stays
until evicted, as in an engine, but is *retired*: it still takes space, and no turn
will read it again. A group's shared prompt is retired from the start: its members'
own entries hold it too, and count it.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """Evictable cached prefixes: key -> tokens, least recently used first."""

    __slots__ = ("entries", "evicted_tokens", "retired", "retired_tokens", "total")

    def __init__(self) -> None:
        #: key -> tokens, least recently used first (hot paths read it directly: a
        #: ``peek`` is ``entries.get(key, 0)``)
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.total = 0
        self.evicted_tokens = 0
        #: keys not counted as live (finished trajectories', groups' shared prompts) and
        #: their tokens (in ``total``)
        self.retired: set[str] = set()
        self.retired_tokens = 0

    @property
    def live_tokens(self) -> int:
        """Cached tokens a later turn may still read (``total`` less the retired)."""
        return self.total - self.retired_tokens

    def retire(self, key: str) -> None:
        """Stop counting ``key``'s entry as live (its trajectory finished, or it is a
        group's shared prompt); a later ``put`` or ``take`` of it counts it again."""
        tokens = self.entries.get(key, 0)
        if tokens and key not in self.retired:
            self.retired.add(key)
            self.retired_tokens += tokens

    def _unretire(self, key: str) -> None:
        """Retired ``key`` leaves the cache or is used again (a trajectory id run anew)."""
        self.retired.discard(key)
        self.retired_tokens -= self.entries.get(key, 0)

    def peek(self, key: str) -> int:
        """Cached tokens under ``key`` without touching recency."""
        return self.entries.get(key, 0)

    def take(self, key: str) -> int:
        """Remove and return ``key``'s tokens (they become in-use, not evictable)."""
        if key in self.retired:
            self._unretire(key)
        tokens = self.entries.pop(key, 0)
        self.total -= tokens
        return tokens

    def put(self, key: str, tokens: int) -> None:
        """Insert or refresh ``key`` as most recently used with ``tokens`` (max of old/new)."""
        if key in self.retired:
            self._unretire(key)
        old = self.entries.pop(key, 0)
        if old > tokens:
            tokens = old
        self.entries[key] = tokens
        self.total += tokens - old

    def evict_until(self, free_needed: int, free_now: int) -> int:
        """Evict LRU entries until ``free_now`` (+ evicted) covers ``free_needed``."""
        entries = self.entries
        while free_now < free_needed and entries:
            key, tokens = entries.popitem(last=False)
            if key in self.retired:
                self.retired.discard(key)
                self.retired_tokens -= tokens
            self.total -= tokens
            self.evicted_tokens += tokens
            free_now += tokens
        return free_now

    def clear(self) -> None:
        self.evicted_tokens += self.total
        self.entries.clear()
        self.total = 0
        self.retired.clear()
        self.retired_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)
