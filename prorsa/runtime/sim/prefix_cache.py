"""Token-granular LRU prefix cache of one engine.

Entries are keyed by trajectory (its context so far) or by GRPO group (the shared
prompt). A pinned entry leaves the cache while a request uses its blocks, as vLLM keeps
referenced blocks out of the free (evictable) list.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """Evictable cached prefixes: key -> tokens, least recently used first."""

    __slots__ = ("entries", "evicted_tokens", "total")

    def __init__(self) -> None:
        #: key -> tokens, least recently used first (hot paths read it directly: a
        #: ``peek`` is ``entries.get(key, 0)``)
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.total = 0
        self.evicted_tokens = 0

    def peek(self, key: str) -> int:
        """Cached tokens under ``key`` without touching recency."""
        return self.entries.get(key, 0)

    def take(self, key: str) -> int:
        """Remove and return ``key``'s tokens (they become in-use, not evictable)."""
        tokens = self.entries.pop(key, 0)
        self.total -= tokens
        return tokens

    def put(self, key: str, tokens: int) -> None:
        """Insert or refresh ``key`` as most recently used with ``tokens`` (max of old/new)."""
        old = self.entries.pop(key, 0)
        if old > tokens:
            tokens = old
        self.entries[key] = tokens
        self.total += tokens - old

    def evict_until(self, free_needed: int, free_now: int) -> int:
        """Evict LRU entries until ``free_now`` (+ evicted) covers ``free_needed``."""
        entries = self.entries
        while free_now < free_needed and entries:
            _, tokens = entries.popitem(last=False)
            self.total -= tokens
            self.evicted_tokens += tokens
            free_now += tokens
        return free_now

    def clear(self) -> None:
        self.evicted_tokens += self.total
        self.entries.clear()
        self.total = 0

    def __len__(self) -> int:
        return len(self.entries)
