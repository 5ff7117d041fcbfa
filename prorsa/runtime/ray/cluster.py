"""Start and stop a fleet of engine actors in one placement group.

Each engine gets one bundle: ``{"CPU": cpus_per_engine}`` on CPU, plus
``{"GPU": tensor_parallel_size}`` when GPUs are used. Engines start in parallel; the fleet
knows every actor's process ids so a test can prove that nothing outlives ``shutdown``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prorsa.errors import ConfigError, ProrsaError
from prorsa.runtime.ray.client import RayEngineClient
from prorsa.runtime.ray.config import EngineConfig
from prorsa.runtime.ray.engine import engine_actor_class, side_channel_ports
from prorsa.runtime.ray.pools import Role, RolePools, parse_role

logger = logging.getLogger(__name__)


@dataclass
class FleetSpec:
    """Which engines to start and how to place them."""

    engine: EngineConfig = field(metadata={"help": "Configuration shared by every engine."})
    roles: Sequence[str | Role] = field(
        default=("prefill", "decode"), metadata={"help": "Initial role of each engine, in order."}
    )
    cpus_per_engine: float = field(default=1, metadata={"help": "CPU bundle per engine."})
    gpus_per_engine: float | None = field(
        default=None,
        metadata={"help": "GPUs per engine; None means tensor_parallel_size if GPUs exist."},
    )
    overrides: Mapping[int, Mapping[str, Any]] = field(
        default_factory=dict,
        metadata={"help": "Per-engine EngineConfig fields that differ, by engine index."},
    )
    placement_strategy: str = field(
        default="PACK", metadata={"help": "Ray placement strategy (PACK, SPREAD, ...)."}
    )
    start_timeout_s: float = field(default=600, metadata={"help": "Longest engine start."})


class EngineFleet:
    """Running engine actors plus their placement group.

    Use :meth:`start` to build one; :meth:`pools` gives the router's view of it.
    """

    def __init__(self, spec: FleetSpec, actors: dict[int, Any], placement_group: Any) -> None:
        self.spec = spec
        self.actors = actors
        self.placement_group = placement_group
        self.clients = {eid: RayEngineClient(eid, actor) for eid, actor in actors.items()}
        self.health: dict[int, dict[str, Any]] = {}
        self.roles: dict[int, Role] = {}
        self.start_s: float | None = None

    @classmethod
    def start(cls, spec: FleetSpec) -> EngineFleet:
        """Place and start every engine; blocks until all are ready.

        Raises:
            ConfigError: bad roles or configuration.
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        roles = [parse_role(r) for r in spec.roles]
        if not roles:
            raise ConfigError("a fleet needs at least one engine")
        unknown = set(spec.overrides) - set(range(len(roles)))
        if unknown:
            raise ConfigError(f"overrides name engines {sorted(unknown)} outside the fleet")
        try:
            configs = [replace(spec.engine, **spec.overrides.get(i, {})) for i in range(len(roles))]
        except TypeError as exc:
            raise ConfigError(f"bad engine override: {exc}") from None
        for config in configs:
            config.validate()
        configs = _with_side_channel_ports(configs)
        if not ray.is_initialized():
            raise ConfigError("Ray is not initialised", hint="call ray.init() first")
        gpus = spec.gpus_per_engine
        if gpus is None:
            has_gpu = ray.cluster_resources().get("GPU", 0) > 0
            gpus = spec.engine.tensor_parallel_size if has_gpu else 0
        bundle: dict[str, float] = {"CPU": spec.cpus_per_engine}
        if gpus:
            bundle["GPU"] = gpus
        available = ray.cluster_resources()
        for resource, amount in bundle.items():
            if amount * len(roles) > available.get(resource, 0) + 1e-9:
                raise ConfigError(
                    f"{len(roles)} engines need {amount * len(roles):g} {resource}; the Ray "
                    f"cluster has {available.get(resource, 0):g}",
                    hint="start Ray with more logical CPUs (ray.init(num_cpus=N)) or lower "
                    "FleetSpec.cpus_per_engine / gpus_per_engine",
                )
        started = time.perf_counter()
        group = placement_group([dict(bundle) for _ in roles], strategy=spec.placement_strategy)
        try:
            ray.get(group.ready(), timeout=spec.start_timeout_s)
        except Exception:
            remove_placement_group(group)
            raise
        actor_cls = engine_actor_class(num_cpus=spec.cpus_per_engine, num_gpus=gpus)
        actors = {
            i: actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i
                ),
            ).remote(i, configs[i])
            for i in range(len(roles))
        }
        fleet = cls(spec, actors, group)
        try:
            healths = ray.get(
                [a.start.remote() for a in actors.values()], timeout=spec.start_timeout_s
            )
        except BaseException as exc:
            fleet.shutdown()
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ProrsaError):
                raise cause from None
            raise
        fleet.health = {h["engine_id"]: h for h in healths}
        fleet.roles = dict(enumerate(roles))
        fleet.start_s = time.perf_counter() - started
        logger.info("%d engines ready in %.1f s", len(actors), fleet.start_s)
        return fleet

    def pools(self) -> RolePools:
        """Fresh :class:`RolePools` over this fleet with its initial roles and limits."""
        keys = ("max_model_len", "vocab_size", "kv_capacity_tokens")
        limits = {eid: {k: h.get(k) for k in keys} for eid, h in self.health.items()}
        return RolePools(self.clients.values(), self.roles, limits)

    def pids(self) -> list[int]:
        """Process ids of every actor and its children (EngineCore, workers) at start."""
        out: list[int] = []
        for h in self.health.values():
            out.append(h["pid"])
            out.extend(h.get("child_pids", []))
        return out

    def kill(self, engine_id: int) -> None:
        """Kill one engine actor abruptly (failure injection); Ray reaps its children."""
        import ray

        ray.kill(self.actors[engine_id], no_restart=True)

    def shutdown(self, timeout_s: float = 60) -> None:
        """Stop every engine cleanly, then kill the actors and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        refs = [a.shutdown.remote() for a in self.actors.values()]
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # dead actors cannot shut down; kill below anyway
                logger.debug("engine shutdown: %s", exc)
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                logger.debug("kill: %s", exc)
        self.actors = {}
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception as exc:
                logger.debug("remove placement group: %s", exc)
            self.placement_group = None


def _with_side_channel_ports(configs: list[EngineConfig]) -> list[EngineConfig]:
    """``configs`` with a distinct NIXL side-channel port for every NIXL engine that has
    none (chosen here, together, so two engines of the fleet never draw the same one)."""
    need = [
        i
        for i, c in enumerate(configs)
        if c.resolved_connector() == "nixl" and c.side_channel_port is None
    ]
    if not need:
        return configs
    out = list(configs)
    hosts = {configs[i].side_channel_host for i in need}
    for host in hosts:
        mine = [i for i in need if configs[i].side_channel_host == host]
        for i, port in zip(mine, side_channel_ports(len(mine), host), strict=True):
            out[i] = replace(configs[i], side_channel_port=port)
    return out
