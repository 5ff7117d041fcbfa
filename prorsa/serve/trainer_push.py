"""A trainer's own weight push, inside the service's cross-role update window.

Trainers that move weights themselves (vLLM's weight-transfer routes, SkyRL's worker
extension, any ``collective_rpc``) do it between :meth:`TrainerPushWindow.begin_weight_update`
and :meth:`~TrainerPushWindow.finish_weight_update`: the window quiesces every engine
whatever its role (:mod:`prorsa.serve.weight_sync`), tracks the engines a call failed on,
and at the finish stamps the new version and takes those engines out of service.

:class:`TrainerPushWindow` is a part of :class:`~prorsa.serve.service.RolloutService`,
kept in its own file: it reads the service's engines, router, weight sync and version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

from prorsa.errors import InputError, StateConflict
from prorsa.runtime.ray.turns import NoEngineAvailable
from prorsa.serve.shielded import wait_uncancelled

logger = logging.getLogger(__name__)

#: vLLM's set-up of a weight transfer on its workers: a failure moves no weights (every
#: other call's failure inside a window retires the engine at the finish or cancel).
_WINDOW_CALLS = ("init_weight_transfer_engine",)
#: Worker-extension calls that open and close a trainer's weight push (SkyRL's).
_OPENS_WINDOW = frozenset({"skyrl_start_weight_update"})
_CLOSES_WINDOW = frozenset({"skyrl_finish_weight_update"})


def _call_id(method: str, args: Any, kwargs: Any) -> str:
    """One call of ``method`` with its arguments: a push in several buckets is several
    calls of one method, and a bucket's failure is cleared only by that bucket's retry."""
    digest = hashlib.sha256(repr((args, sorted((kwargs or {}).items()))).encode())
    return f"{method}:{digest.hexdigest()[:16]}"


def _moves_weights(method: str) -> bool:
    """A collective_rpc method that changes an engine's weights (vLLM's and the trainers'
    worker extensions' names)."""
    return method.startswith("update_weights") or method in ("load_weights", "reload_weights")


#: An external weight update between its begin call and its window being open.
_OPENING = "opening"


