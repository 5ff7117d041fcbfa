"""Helpers shared by benchmark scripts: machine description, result files, GC pauses."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, object]:
    """Where the numbers were measured."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        # Edits to the code (not to earlier results) mean the commit alone does not say
        # what ran.
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "prorsa", "benchmarks", "datasets",
             ":(exclude)benchmarks/results"],
            capture_output=True, text=True, check=False, cwd=RESULTS.parents[1],
        ).stdout.strip()  # fmt: skip
        commit += "+uncommitted" if commit and dirty else ""
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "commit": commit,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def save(name: str, payload: dict) -> Path:
    """Write ``results/<name>.json`` with the machine description attached."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=float) + "\n")
    return path


class CollectionTimer:
    """Times Python's garbage collections in this process, by the phase set in
    :attr:`phase` when each one ran (a benchmark names its phases as it goes)."""

    def __init__(self, phase: str = "") -> None:
        self.phase = phase
        self._pauses: dict[str, list[tuple[int, float]]] = {}
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, stage: str, info: dict) -> None:
        if stage == "start":
            self._began = time.perf_counter()
            return
        pause = time.perf_counter() - self._began
        self._pauses.setdefault(self.phase, []).append((info["generation"], pause))

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self, phase: str) -> dict[str, float | int]:
        """Collections during ``phase``: how many (and how many full ones), total and
        longest pause in ms."""
        pauses = self._pauses.get(phase, [])
        return {
            "collections": len(pauses),
            "full_collections": sum(1 for generation, _ in pauses if generation == 2),
            "total_ms": round(1e3 * sum(p for _, p in pauses), 1),
            "max_ms": round(1e3 * max((p for _, p in pauses), default=0.0), 1),
        }
