"""Keeping Python's full garbage collections short in the processes that serve.

A serving process holds everything its start-up imported and built. ``prorsa serve``'s
holds Ray's driver, FastAPI's routes, the policy and the forecaster; an engine actor holds
vLLM's, torch's and Ray's modules and the engine's front end: 550,000 to 740,000 objects
the collector tracks. A full (generation-2) collection walks them all, and while it runs
every thread of that process stops. Measured on the 2-core machine at 64 sessions
(``benchmarks/serve_bench.py``'s tiny-model set-up): full collections of 280-370 ms in
the serving process and 383 ms in the engine actor, each one the latency tail of every
request in flight.

None of those objects becomes garbage while the process serves, so it moves them out of
the collector's view once started (:func:`gc.freeze`; vLLM does the same in its OpenAI
server and in its engine-core process, not in an ``AsyncLLM`` front end embedded in
another process, as the engine actor's is) and back when it stops. Full collections then
walk only what serving allocated: under 6 ms in the same set-up. Objects that become
cyclic garbage while frozen are freed at :func:`gc.unfreeze`, not before, which is why a
server embedded in a longer-lived process gives them back when it stops (unless the
process had frozen its heap itself before: unfreezing is all or nothing, and that freeze
is not the server's to undo).
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
