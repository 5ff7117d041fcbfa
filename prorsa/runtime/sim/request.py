"""Per-trajectory and per-turn state inside the simulator (plain slotted objects: hot path)."""

from __future__ import annotations

from prorsa.workload.spec import TrajectorySpec


class TrajState:
    """A live trajectory: its spec, where it is, and which engines hold its KV.

    The spec's per-turn arrays are copied to lists once: indexing a numpy array returns a
    numpy scalar, several times slower than a list item on the per-turn path.
    """

    __slots__ = (
        "cached_on",
        "decode_engine",
        "done_turns",
        "group_key",
        "key",
        "new_tokens",
        "num_turns",
        "output_tokens",
        "prefill_engine",
        "prev_context",
        "prev_output",
        "spec",
        "start_s",
        "state",
        "tokens",
        "tool_latency_s",
        "traj_key",
        "turn",
    )

    def __init__(self, spec: TrajectorySpec, start_s: float, key: int) -> None:
        self.spec = spec
        self.key = key  # the trajectory's telemetry key (ClusterTelemetry.key)
        self.traj_key = "t:" + spec.trajectory_id  # prefix-cache entry of its context
        self.group_key = "g:" + spec.group_id if spec.group_id and spec.shared_prompt_tokens else ""
        self.new_tokens: list[int] = spec.new_tokens.tolist()
        self.output_tokens: list[int] = spec.output_tokens.tolist()
        self.tool_latency_s: list[float] = spec.tool_latency_s.tolist()
        self.num_turns = len(self.new_tokens)
        self.turn = 0
        self.done_turns = 0
        self.start_s = start_s
        self.state = "queued"
        self.tokens = 0  # current context tokens (for cluster-state token sums)
        self.decode_engine = None  # SimEngine owning the full context (sticky)
        self.prefill_engine = None  # SimEngine that last prefilled it (prefix cache)
        # Engines whose prefix cache got its context (evicted since or not): told when it
        # finishes, so that they stop counting the entry as live.
        self.cached_on: set = set()
        self.prev_context = 0
        self.prev_output = 0


class SimTurn:
    """One turn of one trajectory as it moves through prefill, transfer and decode."""

    __slots__ = (
        "cached",
        "context",
        "ctx_at_join",
        "decode_engine",
        "decoded",
        "finish_step",
        "first_decode_s",
        "heap_entry",
        "join_step",
        "local",
        "output",
        "prefill_attempts",
        "prefill_engine",
        "prefill_left",
        "prefill_tokens",
        "pulled",
        "queued_s",
        "rank",
        "recompute_tokens",
        "recomputing",
        "retries",
        "traj",
        "turn",
    )

    def __init__(self, traj: TrajState, turn: int, context: int, output: int) -> None:
        self.traj = traj
        self.turn = turn
        self.context = context
        self.output = output
        self.cached = 0
        self.prefill_tokens = 0
        self.prefill_left = 0
        self.decoded = 0
        self.prefill_engine = None
        self.decode_engine = None
        self.local = False
        self.finish_step = 0
        self.join_step = 0
        self.ctx_at_join = 0
        self.queued_s = 0.0
        self.first_decode_s = -1.0
        self.heap_entry: tuple | None = None  # this turn's live entry in its engine's heap
        self.prefill_attempts = 0
        self.pulled = 0  # prefix tokens copied in from the decode engine (pull reuse)
        self.recompute_tokens = 0
        self.recomputing = False
        self.retries = 0
        self.rank = -1  # data-parallel rank on its engine (engines of several ranks)
