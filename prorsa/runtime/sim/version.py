"""What a simulated result depends on, as one hash: the code that runs and the data it reads.

Two things key on it: a kept forecaster training set (``prorsa forecast ship --keep-data``
reuses it only when made by the same simulator) and every sweep cell's result
(:meth:`prorsa.experiments.cells.Cell.key`): a result computed by other simulator code,
profiles, workloads or traces is never reused.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path

#: Package paths whose code never runs in a simulated result: serving, the command line,
#: trainer integrations, the modules that only format results already computed
#: (tables, plots) or schedule and score cells the simulator runs (the policy rerun), so
#: mending a report does not make a map recompute its cells.
#: Everything else of the package counts (simulator, cluster model, controller, policies,
#: workloads, forecasters and their features, telemetry, the experiments that turn a run
#: into its objective, the forecaster recipe).
NOT_SIMULATOR_CODE = (
    "serve",
    "cli",
    "integrations",
    "experiments/policy_rerun.py",
    "experiments/regime_report.py",
    "experiments/report.py",
)


def is_simulator_code(relative: Path) -> bool:
    """Whether the package file at ``relative`` (to the package root) counts in
    :func:`simulator_hash`: everything but :data:`NOT_SIMULATOR_CODE`."""
    return not any(
        relative.parts[: len(Path(part).parts)] == Path(part).parts for part in NOT_SIMULATOR_CODE
    )


def simulator_version() -> dict[str, str]:
    """prorsa's version, a SHA-256 over everything a simulated run reads, and the commit.

    The hash covers the package's code but :data:`NOT_SIMULATOR_CODE` and the data it
    reads: the ``datasets/`` folder (cost profiles and layouts, model configs, workload
    profiles, the traces replayed). A code change, refit profile or workload changes it.
    """
    import prorsa
    from prorsa.workload.scenarios import datasets_dir

    root = Path(prorsa.__file__).resolve().parent
    data = datasets_dir().resolve()
    digest = hashlib.sha256()
    code = [f for f in root.rglob("*.py") if is_simulator_code(f.relative_to(root))]
    for base, files in ((root, sorted(code)), (data, sorted(data.rglob("*")))):
        for file in files:
            if file.is_file() and "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(base)).encode())
                digest.update(file.read_bytes())
    commit = _git(root, "rev-parse", "--short", "HEAD")
    # Uncommitted edits to any of it: the commit alone would not reproduce the data.
    excluded = [f":(exclude){part}" for part in NOT_SIMULATOR_CODE]
    dirty = bool(_git(root, "status", "--porcelain", "--", ".", *excluded, str(data)))
    return {
        "prorsa": prorsa.__version__,
        "source_sha256": digest.hexdigest(),
        "commit": commit + ("+uncommitted" if dirty else ""),
    }


@functools.cache
def simulator_hash() -> str:
    """:func:`simulator_version`'s hash, computed once per process (~1 s): what result
    keys carry."""
    return simulator_version()["source_sha256"]


def models_dir() -> Path:
    """The repository's shipped ``models/`` folder (override with ``PRORSA_MODELS``)."""
    env = os.environ.get("PRORSA_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "models"


def model_fingerprint(name_or_path: str) -> str | None:
    """SHA-256 of the ``manifest.json`` of a model folder or shipped model (its
    parameters, data hash and metrics), or None for a forecaster without one (a
    data-free baseline)."""
    for folder in (Path(name_or_path), models_dir() / name_or_path):
        try:
            return hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
        except OSError:
            continue
    return None


def _git(cwd: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
