"""Trainer sessions as trajectories: numbered turns and the lifecycle events between them.

A trainer names a session (SkyRL's and prime-rl's ``X-Session-ID``, verl's request id) and
sends one turn at a time. Each session is one trajectory in the telemetry: ``traj_start``
at its first turn; after each turn ``tool_start`` (the trainer is running its tool or
environment) and ``tool_end`` when the next turn arrives; ``traj_end`` on
``finish_session`` or after ``idle_s`` without a turn. The router emits the stages in
between, so forecasters see a served run exactly as they see a simulated one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorsa.errors import InputError, StateConflict
from prorsa.telemetry.schema import EventKind as K

logger = logging.getLogger(__name__)

#: Session ids longer than this are refused (they become telemetry keys).
MAX_SESSION_ID_CHARS = 256
#: How long an ended session id is remembered, so a turn under it starts ``id#n``.
ENDED_KEPT_S = 3600.0
#: Ids of requests that name no session; refused as a trainer's own session id, so a
#: one-shot request can never run inside (and end) a trainer's session.
ANONYMOUS_PREFIX = "prorsa-anonymous-"


@dataclass(eq=False)
class Session:
    """One trajectory of a trainer."""

    session_id: str
    #: Its name in telemetry and routing: the session id, or ``id#n`` for the n-th
    #: trajectory under an id whose earlier ones ended (a reused id, or one that idled
    #: out mid-tool-call), so no trajectory's events follow its own end.
    trajectory_id: str = ""
    group_id: str = ""
    task: str = ""
    turns: int = 0  # turns dispatched so far (the next turn's index)
    context_tokens: int = 0
    in_tool: bool = False
    last_s: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ending: bool = False  # finished while a turn was in flight: that turn ends it
    ended: bool = False  # traj_end emitted: no turn may run on it any more
    one_shot: bool = False  # an anonymous request's: its id never comes back
    index: int = 0  # n of ``id#n`` (0: the plain id)


class Sessions:
    """Live sessions of one service; emits their agent-side events through the router.

    Args:
        router: exposes ``trajectory_event(kind, trajectory_id, turn, ...)``.
        clock: seconds (the router's clock, so events stay in order).
        idle_s: a session with no turn for this long is ended by :meth:`expire`.
    """

    def __init__(self, router: Any, clock: Callable[[], float], idle_s: float) -> None:
        self.router = router
        self.clock = clock
        self.idle_s = idle_s
        self._live: dict[str, Session] = {}
        self._ending: dict[str, Session] = {}  # finished, a turn still in flight
        self._anonymous = itertools.count()
        # Trajectory ids not yet ended: a new one never takes a name in use ("x#1" may be
        # the second trajectory of session "x" or the first of a session called "x#1").
        self._trajectories: set[str] = set()
        # The next n of ``id#n`` for each session id whose trajectories ended, and when
        # the last one ended; kept for ENDED_KEPT_S (a service outlives millions of unique
        # ids that never return).
        self._ended: dict[str, tuple[int, float]] = {}
        # Ended trajectory ids and when they ended, for as long: a name is never used
        # again while a forecaster may still hold the events of its end.
        self._ended_trajectories: dict[str, float] = {}
        self.started_total = 0
        self.finished_total = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._live

    def anonymous_id(self) -> str:
        """A fresh id for a one-shot request that named no session."""
        return f"{ANONYMOUS_PREFIX}{next(self._anonymous)}"

    def get_or_start(
        self, session_id: str, *, group_id: str = "", task: str = "", one_shot: bool = False
    ) -> Session:
        """The live session, started (``traj_start``) if new (``one_shot``: an anonymous
        request's, whose id is not remembered once it ends)."""
        if not isinstance(session_id, str) or not session_id:
            raise InputError("session id must be a non-empty string", field="session_id")
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise InputError(
                f"session id has {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}",
                field="session_id",
            )
        if not one_shot and session_id.startswith(ANONYMOUS_PREFIX):
            raise InputError(
                f"session ids starting with {ANONYMOUS_PREFIX!r} are reserved for requests "
                "that name no session",
                field="session_id",
            )
        session = self._live.get(session_id)
        if session is None and session_id in self._ending:
            raise StateConflict(
                f"session {session_id!r} was finished and its last turn is still running",
                field="session_id",
                hint="retry once that turn returns, or use a new session id",
            )
        if session is None:
            index = self._ended.get(session_id, (0, 0.0))[0]
            trajectory_id = f"{session_id}#{index}" if index else session_id
            while trajectory_id in self._trajectories or trajectory_id in self._ended_trajectories:
                index += 1
                trajectory_id = f"{session_id}#{index}"
            self._trajectories.add(trajectory_id)
            session = Session(
                session_id,
                trajectory_id,
                group_id=group_id,
                task=task,
                last_s=self.clock(),
                one_shot=one_shot,
                index=index,
            )
            self._live[session_id] = session
            self.started_total += 1
            self.router.trajectory_event(
                K.TRAJ_START, trajectory_id, 0, group_id=group_id, task=task
            )
        return session

    def before_turn(self, session: Session, context_tokens: int) -> int:
        """Close the gap since the last turn (``tool_end``); returns this turn's index."""
        if session.in_tool:
            self._event(session, K.TOOL_END, session.turns - 1)
            session.in_tool = False
        session.context_tokens = context_tokens
        session.last_s = self.clock()
        turn = session.turns
        session.turns += 1
        return turn

    def after_turn(self, session: Session, turn: int, context_tokens: int) -> None:
        """The turn is done; the trainer has the floor (``tool_start``)."""
        session.context_tokens = context_tokens
        session.last_s = self.clock()
        if session.session_id in self._live:
            self._event(session, K.TOOL_START, turn)
            session.in_tool = True

    def finish(self, session_id: str) -> bool:
        """End a session (``traj_end``); False when it is not live. A session with a turn
        in flight ends when that turn returns (:meth:`turn_returned`): ended now, the
        turn's own events would bring the trajectory back to life in the router."""
        session = self._live.pop(session_id, None)
        if session is None:
            return False
        if session.lock.locked():
            session.ending = True
            self._ending[session_id] = session
        else:
            self._end(session)
        return True

    def check_open(self, session: Session) -> None:
        """StateConflict when ``session`` ended while this turn waited for the one before."""
        if session.ended:
            raise StateConflict(f"session {session.session_id!r} was finished", field="session_id")

    def turn_returned(self, session: Session) -> None:
        """A turn of ``session`` returned (served, failed or refused); ends a session
        finished while it was in flight. Turns queued behind it are then refused
        (:meth:`check_open`): none runs after the trajectory's end."""
        if session.ending and not session.lock.locked():
            session.ending = False
            self._ending.pop(session.session_id, None)
            self._end(session)

    def _end(self, session: Session) -> None:
        session.ended = True
        self._trajectories.discard(session.trajectory_id)
        if not session.one_shot:
            now = self.clock()
            following = self._ended.pop(session.session_id, (0, 0.0))[0]
            # newest last (expire() forgets from the front)
            self._ended[session.session_id] = (max(following, session.index + 1), now)
            self._ended_trajectories.pop(session.trajectory_id, None)
            self._ended_trajectories[session.trajectory_id] = now
        if session.in_tool:
            self._event(session, K.TOOL_END, session.turns - 1)
        self._event(session, K.TRAJ_END, max(0, session.turns - 1))
        self.finished_total += 1

    def expire(self) -> list[str]:
        """End sessions idle for longer than ``idle_s`` (not those mid-turn)."""
        now = self.clock()
        stale = [
            s.session_id
            for s in self._live.values()
            if now - s.last_s > self.idle_s and not s.lock.locked()
        ]
        for session_id in stale:
            logger.info("session %s idle for over %.0f s: ended", session_id, self.idle_s)
            self.finish(session_id)
        # Ended ids, oldest first: forget those ended long ago (a later turn under one
        # starts its trajectory under the plain id again).
        horizon = now - max(ENDED_KEPT_S, 4 * self.idle_s)
        _forget_before(self._ended, horizon, lambda entry: entry[1])
        _forget_before(self._ended_trajectories, horizon, lambda ended_s: ended_s)
        return stale

    def finish_all(self) -> None:
        for session_id in list(self._live):
            self.finish(session_id)

    def _event(self, session: Session, kind: K, turn: int) -> None:
        self.router.trajectory_event(
            kind,
            session.trajectory_id,
            turn,
            group_id=session.group_id,
            task=session.task,
            context_tokens=session.context_tokens,
        )


def _forget_before(ended: dict, horizon: float, ended_at: Callable[[Any], float]) -> None:
    """Drop the entries of ``ended`` (oldest first, as inserted) that ended before
    ``horizon``."""
    while ended:
        oldest = next(iter(ended))
        if ended_at(ended[oldest]) >= horizon:
            break
        del ended[oldest]
