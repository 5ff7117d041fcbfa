"""prorsa inside RL trainers: a long-lived rollout service and its HTTP server.

:class:`RolloutService` (engines + router + controller + telemetry, with weight updates
across prefill and decode roles) is usable in process, as a Ray actor
(:func:`rollout_service_actor`) or over HTTP (``prorsa serve``; :func:`create_app`).
Heavy packages (Ray, vLLM, FastAPI) load when a service starts, not on import.
"""

from __future__ import annotations

from prorsa.serve.config import ServeConfig
from prorsa.serve.sampling import Sampling, parse_sampling

__all__ = [
    "RolloutService",
    "Sampling",
    "ServeConfig",
    "ServeTurnResult",
    "create_app",
    "parse_sampling",
    "rollout_service_actor",
]


def __getattr__(name: str) -> object:
    if name in ("RolloutService", "ServeTurnResult"):
        from prorsa.serve import service

        return getattr(service, name)
    if name == "create_app":
        from prorsa.serve.app import create_app

        return create_app
    if name == "rollout_service_actor":
        from prorsa.serve.actor import rollout_service_actor

        return rollout_service_actor
    raise AttributeError(name)
