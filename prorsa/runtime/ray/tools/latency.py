"""A tool whose latency is the scenario's: it waits the sampled tool time, time-scaled.

It stands for what the other tools cannot run here (test suites, remote APIs, browsers):
its work is the wait. The agent loop passes the spec's latency times the run's time
scale, and both numbers go into the telemetry's ``detail``.
"""

from __future__ import annotations

import asyncio
import time

from prorsa.runtime.ray.tools.base import ToolResult


class LatencyTool:
    """Sleep ``args["seconds"]`` and report it like a finished remote job."""

    name = "latency"

    async def call(self, args: dict[str, object]) -> ToolResult:
        seconds = max(0.0, float(args.get("seconds", 0.0)))  # type: ignore[arg-type]
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        job = args.get("job", "job")
        return ToolResult(
            f"{job} finished with exit code 0 after {seconds:.3f} s",
            exec_s=time.perf_counter() - started,
        )
