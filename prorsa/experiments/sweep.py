"""Run lists of independent cells in parallel, stream results to disk, resume on re-run.

One runner serves ``prorsa compare`` (its best-static search included), ``prorsa tune``
(through :func:`ray_session`) and any other sweep. Backends:

- ``ray`` (the default whenever Ray is importable): each cell is a Ray task. Without an
  address a local Ray instance is started with ``num_cpus=workers``; with ``address`` the
  runner joins an existing cluster and uses whatever CPUs it offers.
- ``inline``: cells run one after another in this process. ``auto`` picks it for
  ``workers == 1`` without an address, where starting Ray (5-10 s) would cost more than
  it gives; tests and debugging use it.
- ``process``: a spawn-context process pool, kept only for installs without Ray
  (``auto`` falls back to it when ``import ray`` fails).

Each finished cell is appended to a JSONL file (one line ``{"key", "result"}``, flushed at
once) so a killed sweep loses at most the cells in flight; on re-run, cells whose key is
already in the file are not run again. The key is a hash of every field of the cell, the
package version, the simulator's code and data and any trained model the cell reads, so
a changed cell, simulator, profile or model never reuses a stale result; a recorded
failure is run again.

SIGINT and SIGTERM end a sweep the same way: pending tasks are cancelled, a local Ray
instance is shut down and pool workers are terminated before the exception propagates,
so no worker outlives the command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import Any

from prorsa import __version__
from prorsa.errors import ConfigError, ProrsaError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "ray", "process", "inline")

Progress = Callable[[int, int], None]


class SweepInterrupted(KeyboardInterrupt):
    """A sweep was stopped by a signal; a KeyboardInterrupt so SIGTERM ends like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def cell_key(cell: Any) -> str:
    """Stable 16-hex-digit key of a cell: its own ``key()`` when it has one (a
    :class:`~prorsa.experiments.cells.Cell`), else a hash of all its fields, the package
    version and the simulator."""
    own = getattr(cell, "key", None)
    if callable(own):
        return own()
    from prorsa.runtime.sim.version import simulator_hash

    fields = dataclasses.asdict(cell) if dataclasses.is_dataclass(cell) else cell
    text = json.dumps(
        {
            "version": __version__,
            "simulator": simulator_hash(),
            "type": type(cell).__name__,
            "fields": fields,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _default_fn(cell: Any) -> dict:
    from prorsa.experiments.cells import run_cell

    return run_cell(cell)


# ---------------------------------------------------------------------------------------
# Signals and Ray sessions (shared with tuning)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """While active, SIGTERM raises :class:`SweepInterrupted` like SIGINT raises
    KeyboardInterrupt, so clean-up in ``finally`` blocks runs for both.

    Only the main thread may install handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum: int, _frame: object) -> None:
        raise SweepInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _import_ray():
    try:
        import ray
    except ImportError:
        return None
    return ray


@contextmanager
def ray_session(workers: int, address: str | None = None) -> Iterator[Any]:
    """Yield the ``ray`` module with a connected session.

    Joins ``address`` when given; otherwise starts a local instance with ``workers`` CPUs.
    A session this call started is shut down on exit (also on SIGINT/SIGTERM, see
    :func:`signals_interrupt`); a session the caller started is left alone.
    """
    ray = _import_ray()
    if ray is None:
        raise ConfigError("Ray is not installed", hint="pip install 'prorsa[ray]'")
    owned = not ray.is_initialized()
    if owned:
        kwargs: dict[str, Any] = {
            "ignore_reinit_error": True,
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": logging.WARNING,
        }
        if address:
            kwargs["address"] = address
        else:
            kwargs["num_cpus"] = workers
        try:
            ray.init(**kwargs)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"could not connect to the Ray cluster at '{address}': {exc}"
                if address
                else f"could not start a local Ray instance: {exc}",
                hint="check --address (e.g. ray://head:10001 or head:6379)"
                if address
                else "try --workers 1 to run without Ray",
            ) from None
        logger.info("Ray session %s", address or f"local, {workers} CPUs")
    try:
        yield ray
    except KeyboardInterrupt:
        if owned and not address:
            _stop_local_ray_now(ray)
        raise
    finally:
        if owned:
            ray.shutdown()


def _stop_local_ray_now(ray: Any, grace_s: float = 0.3) -> None:
    """Stop a local Ray instance's helper processes (autoscaler monitor, dashboard, log
    monitor) all at once before ``ray.shutdown``, which stops them one by one and gives
    each a second; an interrupted command should be gone in a moment. The GCS and the
    raylet stay for ``shutdown``: the driver must disconnect from them first."""
    import time

    keep = ("gcs_server", "raylet", "reaper")
    try:  # Ray keeps its child processes on the node object (not a public API)
        node = ray._private.worker._global_node
        processes = [
            info.process
            for kind, infos in node.all_processes.items()
            if kind not in keep
            for info in infos
        ]
    except Exception:
        logger.debug("cannot list Ray's processes; stopping them one by one", exc_info=True)
        return
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        time.sleep(0.02)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=1.0)


