"""Workload knobs of the regime map: scale tool latency and per-turn context growth.

Both act on the trajectory specs before a run, so every policy of a regime sees exactly
the same transformed workload (and the oracle's ground truth is the transformed one):

* ``tool_scale`` multiplies every tool call's latency (``0.25``: tools four times
  faster; ``4``: slower sandboxes, longer tests);
* ``growth_scale`` multiplies the tokens a turn appends to the context after the first
  (tool observations, new messages); the first prompt is kept. With prefix caching a
  turn computes only what it appends, so this moves the cache-hit rate: larger growth,
  more prefill per turn, fewer cached tokens in the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prorsa.errors import ConfigError
from prorsa.workload.spec import TrajectorySpec


@dataclass(frozen=True)
class WorkloadKnobs:
    """How a regime transforms its workload (1.0: unchanged)."""

    tool_scale: float = 1.0
    growth_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("tool_scale", "growth_scale"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def identity(self) -> bool:
        return self.tool_scale == 1.0 and self.growth_scale == 1.0

    def apply(self, spec: TrajectorySpec) -> TrajectorySpec:
        """``spec`` with its tool latencies and appended tokens scaled."""
        if self.identity:
            return spec
        new = np.asarray(spec.new_tokens, dtype=np.int64).copy()
        if len(new) > 1:
            new[1:] = np.rint(new[1:] * self.growth_scale).astype(np.int64)
        return TrajectorySpec(
            trajectory_id=spec.trajectory_id,
            new_tokens=new,
            output_tokens=spec.output_tokens,
            tool_latency_s=np.asarray(spec.tool_latency_s) * self.tool_scale,
            group_id=spec.group_id,
            task=spec.task,
            shared_prompt_tokens=spec.shared_prompt_tokens,
            meta=spec.meta,
        )


def transformed_driver(work, knobs: WorkloadKnobs):
    """The driver ``prorsa.runtime.sim.scenario.build_driver`` builds for ``work``, with
    every spec passed through ``knobs`` (sync batches and async streams alike)."""
    from prorsa.runtime.sim.drivers import AsyncDriver, SyncDriver
    from prorsa.runtime.sim.scenario import build_driver

    driver = build_driver(work)
    if knobs.identity:
        return driver
    if isinstance(driver, SyncDriver):
        driver.batches = [[knobs.apply(s) for s in batch] for batch in driver.batches]
    elif isinstance(driver, AsyncDriver):
        driver.specs = (knobs.apply(s) for s in driver.specs)
    else:  # pragma: no cover - build_driver returns one of the two
        raise ConfigError(f"cannot transform the specs of a {type(driver).__name__}")
    return driver


def simulate_with_knobs(request, knobs: WorkloadKnobs, *, keep_forecasts: bool = False):
    """``prorsa.runtime.sim.scenario.simulate`` on the workload transformed by ``knobs``."""
    from prorsa.runtime.sim.scenario import simulate

    request.validate()  # before the driver is built from it
    driver = None if knobs.identity else transformed_driver(request.work, knobs)
    return simulate(request, keep_forecasts=keep_forecasts, driver=driver)
