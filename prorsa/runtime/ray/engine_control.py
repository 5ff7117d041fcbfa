"""Control of a running engine: weights, sleep, worker RPCs.

:class:`EngineControl` is the half of :class:`~prorsa.runtime.ray.engine.EngineServer`
that a trainer's control plane uses (the serving half routes requests). It reaches the
vLLM engine through ``self._engine()`` and keeps the actor's view of its state
(``_paused``, ``_sleeping``, ``weight_version``, ``weights_path``) in step with it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from prorsa.errors import InputError
from prorsa.runtime.ray.weights import check_weight_dir, clear_folder

logger = logging.getLogger(__name__)

#: How ``pause`` treats requests in flight (vLLM's pause modes).
PAUSE_MODES: tuple[str, ...] = ("keep", "abort", "wait")
#: What vLLM's sleep releases and a partial wake-up brings back, by tag (``scheduling``:
#: a level-0 sleep, which releases no memory).
SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache", "scheduling")


class EngineControl:
    """Weights, sleep and worker RPCs of one engine (a mixin of ``EngineServer``)."""

    engine_id: int
    config: Any
    connector: str | None
    on_cpu: bool
    weight_version: int
    weights_path: str
    _paused: bool
    _sleeping: bool
    #: Control calls running now that may hold the engine's steps for long (a reload, a
    #: worker RPC, sleep, wake-up): the load monitor must not take it for stuck.
    _busy: list[str]

    def _engine(self) -> Any:  # provided by EngineServer
        raise NotImplementedError

    @contextlib.contextmanager
    def _busy_with(self, call: str) -> Iterator[None]:
        self._busy.append(call)
        try:
            yield
        finally:
            self._busy.remove(call)

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop scheduling; requests that arrive while paused queue until :meth:`resume`.

        Args:
            mode: what happens to requests in flight: ``keep`` freezes them (they go on
                after resume, KV kept), ``wait`` lets them finish (returns once drained),
                ``abort`` ends them at once with finish reason ``abort``.
            clear_cache: also drop the prefix cache once nothing runs (ignored by ``keep``).
        """
        if mode not in PAUSE_MODES:
            raise InputError(
                f"unknown pause mode {mode!r}", field="mode", hint=f"one of {PAUSE_MODES}"
            )
        await self._engine().pause_generation(mode=mode, clear_cache=clear_cache)
        self._paused = True

    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""
        await self._engine().resume_generation()
        self._paused = False

    async def is_paused(self) -> bool:
        """Whether the scheduler is paused (by :meth:`pause` or :meth:`sleep`)."""
        return bool(await self._engine().is_paused())

    # ------------------------------------------------------------------ weights
    async def update_weights_from_path(self, path: str, version: int) -> dict[str, Any]:
        """Load new weights from a ``save_pretrained`` folder in place, without a restart.

        Requests in flight finish under the old weights first (a ``wait`` pause; new
        requests queue meanwhile) unless the engine is already paused; then every
        parameter is reloaded through vLLM's in-place reload (``reload_weights`` on each
        worker), the version is stamped on the engine (finished outputs carry
        ``weight_versions`` spans), the prefix cache and connector state are dropped
        (their KV was computed with the old weights), and scheduling resumes if this
        call paused it. A request frozen by an earlier ``keep`` pause resumes under the
        new weights; its output's spans show the switch.

        Args:
            path: the weight folder (visible to this engine's process).
            version: the new weight version; must not be below the current one.

        Returns:
            ``engine_id``, ``weight_version``, ``reload_s`` and ``prefix_cache_reset``.
        """
        folder = str(check_weight_dir(path, self.config.model))
        if version < self.weight_version:
            raise InputError(
                f"weight version {version} is below the engine's {self.weight_version}",
                field="version",
                hint="weight versions never go backwards",
            )
        engine = self._engine()
        paused_here = not self._paused
        if paused_here:
            await engine.pause_generation(mode="wait", clear_cache=False)
        started = time.perf_counter()
        try:
            with self._busy_with("update_weights_from_path"):
                await engine.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_path": folder, "is_checkpoint_format": True},
                )
                await engine.update_weight_version(str(version))
                reset = await engine.reset_prefix_cache(reset_connector=True)
            if self.connector == "example" and self.config.kv_storage_dir:
                clear_folder(self.config.kv_storage_dir)
        finally:
            if paused_here:
                await engine.resume_generation()
        self.weight_version = version
        self.weights_path = folder
        reload_s = time.perf_counter() - started
        logger.info(
            "engine %d: weights v%d from %s in %.3f s", self.engine_id, version, folder, reload_s
        )
        return {
            "engine_id": self.engine_id,
            "weight_version": version,
            "reload_s": reload_s,
            "prefix_cache_reset": bool(reset),
        }

    async def set_weight_version(self, version: int) -> None:
        """Stamp a version without loading weights (a trainer pushed them itself), and
        drop the prefix cache and the connector's state and stored KV, as
        :meth:`update_weights_from_path` does: they were computed with the old weights."""
        engine = self._engine()
        await engine.update_weight_version(str(version))
        await engine.reset_prefix_cache(reset_connector=True)
        if self.connector == "example" and self.config.kv_storage_dir:
            clear_folder(self.config.kv_storage_dir)
        self.weight_version = version

    async def collective_rpc(
        self,
        method: str,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker of this engine; one result per worker.

        For trainers that move weights themselves (a worker extension's receive
        method, vLLM's weight-transfer engine). Results must be picklable.
        """
        if not isinstance(method, str) or not method:
            raise InputError("collective_rpc needs a method name", field="method")
        with self._busy_with("collective_rpc"):
            return list(
                await self._engine().collective_rpc(
                    method, timeout=timeout_s, args=tuple(args), kwargs=dict(kwargs or {})
                )
            )

    # ------------------------------------------------------------------ sleep
    async def sleep(self, level: int = 1, mode: str = "abort") -> dict[str, Any]:
        """Stop generating and release memory where the platform can.

        Always: the scheduler pauses (``mode`` handles requests in flight, as in
        :meth:`pause`; new requests queue until :meth:`wake_up`) and, at level >= 1, the
        prefix cache is dropped. Memory: on GPU vLLM's sleep mode offloads the weights
        to host memory (level 1) or discards them (level 2) and discards the KV cache;
        on CPU vLLM's worker keeps both (it has no sleep mode), so nothing is freed —
        the returned ``rss_bytes`` before and after show it.
        """
        if level not in (0, 1, 2):
            raise InputError(f"sleep level must be 0, 1 or 2, got {level}", field="level")
        if mode not in PAUSE_MODES:
            raise InputError(f"unknown pause mode {mode!r}", field="mode")
        before = _rss_bytes()
        with self._busy_with("sleep"):
            await self._engine().sleep(level, mode)
        self._sleeping = self._paused = True
        freed = [] if self.on_cpu else (["kv_cache", "weights"] if level else [])
        return {
            "engine_id": self.engine_id,
            "level": level,
            "freed": freed,
            "rss_bytes": {"before": before, "after": _rss_bytes()},
        }

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Undo :meth:`sleep` (``tags``: ``weights`` / ``kv_cache`` for a partial wake on
        GPU). True once fully awake, when scheduling resumes."""
        with self._busy_with("wake_up"):
            awake = bool(await self._engine().wake_up(list(tags) if tags else None))
        if awake:
            self._sleeping = self._paused = False
        return awake

    async def is_sleeping(self) -> bool:
        return bool(await self._engine().is_sleeping())


def _rss_bytes() -> int:
    """Resident memory of this actor and its children (EngineCore, workers)."""
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total
