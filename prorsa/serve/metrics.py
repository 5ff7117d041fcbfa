"""Prometheus metrics of a rollout service (``GET /metrics``).

Counters and histograms are updated as turns and weight syncs finish; gauges (engines per
role, queues, sessions, weight version, KV use, the controller's latest forecast) are read
from the service when Prometheus scrapes, so they cost nothing between scrapes. Every
metric lives in the service's own registry (several services may share a process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from prorsa.serve.service import RolloutService, ServeTurnResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)


class ServiceMetrics:
    """The service's metrics; call :meth:`render` for the exposition text."""

    def __init__(self, service: RolloutService) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "prorsa_http_requests", "HTTP requests by route and status.", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.turns = Counter("prorsa_turns", "Turns served, by path.", ["path"], registry=r)
        self.prompt_tokens = Counter("prorsa_prompt_tokens", "Prompt tokens served.", registry=r)
        self.generation_tokens = Counter(
            "prorsa_generation_tokens", "Tokens generated.", registry=r
        )
        self.ttft = Histogram(
            "prorsa_time_to_first_token_seconds", "Time to first token per turn.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "prorsa_time_per_output_token_seconds", "Decode time per output token per turn.",
            buckets=_TPOT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.turn_latency = Histogram(
            "prorsa_turn_latency_seconds", "Router time per turn (queue to last token).",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.weight_syncs = Counter("prorsa_weight_syncs", "Weight updates done.", registry=r)
        self.weight_sync_seconds = Histogram(
            "prorsa_weight_sync_seconds", "Serving pause per weight update.",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        r.register(_StateCollector(service))

    def observe_turn(self, result: ServeTurnResult) -> None:
        self.turns.labels(result.path).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(len(result.output_token_ids))
        self.turn_latency.observe(result.latency_s)
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
        if result.tpot_s is not None:
            self.tpot.observe(result.tpot_s)

    def observe_sync(self, summary: dict[str, Any]) -> None:
        self.weight_syncs.inc()
        self.weight_sync_seconds.observe(summary.get("total_s", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges read from the service at scrape time."""

    def __init__(self, service: RolloutService) -> None:
        self.service = service

    def describe(self) -> list:  # no eager collection at registration
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        svc = self.service
        if svc.router is None:
            return
        status = svc.status()
        yield _gauge("prorsa_weight_version", "Weight version served.", status["weight_version"])
        yield _gauge("prorsa_sessions", "Live sessions (trajectories).", status["sessions"])
        yield _gauge("prorsa_turns_in_flight", "Turns admitted and running.", status["in_flight"])
        yield _gauge("prorsa_turns_waiting", "Turns waiting at the closed gate.", status["waiting"])
        yield _gauge(
            "prorsa_legs_held", "Legs held back during a weight update.", status["held_legs"]
        )
        yield _gauge("prorsa_paused", "1 while paused by the trainer.", int(status["paused"]))
        yield _gauge("prorsa_sleeping", "1 while the engines sleep.", int(status["sleeping"]))
        yield _gauge("prorsa_role_switches", "Role switches completed.", svc.switches_done)
        router = svc.router
        for name, doc, value in (
            ("prorsa_turn_retries", "Turns served again after an engine failed.",
             router.retries_total),
            ("prorsa_turn_reroutes", "Turns served again after a leg was aborted.",
             router.reroutes_total),
            ("prorsa_kv_handoffs_lost",
             "Decode legs that gave up waiting for their prefill engine's KV.",
             router.kv_handoffs_lost_total),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
        engines = GaugeMetricFamily("prorsa_engines", "Engines per role.", labels=["role"])
        for role, count in status["engines_per_role"].items():
            engines.add_metric([role], count)
        yield engines
        states = GaugeMetricFamily(
            "prorsa_trajectories", "Live trajectories per lifecycle state.", labels=["state"]
        )
        for state, count in status["trajectory_states"].items():
            states.add_metric([state], count)
        yield states
        yield from self._engine_gauges()
        yield from self._forecast()

    def _engine_gauges(self) -> Iterator[GaugeMetricFamily]:
        svc = self.service
        legs = GaugeMetricFamily(
            "prorsa_engine_running_legs", "Legs running per engine.", labels=["engine", "role"]
        )
        kv = GaugeMetricFamily(
            "prorsa_engine_kv_used_tokens",
            "KV tokens in use per engine.",
            labels=["engine", "role"],
        )
        for engine in svc.router.pools.engines():
            if not engine.alive:
                continue
            labels = [str(engine.engine_id), engine.role.value]
            legs.add_metric(labels, len(engine.leases))
            if svc.monitor is not None:
                kv.add_metric(labels, svc.monitor.reading(engine).used_tokens)
        yield legs
        yield kv

    def _forecast(self) -> Iterator[GaugeMetricFamily]:
        forecast = self.service.latest_forecast()
        if forecast is None:
            return
        family = GaugeMetricFamily(
            "prorsa_forecast", "Latest demand forecast per target and horizon.",
            labels=["target", "horizon_s"],
        )  # fmt: skip
        for target, values in forecast.point.items():
            for horizon, value in zip(forecast.horizons_s, values, strict=False):
                family.add_metric([target, f"{horizon:g}"], float(value))
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
