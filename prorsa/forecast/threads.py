"""How many threads a controller tick's forecast may use.

The per-turn models of ``lightgbm-trajectory`` score every turn that started since the
last tick (~2,000 rows per 1 s tick at 10,000 live trajectories), and their compiled
predictors (:mod:`prorsa.forecast.compiled_trees`) split those rows over a thread pool:
on this project's 2-core reference machine two threads take a booster from ~0.95 to
~0.58 ms, ~2 ms off a tick's five (benchmarks/results/decision_latency.json). Results do
not depend on the thread count: every row is scored the same way on whichever thread.
(The bottom-up sum's numpy path holds the interpreter lock for most of its time, so it
gains nothing from a second thread; its compiled kernel, :mod:`bottomup_kernel`, releases
the lock, which is what lets it run beside the scoring at full speed.) With two
threads or more, a tick with at least ``compiled_trees.MIN_ROWS`` new turns, after a tick
whose forecast was read, scores them on a worker thread (:func:`scoring_pool`, on one
thread fewer) while the caller sums the other trajectories' bottom-up terms.

``PRORSA_FORECAST_THREADS`` sets the count (1 where many simulations share the cores,
as in a sweep); the default is two where the machine has two cores or more. Sweep
workers default it to 1 in their own process (``prorsa.experiments.sweep``), on a remote
Ray cluster too; a value set in the driver's environment does not travel to them.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from prorsa.errors import ConfigError

ENV = "PRORSA_FORECAST_THREADS"


def forecast_threads() -> int:
    """Threads per tick: ``$PRORSA_FORECAST_THREADS``, else 2; at most the CPUs this
    process may run on (tl2cgen refuses a pool larger than the machine)."""
    cpus = _usable_cpus()
    raw = os.environ.get(ENV)
    if raw is None or raw == "":
        return min(2, cpus)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{ENV} must be a whole number >= 1, got {raw!r}")
    return min(value, cpus)


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on this OS
        return os.cpu_count() or 1


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def scoring_pool() -> ThreadPoolExecutor:
    """One worker thread that scores a tick's new turns beside the bottom-up sum."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="prorsa-turn-scores")
        return _pool


def _forget_pool_in_child() -> None:
    # A fork copies the executor but not its thread (work handed to it would wait for
    # ever), and the lock possibly held by another thread of the parent.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)