class TrainerPushWindow:
    """The update window of :class:`~prorsa.serve.service.RolloutService` (see the module
    doc); every attribute it reads is the service's."""

    async def begin_weight_update(self) -> dict[str, Any]:
        """Quiesce for a trainer that pushes weights itself (``collective_rpc``, vLLM's
        weight-transfer routes); end with :meth:`finish_weight_update`."""
        if self._external_update is not None:
            raise StateConflict("a weight update is already open", hint="finish it first")
        if self._control_calls:
            # A pause, resume, sleep or wake-up passed its own check and waits for the
            # update lock: a window opened now would hold it past the trainer's finish.
            raise StateConflict(
                "a pause, resume, sleep or wake-up is under way", hint="retry once it returns"
            )
        self._check_can_update()
        self._external_update = _OPENING  # taken before any wait: a retried begin is refused
        try:
            manager = self.sync.paused(self.config.sync_drain_timeout_s)
            window = await manager.__aenter__()
        except BaseException:
            self._external_update = None
            raise
        try:  # again, under the lock: a sleep that passed its own check may have won it
            self._check_can_update()
        except BaseException as exc:
            self._external_update = None
            await manager.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._external_update = (manager, window)
        return {"from_version": window.from_version, "engines": window.engines}

    async def finish_weight_update(self, version: int | str | None = None) -> dict[str, Any]:
        """Stamp the new version (a number or a label), drop caches, resume (see
        :meth:`begin_weight_update`)."""
        if not self.weight_update_open:
            raise InputError("no weight update is open", hint="call begin_weight_update first")
        # Checked while the window is still open: a trainer refused here may finish again.
        version, label = self._check_finishable(version)
        manager, window = self._external_update
        self._external_update = None
        pushed_wrong = self._pushes_failed()
        try:
            # An engine a push failed on leaves before anything is stamped on it.
            self._retire(pushed_wrong, "weight push")
            # Stamps the version and drops the prefix cache and the connector's stored KV
            # (computed under the old weights); an engine that fails holds other weights.
            stamping = asyncio.ensure_future(
                self.for_each_engine(
                    lambda c: c.set_weight_version(version),
                    tolerate=True,
                    timeout_s=self.config.engine_control_timeout_s,
                )
            )
            # Waited for even if the trainer's call is cancelled: engines stamped with the
            # new version must be matched by the service's, or the next update reuses it.
            results, cancelled = await wait_uncancelled(stamping)
            failed = {**pushed_wrong, **self._retire_failed(results, "weight update")}
            self.router.forget_caches()
            self._stamp_version(version, label)
            window.detail.update(external=True, failed=failed)
        finally:
            await manager.__aexit__(None, None, None)
        if self.metrics is not None:
            self.metrics.observe_sync(window.summary)
        if cancelled:
            raise asyncio.CancelledError
        return window.summary

    async def cancel_weight_update(self) -> None:
        """Close an open update window without a new version (the push failed);
        StateConflict while :meth:`finish_weight_update_with` is finishing it (its call
        may already have committed the new weights: they must get the new version)."""
        if self._finishing:
            raise StateConflict(
                "the update window is finishing: the pushed weights are being committed",
                hint="wait for the finish to return",
            )
        await self._close_without_version()

    async def _close_without_version(self) -> None:
        if not self.weight_update_open:
            return
        manager, window = self._external_update
        self._external_update = None
        # An engine a push failed on may hold part of it: it leaves, as on a finish,
        # unless the push failed everywhere (then nothing tells the engines apart, and
        # retiring all would end the service: they serve what they hold).
        pushed_wrong = self._pushes_failed()
        live = set(self.live_engines())
        pushed_wrong = {eid: why for eid, why in pushed_wrong.items() if eid in live}
        if set(pushed_wrong) < live:
            self._retire(pushed_wrong, "weight push")
        window.detail.update(external=True, cancelled=True, failed=pushed_wrong)
        try:
            # Some weights may have arrived: no KV cached under the old ones is reused.
            await self.control_engines(lambda c: c.reset_prefix_cache(), "cache reset")
            self.router.forget_caches()
        finally:
            await manager.__aexit__(None, None, None)

    def _check_finishable(self, version: int | str | None) -> tuple[int, str]:
        """The version and label a finish would stamp; InputError if not above the
        current one, StateConflict if the push failed on every engine (none holds the
        new weights)."""
        version = self._resolve_version(version)
        if self._window_failed and self._failed_on_every_live_engine():
            raise StateConflict(
                "the weight push failed on every engine: no engine holds the new weights",
                hint="push again, or cancel the window (cancel_weight_update)",
            )
        return version

    def _failed_on_every_live_engine(self) -> bool:
        """Whether a call inside the open window failed on every engine still live."""
        return set(self._window_failed) >= set(self.live_engines())

    def _pushes_failed(self) -> dict[int, str]:
        """The engines a push failed on in the window now closing (id -> what failed)."""
        failed, self._window_failed = self._window_failed, {}
        return {eid: "; ".join(calls.values()) for eid, calls in failed.items()}

    @contextlib.contextmanager
    def _control_call(self, what: str) -> Iterator[None]:
        """A pause, resume, sleep or wake-up: refused while an update window is open, and
        counted while it runs, so no window opens under it (:meth:`begin_weight_update`)."""
        self._refuse_in_update_window(what)
        self._control_calls += 1
        try:
            yield
        finally:
            self._control_calls -= 1

    def _refuse_in_update_window(self, what: str) -> None:
        """StateConflict while a trainer's weight update window is open (or opening): the
        window holds the update lock until it is finished, so the call would wait for a
        request the trainer may never send."""
        if self._external_update is not None:
            raise StateConflict(
                f"{what}: a weight update window is open",
                hint="finish it (finish_weight_update) or cancel it (cancel_weight_update)",
            )

    @property
    def weight_update_open(self) -> bool:
        """A window from :meth:`begin_weight_update` is open (and not still opening)."""
        return isinstance(self._external_update, tuple)

    def _check_can_update(self) -> None:
        if self.sleeping and "weights" in self.asleep:
            raise InputError(
                "the engines are asleep: their weights are not in memory",
                hint="wake_up first (tags=weights wakes only them), then update the weights",
            )
        if not self.live_engines():
            raise NoEngineAvailable("no live engine to update")

    async def collective_rpc(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> dict[int, list[Any]]:
        """Call ``method`` on every worker of every live engine; results per engine.

        To move weights this way, wrap the calls in :meth:`begin_weight_update` /
        :meth:`finish_weight_update`; a call that moves weights (``update_weights*``,
        ``load_weights``, ``reload_weights``) outside that window is refused with a
        :class:`StateConflict`: it would change weights under turns being served. SkyRL's
        worker-extension calls that start and finish its push
        (``skyrl_start_weight_update``, ``skyrl_finish_weight_update``) open and close the
        window themselves (the finish stamps the next version). Inside the window, an
        engine whose call of a method fails (other than vLLM's set-up of the transfer,
        which moves no weights) and does not succeed on a retry holds weights no one can
        vouch for: the finish or cancel takes it out of service instead of serving from
        it under either version, unless every engine failed (see
        :meth:`finish_weight_update`). The first error is still raised here.
        """
        if method in _OPENS_WINDOW:
            return await self.begin_weight_update_with(method, args, kwargs, timeout_s)
        if method in _CLOSES_WINDOW:
            results, _ = await self.finish_weight_update_with(method, None, args, kwargs, timeout_s)
            return results
        if _moves_weights(method) and not self.weight_update_open:
            raise StateConflict(
                f"collective_rpc {method!r} moves weights outside a weight update window",
                hint="open one first (start_weight_update) and finish it after the push",
            )
        return await self._rpc(method, args, kwargs, timeout_s)

    async def begin_weight_update_with(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> dict[int, list[Any]]:
        """:meth:`begin_weight_update`, then ``method`` on every engine (vLLM's or a
        worker extension's start of a push).

        A call that failed on every engine (or whose wait was cancelled) closes the
        window again: nothing changed, and serving never stays paused behind an error.
        One that failed on some engines only leaves the window open, its error raised:
        the others are part-way into the push (vLLM's start readies their layers for new
        weights), so the trainer finishes it and the engines it failed on leave then.
        """
        await self.begin_weight_update()
        try:
            return await self._rpc(method, args, kwargs, timeout_s)
        except Exception:
            if self._failed_on_every_live_engine():
                await self.cancel_weight_update()
            raise
        except BaseException:
            await self.cancel_weight_update()
            raise

    async def finish_weight_update_with(
        self,
        method: str,
        version: int | str | None = None,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[dict[int, list[Any]], dict[str, Any]]:
        """``method`` on every engine (the end of a push), then
        :meth:`finish_weight_update` to ``version``.

        Refused first, with the window still open and ``method`` not called, when the
        version would not be above the current one or the push failed on every engine.
        A call that fails on some engines only goes on to the finish, which takes those
        engines out of service; one that fails on all (or is cancelled) cancels the
        window and raises.
        """
        if not self.weight_update_open:
            raise StateConflict(
                f"{method}: no weight update is open", hint="start one first (start_weight_update)"
            )
        self._check_finishable(version)
        self._finishing = True
        try:
            try:
                results = await self._rpc(method, args, kwargs, timeout_s)
            except Exception:
                if self._failed_on_every_live_engine():
                    await self._close_without_version()
                    raise
                results = {}  # the engines it failed on leave at the finish
            except BaseException:
                await self._close_without_version()
                raise
            return results, await self.finish_weight_update(version)
        finally:
            self._finishing = False

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> dict[int, list[Any]]:
        """vLLM's ``init_weight_transfer_engine`` on every live engine.

        A trainer sees this service as one server of ``engines x tensor_parallel_size``
        workers (``/get_world_size``) and gives it one NCCL ``rank_offset``; each engine's
        workers take the ranks after those of the live engines before it, as separate
        servers' offsets would (every engine given the same offset would repeat ranks,
        and the group would never form)."""
        offset = init_info.get("rank_offset")
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
            raise InputError(f"rank_offset must be an integer, got {offset!r}", field="rank_offset")
        ids = self.live_engines()
        tp = self.tensor_parallel_size
        per_engine = {
            eid: init_info if offset is None else {**init_info, "rank_offset": offset + i * tp}
            for i, eid in enumerate(ids)
        }
        results = await asyncio.gather(
            *(
                self.client(eid).collective_rpc(
                    "init_weight_transfer_engine", (), {"init_info": per_engine[eid]}, None
                )
                for eid in ids
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(ids, results, strict=True))

    @property
    def tensor_parallel_size(self) -> int:
        """Workers per engine."""
        return self.fleet.spec.engine.tensor_parallel_size if self.fleet is not None else 1

    async def _rpc(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> dict[int, list[Any]]:
        """:meth:`collective_rpc` without its window rules."""
        results = await self.for_each_engine(
            lambda c: c.collective_rpc(method, args, kwargs, timeout_s), tolerate=True
        )
        failed = {eid: r for eid, r in results.items() if isinstance(r, BaseException)}
        if self.weight_update_open and method not in _WINDOW_CALLS:
            call = _call_id(method, args, kwargs)
            for eid in results:
                calls = self._window_failed.setdefault(eid, {})
                if eid in failed:
                    calls[call] = f"{method}: {failed[eid]!r}"
                else:
                    calls.pop(call, None)  # a retry of that same call went through
                if not calls:
                    del self._window_failed[eid]
        for error in failed.values():
            raise error
        return results

    def _resolve_version(self, version: int | str | None) -> tuple[int, str]:
        return self.weight_labels.resolve(version, self.weight_version)

    def _stamp_version(self, version: int, label: str) -> None:
        """Serve ``version`` named ``label``, as resolved under the update lock (a relabel
        is refused while an update is under way, so the label is still free)."""
        self.weight_labels.stamp(version, label)
        self.weight_version = version

    def relabel_weights(self, label: str) -> None:
        """Name the weights served now ``label`` (vLLM's ``/update_weight_version``);
        refused while an update is under way, whose own label is not yet stamped."""
        if self.sync.window is not None or self._external_update is not None:
            raise StateConflict(
                "a weight update is under way", hint="relabel after it has finished"
            )
        self.weight_labels.relabel(self.weight_version, label)

    def _retire_failed(self, results: dict[int, Any], what: str) -> dict[int, str]:
        """Take engines whose update failed out of service: they hold other weights. When
        every engine refused the request itself (an InputError), nothing changed: that
        error is raised and no engine leaves."""
        refused = [r for r in results.values() if isinstance(r, InputError)]
        if refused and len(refused) == len(results):
            raise refused[0]
        failed = {eid: repr(r) for eid, r in results.items() if isinstance(r, BaseException)}
        self._retire(failed, what)
        if failed and len(failed) == len(results):
            raise NoEngineAvailable(f"{what} failed on every engine: {failed}")
        return failed

    def _retire(self, failed: dict[int, str], what: str) -> None:
        """Take the engines that failed ``what`` (id -> error) out of service."""
        for engine_id, error in failed.items():
            logger.error("engine %d failed the %s and leaves service: %s", engine_id, what, error)
            self.router.pools.mark_dead(engine_id, cause=f"{what} failed: {error}")