def cancel_ray_tasks(ray: Any, refs: list) -> None:
    """Cancel unfinished Ray tasks, killing the workers that run them."""
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # already finished or lost: nothing to cancel
            logger.debug("cancel of a finished task ignored", exc_info=True)


# ---------------------------------------------------------------------------------------
# Result file


class ResultLog:
    """Append-only JSONL of finished cells: ``{"key": ..., "result": ...}`` per line."""

    def __init__(self, path: Path | None, *, resume: bool = True) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        if path is None:
            return
        if path.exists() and not path.is_file():
            raise ConfigError(f"sweep results path {path} exists and is not a file")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not resume:
            path.unlink()
        if path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        bad = failed = 0
        with path.open("rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    result = record["result"]
                    key = record["key"]
                except (ValueError, KeyError, TypeError):
                    bad += 1  # a line cut short by a kill: run that cell again
                    continue
                if isinstance(result, dict) and result.get("error") and not _infeasible(result):
                    failed += 1  # a recorded failure is not a result: run it again
                    continue
                self.done[key] = result
        if bad:
            logger.warning("%s: %d unreadable line(s) skipped; those cells run again", path, bad)
        if failed:
            logger.warning("%s: %d failed cell(s) run again", path, failed)
        # A line cut short has no newline; start the next record on a line of its own.
        with path.open("rb+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def append(self, key: str, result: dict) -> dict:
        """Record ``result`` (flushed at once); returns it as it will read back."""
        line = json.dumps({"key": key, "result": result}, default=float)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")
                f.flush()
        stored = json.loads(line)["result"]
        self.done[key] = stored
        return stored


# ---------------------------------------------------------------------------------------
# The runner


def _call(fn: Callable[[Any], dict], cell: Any) -> tuple[str, Any]:
    """Run one cell in a worker; a project error travels back as a value (its attributes,
    the hint too, pickle with it), so the driver re-raises it as it was, without the
    wrapper text of a Ray task error."""
    try:
        return "ok", fn(cell)
    except ProrsaError as exc:
        return "error", exc


def _unwrap(outcome: tuple[str, Any]) -> dict:
    status, value = outcome
    if status == "error":
        raise value
    return value


class Sweep:
    """Runs lists of independent cells; use as a context manager so one Ray session (or
    process pool) serves every :meth:`map` of a command.

    Parameters
    ----------
    workers:
        Parallel cells; 0 means one per CPU (local) or the cluster's CPUs (``address``).
    address:
        Ray cluster to join (``ray://host:10001`` or ``host:6379``); None starts local Ray.
    results_path:
        JSONL file streaming finished cells; with ``resume`` its cells are not run again.
    backend:
        ``auto``, ``ray``, ``process`` or ``inline`` (see the module docstring).
    fn:
        Top-level function ``cell -> dict`` (default: ``run_cell``).
    key:
        Function ``cell -> str`` naming a cell in the results file (default: :func:`cell_key`).
    """

    def __init__(
        self,
        *,
        workers: int = 0,
        address: str | None = None,
        results_path: Path | None = None,
        resume: bool = True,
        backend: str = "auto",
        fn: Callable[[Any], dict] | None = None,
        key: Callable[[Any], str] = cell_key,
    ) -> None:
        if workers < 0:
            raise ConfigError(f"workers must be >= 0, got {workers}", hint="0 means one per CPU")
        if backend not in BACKENDS:
            raise ConfigError(f"unknown sweep backend '{backend}'", hint=f"one of {BACKENDS}")
        self.workers = workers or os.cpu_count() or 1
        self.address = address
        self.fn = fn or _default_fn
        self.key = key
        self.log = ResultLog(results_path, resume=resume)
        self.backend = self._choose(backend)
        self.reused = 0  # cells answered from the results file
        self.ran = 0
        self._stack: list = []
        self._ray = None
        self._pool = None
        self._remote = None

    def _choose(self, backend: str) -> str:
        if backend != "auto":
            if backend == "ray" and _import_ray() is None:
                raise ConfigError("Ray is not installed", hint="pip install 'prorsa[ray]'")
            return backend
        if self.workers == 1 and self.address is None:
            return "inline"
        if _import_ray() is not None:
            return "ray"
        if self.address is not None:
            raise ConfigError("--address needs Ray", hint="pip install 'prorsa[ray]'")
        logger.info("Ray is not installed; running cells in a process pool")
        return "process"

    def __enter__(self) -> Sweep:
        from contextlib import ExitStack

        stack = ExitStack()
        try:
            if self.backend == "ray":
                self._ray = stack.enter_context(ray_session(self.workers, self.address))
                self._remote = self._ray.remote(num_cpus=1, max_retries=0)(_worker_call)
            elif self.backend == "process":
                import multiprocessing

                pool = multiprocessing.get_context("spawn").Pool(self.workers)
                self._pool = pool
                stack.callback(self._close_pool)
            # Installed after ray.init, which sets a SIGTERM handler of its own.
            stack.enter_context(signals_interrupt())
        except BaseException:
            stack.close()
            raise
        self._stack.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        # Pass the exception on: an interrupted session is stopped faster than a finished one.
        self._stack.pop().__exit__(*exc)

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def map(self, cells: Sequence[Any], progress: Progress | None = None) -> list[dict]:
        """Results of ``cells`` in their order; finished cells come from the results file."""
        if not self._stack:
            with self:
                return self.map(cells, progress)
        keys = [self.key(c) for c in cells]
        todo: dict[str, Any] = {}
        for k, cell in zip(keys, cells, strict=True):
            if k not in self.log.done and k not in todo:
                todo[k] = cell
        reused = len(set(keys)) - len(todo)
        self.reused += reused
        if reused:
            logger.info("%d of %d cells already in %s", reused, len(set(keys)), self.log.path)
        done = reused
        total = len(set(keys))
        if progress is not None:
            progress(done, total)
        with closing(self._run(todo)) as finished:
            for k, result in finished:
                self.log.append(k, result)
                self.ran += 1
                done += 1
                if progress is not None:
                    progress(done, total)
        return [_as_asked(self.log.done[k], c) for k, c in zip(keys, cells, strict=True)]

    def _run(self, todo: dict[str, Any]) -> Iterator[tuple[str, dict]]:
        if not todo:
            return
        if self.backend == "inline":
            for k, cell in todo.items():
                yield k, _unwrap(_call(self.fn, cell))
        elif self.backend == "process":
            items = list(todo.items())
            outcomes = self._pool.imap_unordered(
                _call_indexed, [(i, self.fn, c) for i, (_, c) in enumerate(items)]
            )
            for i, outcome in outcomes:
                yield items[i][0], _unwrap(outcome)
        else:
            yield from self._run_ray(todo)

    def _run_ray(self, todo: dict[str, Any]) -> Iterator[tuple[str, dict]]:
        ray = self._ray
        fn_ref = ray.put(self.fn)
        pending = {self._remote.remote(fn_ref, cell): k for k, cell in todo.items()}
        try:
            while pending:
                # A timeout keeps the loop returning to Python, where signals are handled.
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
                for ref in ready:
                    k = pending.pop(ref)
                    yield k, _unwrap(ray.get(ref))
        except Exception:
            # One cell failed: the cells already finished are still results (kept on disk
            # by the caller), not work a resume should do again.
            if pending:
                done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
                for ref in done:
                    k = pending.pop(ref)
                    with suppress(Exception):
                        yield k, _unwrap(ray.get(ref))
            raise
        finally:
            if pending:
                cancel_ray_tasks(ray, list(pending))


def _as_asked(result: Any, cell: Any) -> Any:
    """``result`` describing ``cell`` as the caller gave it: a reused result may have
    been stored for an equal cell written otherwise (the same trace by another path, in
    another checkout), and callers group results by their cell."""
    if isinstance(result, dict) and "cell" in result and hasattr(cell, "to_dict"):
        return {**result, "cell": cell.to_dict()}
    return result


def _infeasible(result: dict) -> bool:
    """A cell whose draw cannot run on its layout (``run_cell_recorded``): the same
    outcome on any rerun, so it is kept (older files name the error only)."""
    return bool(result.get("infeasible")) or str(result.get("error", "")).startswith(
        "CapacityError:"
    )


def _call_indexed(item: tuple[int, Callable[[Any], dict], Any]) -> tuple[int, tuple[str, Any]]:
    index, fn, cell = item
    return index, _worker_call(fn, cell)


#: ``prorsa.forecast.threads.ENV``, spelled out: importing the forecast package here would
#: cost every sweep half a second.
FORECAST_THREADS_ENV = "PRORSA_FORECAST_THREADS"


def _worker_call(fn: Callable[[Any], dict], cell: Any) -> tuple[str, Any]:
    """:func:`_call` in a worker process (Ray task or pool): a worker holds one core of
    the sweep, so its forecasts use one thread unless the environment says otherwise."""
    os.environ.setdefault(FORECAST_THREADS_ENV, "1")
    return _call(fn, cell)


def run_sweep(cells: Sequence[Any], progress: Progress | None = None, **options: Any) -> list[dict]:
    """Run ``cells`` with a one-off :class:`Sweep` (``options`` are its parameters)."""
    with Sweep(**options) as sweep:
        return sweep.map(cells, progress)
