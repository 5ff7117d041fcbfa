"""Native code for LightGBM boosters on large batches (treelite + tl2cgen).

The per-turn models of ``lightgbm-trajectory`` score every turn that started since the
last tick: ~2,700 rows per 1 s tick at 10,000 live trajectories, ~4 ms per booster in
LightGBM's own predictor on one thread. tl2cgen turns a booster into C, compiles it with
the system's C compiler, and predicts the same values (exactly: same thresholds, same
float64 sums) 4-5x faster on such batches (benchmarks/results/decision_latency.json).

Compilation takes ~1 s per booster, so it runs in a background thread the first time a
booster sees a large batch; LightGBM answers until the library is ready, and always
answers small batches (where a call costs ~50 us either way). Libraries are cached under
``$PRORSA_CACHE_DIR/trees`` (default ``~/.cache/prorsa/trees``), named by the SHA-256 of
the model text, so shipped models compile once per machine. Without a C compiler, or
with ``PRORSA_COMPILED_TREES=0``, everything stays in LightGBM (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

from prorsa.forecast.threads import forecast_threads

log = logging.getLogger(__name__)

#: Batches at least this large go to the compiled library once it is ready; below it a
#: LightGBM call costs about as much as the compiled one (~50 us, mostly call overhead).
MIN_ROWS = 256


def enabled() -> bool:
    """Whether compiled inference may be used (``PRORSA_COMPILED_TREES=0`` turns it off)."""
    return os.environ.get("PRORSA_COMPILED_TREES", "1") not in ("0", "false", "no")


def cache_dir() -> Path:
    root = os.environ.get("PRORSA_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "prorsa"
    return base / "trees"


class CompiledBooster:
    """One booster's compiled predictor, built in the background on first demand."""

    def __init__(self, booster) -> None:
        self._text = booster.model_to_string()
        self.digest = hashlib.sha256(self._text.encode()).hexdigest()
        self._predictor = None
        self._path: Path | None = None
        self._by_threads: dict[int, object] = {}  # predictors on other thread counts
        # Read here, on the caller's thread: a bad setting is the caller's error, not a
        # failed build (which would fall back to LightGBM quietly).
        self.threads = forecast_threads()
        self._failed = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self._predictor is not None

    def start(self) -> None:
        """Start compiling (or loading the cached library) unless already under way."""
        with self._lock:
            if self._thread is not None or self._failed:
                return
            self._thread = threading.Thread(
                target=self._build, name=f"prorsa-trees-{self.digest[:8]}", daemon=True
            )
            self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the build has finished; True when the compiled path is ready."""
        self.start()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.ready

    def predict(self, x: np.ndarray, threads: int | None = None) -> np.ndarray:
        """Raw scores of ``x`` (rows x features), as ``Booster.predict`` gives them, on
        ``threads`` threads (default: :func:`forecast_threads` when built). Every row is
        scored the same way whatever the count."""
        import tl2cgen

        predictor = self._predictor
        if threads is not None and threads != self.threads:
            predictor = self._by_threads.get(threads)
            if predictor is None:  # the same library, loaded with another pool size
                predictor = tl2cgen.Predictor(str(self._path), nthread=threads)
                self._by_threads[threads] = predictor
        return predictor.predict(tl2cgen.DMatrix(np.asarray(x, np.float64))).reshape(-1)

    def _build(self) -> None:
        try:
            import tl2cgen

            path = cache_dir() / f"{self.digest}.so"
            if not path.is_file():
                _compile(self._text, path)
            self._path = path
            if self.threads > 1:  # for scoring beside other work (trajectory.py), ready too
                self._by_threads[1] = tl2cgen.Predictor(str(path), nthread=1)
            self._predictor = tl2cgen.Predictor(str(path), nthread=self.threads)
        except Exception as error:  # no compiler, no tl2cgen, unsupported model
            self._failed = True
            log.warning("compiled tree inference unavailable, LightGBM predicts: %s", error)
        finally:
            self._text = ""  # not needed any more


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _native_log(message: bytes) -> None:
    log.debug("tl2cgen: %s", message.decode("utf-8", "replace").strip())


def _quiet_tl2cgen() -> None:
    """Send tl2cgen's native log lines to logging: it prints them to stdout, from the
    build thread, into whatever a command is writing there (JSON included)."""
    from tl2cgen import libloader

    libloader._LIB.TL2cgenRegisterLogCallback(_native_log)


def _compile(model_text: str, path: Path) -> None:
    """Compile a LightGBM model (its text) to the shared library ``path``, atomically:
    concurrent processes may build the same model."""
    import tl2cgen
    import treelite

    _quiet_tl2cgen()

    if shutil.which("gcc") is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source = Path(tmp) / "model.txt"
        source.write_text(model_text)
        model = treelite.frontend.load_lightgbm_model(str(source))
        staged = Path(tmp) / path.name
        tl2cgen.export_lib(model, toolchain="gcc", libpath=str(staged), nthread=1)
        os.replace(staged, path)


# Keyed by the booster object itself (weakly: a booster dropped frees its entry; ids are
# reused). Not an attribute on the booster, which must stay picklable.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILED_LOCK = threading.Lock()


def compiled_for(booster) -> CompiledBooster | None:
    """The compiled predictor of ``booster`` if ready, starting its build if not."""
    if not enabled():
        return None
    with _COMPILED_LOCK:
        entry = _COMPILED.get(booster)
        if entry is None:
            entry = _COMPILED[booster] = CompiledBooster(booster)
    if entry.ready:
        return entry
    entry.start()
    return None


def warm(boosters, timeout_s: float | None = None) -> bool:
    """Build (or load) the compiled libraries of ``boosters`` now and wait for them; True
    when all are ready (False when compilation is off or unavailable)."""
    if not enabled():
        return False
    entries = []
    for booster in boosters:
        compiled_for(booster)
        with _COMPILED_LOCK:
            entries.append(_COMPILED[booster])
    return all([entry.wait(timeout_s) for entry in entries])
