"""KV transfer links of the simulated cluster: one outgoing link per engine, FIFO.

A transfer of ``tokens`` takes ``transfer_base_s + tokens * kv_bytes_per_token /
bandwidth``; with contention on, transfers out of one engine queue behind each other.
"""

from __future__ import annotations

from prorsa.runtime.cluster.config import ClusterConfig


class KvLinks:
    """When each engine's link is free, and how long a copy takes.

    Engine-to-engine links by default; ``bandwidth_gbytes_per_s`` overrides the
    configured bandwidth (the host-DRAM KV store's links into each engine).
    """

    __slots__ = ("_free_at", "base_s", "bytes_per_s", "config")

    def __init__(self, config: ClusterConfig, bandwidth_gbytes_per_s: float | None = None) -> None:
        self.config = config
        self.base_s = config.transfer_base_s
        self.bytes_per_s = (bandwidth_gbytes_per_s or config.transfer_bandwidth_gbytes_per_s) * 1e9
        self._free_at: dict[int, float] = {}

    def transfer_s(self, tokens: int, kv_bytes_per_token: float) -> float:
        """Seconds to copy ``tokens`` of KV of ``kv_bytes_per_token`` bytes each."""
        return self.base_s + tokens * kv_bytes_per_token / self.bytes_per_s

    def book(
        self, source_id: int, tokens: int, kv_bytes_per_token: float, now_s: float
    ) -> tuple[float, float]:
        """Book a copy of ``tokens`` out of engine ``source_id``; returns (start, end) times."""
        seconds = self.transfer_s(tokens, kv_bytes_per_token)
        start = now_s
        if self.config.link_contention:
            start = max(now_s, self._free_at.get(source_id, 0.0))
            self._free_at[source_id] = start + seconds
        return start, start + seconds
