"""The one telemetry emitter of the cluster model: keyword events into an :class:`EventLog`.

Both runtimes emit through :class:`ClusterTelemetry`: the simulator with simulated times,
the Ray runtime with wall-clock seconds since the run started. Events land in a columnar
:class:`~prorsa.telemetry.columns.EventLog` (read by online forecasters and turned into the
run's table) and, when a :class:`~prorsa.telemetry.recorder.Recorder` is attached, are
also recorded durably as they happen.

Trajectory events take the trajectory's int key (:meth:`ClusterTelemetry.key`, registered
once) and a kind code (the constants below), so the simulator's hot path never builds
strings per event. The simulator appends its detail-free events through
:attr:`ClusterTelemetry.row`: one C-level call with the event's nine numbers, which is
most of what an event costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prorsa.runtime.cluster.switching import RoleSwitch, switch_detail
from prorsa.telemetry.columns import CLUSTER_KEY, KIND_CODE, EventLog
from prorsa.telemetry.schema import EVENT_KINDS, detail_json

if TYPE_CHECKING:
    from prorsa.telemetry.recorder import Recorder

TRAJ_START = KIND_CODE["traj_start"]
PREFILL_QUEUED = KIND_CODE["prefill_queued"]
PREFILL_START = KIND_CODE["prefill_start"]
PREFILL_END = KIND_CODE["prefill_end"]
KV_TRANSFER_START = KIND_CODE["kv_transfer_start"]
KV_TRANSFER_END = KIND_CODE["kv_transfer_end"]
DECODE_START = KIND_CODE["decode_start"]
DECODE_END = KIND_CODE["decode_end"]
TOOL_START = KIND_CODE["tool_start"]
TOOL_END = KIND_CODE["tool_end"]
TRAJ_END = KIND_CODE["traj_end"]
ROLE_SWITCH_START = KIND_CODE["role_switch_start"]
ROLE_SWITCH_END = KIND_CODE["role_switch_end"]
ALLOCATION = KIND_CODE["allocation"]

#: ``role_switch_*`` kind of each switch event stage.
_SWITCH_EVENT_KIND = {
    "stop_new_work": ROLE_SWITCH_START,
    "drained": ROLE_SWITCH_START,
    "serving": ROLE_SWITCH_END,
}


class ClusterTelemetry:
    """Lifecycle events of one run.

    Args:
        run_id: the events' ``run_id``.
        record: keep events at all (off for the fastest sweeps; the log stays empty).
        recorder: also record each event durably (validated there, so an invalid event
            reaches neither the recorder nor the log).
    """

    def __init__(
        self, run_id: str = "run", *, record: bool = True, recorder: Recorder | None = None
    ) -> None:
        self.run_id = run_id
        self.record = record
        self.recorder = recorder
        self.log = EventLog(run_id)
        self.key = self.log.key
        self._append = self.log.append
        #: ``write(pack(time, key, turn, kind, engine_id, context_tokens, new_tokens,
        #: cached_tokens, output_tokens))`` appends one event without detail (the
        #: simulator's path: two C calls when events go straight to the log).
        self.pack: Callable[..., object]
        self.write: Callable[[object], object]
        # The cheapest correct path is chosen once: without a recorder and with events
        # kept, everything goes straight to the log; with events off, nothing is kept.
        if not record:
            self.turn = _drop_event  # type: ignore[method-assign]
            self.pack, self.write = _as_tuple, _drop_row
        elif recorder is None:
            self.turn = self._append  # type: ignore[method-assign]
            self.pack, self.write = self.log.row_writer()
        else:
            self.pack, self.write = _as_tuple, self._write_through_recorder

    def _write_through_recorder(self, row: tuple) -> None:
        self.turn(*row)

    def turn(
        self,
        at: float,
        key: int,
        turn: int,
        kind: int,
        engine_id: int = -1,
        context_tokens: int = 0,
        new_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        detail: str = "",
    ) -> None:
        """One trajectory-stage event (``kind`` a kind constant, ``key`` from :meth:`key`)."""
        if not self.record:
            return
        if self.recorder is not None:
            traj, group, task = self.log.keys[key]
            self.recorder.append_row(
                (
                    at,
                    self.run_id,
                    traj,
                    group,
                    task,
                    turn,
                    EVENT_KINDS[kind],
                    engine_id,
                    context_tokens,
                    new_tokens,
                    cached_tokens,
                    output_tokens,
                    detail,
                )
            )
        self._append(
            at, key, turn, kind, engine_id, context_tokens, new_tokens, cached_tokens,
            output_tokens, detail,
        )  # fmt: skip

    def cluster(self, at: float, kind: int, engine_id: int = -1, **detail: Any) -> None:
        """One cluster event (allocation, role switch), not tied to a trajectory."""
        self.turn(at, CLUSTER_KEY, 0, kind, engine_id, detail=detail_json(**detail))

    def switch_event(
        self, at: float, switch: RoleSwitch, event_stage: str, engine_id: int, **extra: Any
    ) -> None:
        """A role-switch event at ``event_stage`` (``stop_new_work``, ``drained``, ``serving``)."""
        kind = _SWITCH_EVENT_KIND[event_stage]
        self.cluster(at, kind, engine_id, **switch_detail(switch, event_stage, **extra))

    def allocation(self, at: float, gpus: dict[str, int], reason: str) -> None:
        """The controller's target allocation when it ordered switches."""
        self.cluster(at, ALLOCATION, -1, gpus=gpus, reason=reason)

    def __len__(self) -> int:
        return len(self.log)


def _drop_event(*_args: object, **_kw: object) -> None:
    """``turn`` of a telemetry that keeps no events."""


def _as_tuple(*values: object) -> tuple:
    return values


# ``write`` of a telemetry that keeps no events: a C-level call that ignores its argument.
_drop_row = bool
