"""What the router takes and returns: its configuration, turn requests and results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from prorsa.errors import ConfigError

Mode = Literal["auto", "disaggregated", "colocated"]
MODES: tuple[str, ...] = ("auto", "disaggregated", "colocated")


class RoutingError(RuntimeError):
    """A turn could not be served: no engine for its role, or retries exhausted."""


class NoEngineAvailable(RuntimeError):
    """No live engine could take a control call (a weight update, a pause): the service
    cannot act now (HTTP 503)."""


class Rerouted(Exception):
    """A leg was aborted (a role switch evicted it); serve the turn again elsewhere."""


class LegFailed(Rerouted):
    """vLLM ended a leg with finish reason ``error``; the turn is served once more."""


class KVHandoffLost(Rerouted):
    """A decode leg gave up waiting for its prefill engine's KV; serve the turn again,
    prefilled on that decode engine (``engine_id``) if it still decodes."""

    def __init__(self, message: str, engine_id: int) -> None:
        super().__init__(message)
        self.engine_id = engine_id


@dataclass
class RouterConfig:
    """Router behaviour. ``help`` metadata doubles as CLI help text."""

    local_prefill_threshold_tokens: int = field(
        default=0,
        metadata={"help": "Prefill on the decode engine when a turn has fewer new tokens."},
    )
    max_retries: int = field(
        default=3, metadata={"help": "Re-tries per turn after engine failures."}
    )
    max_reroutes: int = field(
        default=8, metadata={"help": "Re-routes per turn after role-switch evictions."}
    )
    route_timeout_s: float = field(
        default=120.0, metadata={"help": "Longest wait for an engine of the needed role."}
    )
    drain_timeout_s: float = field(
        default=30.0, metadata={"help": "Default drain time of a role switch before aborting."}
    )
    abort_grace_s: float = field(
        default=10.0, metadata={"help": "Wait for aborted legs to leave a switching engine."}
    )
    control_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "Longest wait for an engine to answer a switch's abort, pause, cache "
            "reset or resume; one that does not is taken out of service."
        },
    )
    unreachable_backoff_s: float = field(
        default=2.0,
        metadata={
            "help": "Seconds an engine Ray could not reach (not dead) gets no new work; "
            "the turn that met it is served elsewhere."
        },
    )
    reset_prefix_cache_on_switch: bool = field(
        default=True, metadata={"help": "Drop an engine's prefix cache when its role changes."}
    )

    def validate(self) -> None:
        if self.local_prefill_threshold_tokens < 0:
            raise ConfigError("local_prefill_threshold_tokens must be >= 0")
        if self.max_retries < 0 or self.max_reroutes < 0:
            raise ConfigError("max_retries and max_reroutes must be >= 0")
        if (
            min(
                self.route_timeout_s,
                self.drain_timeout_s,
                self.abort_grace_s,
                self.unreachable_backoff_s,
            )
            < 0
        ):
            raise ConfigError("timeouts must be >= 0")
        if self.control_timeout_s <= 0:
            raise ConfigError("control_timeout_s must be > 0")


@dataclass
class TurnRequest:
    """One turn of one trajectory: the full context in, new tokens out."""

    trajectory_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    turn: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    group_id: str = ""
    task: str = ""
    mode: Mode = "auto"
    engine_id: int | None = None  # pin: the colocated engine, or the decode engine
    prefill_engine_id: int | None = None  # pin the prefill engine of a disaggregated turn
    #: Hashes of prompt prefixes by length, computed once per turn: the router compares
    #: each candidate engine's cached context with the prompt, and at 128k tokens one
    #: hash costs about a millisecond.
    _prefix_hashes: dict[int, int] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def prefix_hash(self, tokens: int) -> int:
        """Hash of the prompt's first ``tokens`` tokens (memoised)."""
        known = self._prefix_hashes.get(tokens)
        if known is None:
            known = self._prefix_hashes[tokens] = hash(tuple(self.prompt_token_ids[:tokens]))
        return known

    def sampling(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.top_p != 1.0:
            out["top_p"] = self.top_p
        if self.seed is not None:
            out["seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


@dataclass
class TurnResult:
    """What a turn produced and where it ran."""

    trajectory_id: str
    turn: int
    output_token_ids: list[int]
    finish_reason: str | None
    path: str  # disaggregated | local_prefill | colocated
    decode_engine_id: int
    prefill_engine_id: int = -1
    prefill_cached_tokens: int = 0
    num_cached_tokens: int = 0
    retries: int = 0
    reroutes: int = 0
    latency_s: float = 0.0
    legs: dict[str, dict[str, Any]] = field(default_factory=dict)
