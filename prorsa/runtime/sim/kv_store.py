"""A host-DRAM KV store (Mooncake Store / LMCache style): earlier context a prefill engine
can read instead of recomputing it.

Stock vLLM with NIXL moves KV only from prefill to decode; a prefill engine reuses only what
its own prefix cache holds. Deployments add a KV store in host memory: decode engines write
each finished turn's context into it, and a prefill engine reads the part of a trajectory's
context it lacks at the host link's bandwidth. This is that component, on only when
configured (``ClusterConfig.reuse_mode = "kv-store"``).

* ``scope="node"``: one pool per node of :data:`NODE_GPUS` GPUs, readable by that node's
  engines only (LMCache's local CPU backend). ``scope="cluster"``: one pool shared by all
  nodes (Mooncake Store over RDMA).
* Capacity in tokens, least recently used first out; what a read finds is what is left.
* Writes are asynchronous offloads and are not charged time (they overlap decoding).
"""

from __future__ import annotations

from prorsa.runtime.sim.prefix_cache import PrefixCache

#: GPUs per node (HGX H200: 8).
NODE_GPUS = 8


class KvStore:
    """Host-DRAM KV pools of the cluster, by node (or one for the cluster)."""

    __slots__ = ("capacity_tokens", "hit_tokens", "lookup_tokens", "pools", "scope")

    def __init__(self, capacity_tokens: int, scope: str = "node") -> None:
        self.capacity_tokens = capacity_tokens  # per pool
        self.scope = scope
        self.pools: dict[int, PrefixCache] = {}
        self.lookup_tokens = 0  # context tokens prefill engines asked the store for
        self.hit_tokens = 0  # tokens the store served

    def pool_of(self, gpu: int) -> int:
        """The pool an engine whose first GPU is ``gpu`` reads and writes."""
        return 0 if self.scope == "cluster" else gpu // NODE_GPUS

    def write(self, gpu: int, key: str, tokens: int) -> None:
        """An engine offloads ``tokens`` of a trajectory's context (replacing older ones)."""
        pool = self.pools.get(self.pool_of(gpu))
        if pool is None:
            pool = self.pools[self.pool_of(gpu)] = PrefixCache()
        pool.put(key, tokens)
        if pool.total > self.capacity_tokens:
            pool.evict_until(pool.total - self.capacity_tokens, 0)

    def lookup(self, gpu: int, key: str, wanted: int) -> int:
        """Tokens of a ``wanted``-token prefix an engine on ``gpu`` can read (counted)."""
        pool = self.pools.get(self.pool_of(gpu))
        found = min(pool.peek(key), wanted) if pool is not None else 0
        self.lookup_tokens += wanted
        self.hit_tokens += found
        return found

    def drop(self, key: str) -> None:
        """A trajectory ended: its context is of no further use."""
        for pool in self.pools.values():
            pool.take(key)

    @property
    def hit_rate(self) -> float | None:
        """Share of looked-up context tokens the store served (None before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else None
