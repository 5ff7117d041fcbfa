"""Helpers shared by benchmark scripts: machine description and result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
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
