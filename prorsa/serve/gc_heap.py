"""Keeping Python's full garbage collections short while a rollout service serves.

A serving process holds everything its start-up imported and built: Ray's driver, vLLM's
and torch's modules, FastAPI's routes, the policy and the forecaster, some 550,000
objects the collector tracks. A full (generation-2) collection walks them all, and while
it runs every thread of the process stops. Measured on the 2-core machine with
``benchmarks/serve_bench.py``'s tiny-model set-up at 64 sessions: full collections
of 280-370 ms during serving, each one the latency tail of the requests in flight.

None of those objects becomes garbage while the service runs, so the service moves them
out of the collector's view once it has started (:func:`gc.freeze`, what vLLM's engine
core does after its own start-up) and back when it stops. Full collections then walk only
what serving allocated. Objects that become cyclic garbage while frozen are freed at
:func:`gc.unfreeze`, not before, which is why a server embedded in a longer-lived process
gives them back when it stops (unless the process had frozen its heap itself before:
unfreezing is all or nothing, and that freeze is not the server's to undo).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0  # servers of this process serving with the heap frozen
_frozen_before = False  # the process had frozen objects when the first holder came


@contextlib.contextmanager
def startup_heap_frozen(enabled: bool = True) -> Iterator[int]:
    """Freeze the objects alive now out of the collector until the block ends.

    Collects first, so garbage left by start-up is freed rather than frozen. Nested or
    concurrent holders (several servers in one process) share one freeze: the heap is
    unfrozen when the last of them leaves.

    Yields:
        How many objects the collector keeps out of view (0 when not ``enabled``).
    """
    global _holders, _frozen_before
    if not enabled:
        yield 0
        return
    with _lock:
        if _holders == 0:
            _frozen_before = gc.get_freeze_count() > 0
        gc.collect()
        gc.freeze()
        _holders += 1
        frozen = gc.get_freeze_count()
    logger.info("start-up heap frozen: %d objects out of the collector's full passes", frozen)
    try:
        yield frozen
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and not _frozen_before:
                gc.unfreeze()
