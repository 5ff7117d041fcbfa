"""One small MLflow interface for everything that tracks runs (compare, tune, training).

Nothing is logged unless a tracking URI is given or tracking is asked for. Runs go through
an explicit ``MlflowClient`` for that URI: no global tracking URI is set and no active run
is started, so a program that embeds prorsa and has its own MLflow run open is never
disturbed.

    tracker = Tracker(resolve_uri(option, track=True))
    with tracker.run("compare", params=config, experiment="prorsa-compare") as run:
        run.log_metrics({"speedup": 1.2}, step=0)
        run.log_artifacts("out/compare")

Asking for tracking without a URI uses a local SQLite store, ``out/mlruns/mlflow.db``, with
artifacts beside it, so ``mlflow ui --backend-store-uri sqlite:///out/mlruns/mlflow.db``
shows it. (MLflow 3 refuses the old plain-folder store, hence the database file.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prorsa.errors import ConfigError

logger = logging.getLogger(__name__)

LOCAL_STORE = Path("out/mlruns")
DEFAULT_EXPERIMENT = "prorsa"


def local_store_uri(root: Path = LOCAL_STORE) -> str:
    """The SQLite tracking URI of a local store folder (created when first used)."""
    return f"sqlite:///{(root / 'mlflow.db').resolve()}"


def resolve_uri(uri: str | None = None, *, track: bool = False) -> str | None:
    """The URI to log to: ``uri``, else ``$MLFLOW_TRACKING_URI``, else the local store
    when ``track`` is set, else None (no tracking)."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return local_store_uri() if track else None


class TrackedRun:
    """An open MLflow run; every method is a no-op on the disabled tracker's run."""

    def __init__(self, client: Any | None, run_id: str | None) -> None:
        self._client = client
        self.run_id = run_id

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log parameters; nested dicts become dotted keys, values are stringified."""
        if self._client is None:
            return
        for key, value in _flat(params).items():
            self._client.log_param(self.run_id, key, str(value)[:500])

    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        """Log metrics at ``step``; None and NaN values are skipped."""
        if self._client is None:
            return
        for key, value in metrics.items():
            if value is not None and value == value:
                self._client.log_metric(self.run_id, _key(key), float(value), step=step or 0)

    def log_artifacts(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Upload a folder (or one file) as artifacts of this run."""
        if self._client is None:
            return
        path = Path(path)
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        elif path.is_file():
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self._client is None:
            return
        for key, value in tags.items():
            self._client.set_tag(self.run_id, key, str(value))


class Tracker:
    """Where runs are logged. ``Tracker(None)`` is disabled: its runs log nothing.

    Parameters
    ----------
    uri:
        MLflow tracking URI, or None for no tracking (see :func:`resolve_uri`).
    experiment:
        Experiment that runs go to unless :meth:`run` names another.
    """

    def __init__(self, uri: str | None, experiment: str = DEFAULT_EXPERIMENT) -> None:
        self.uri = uri
        self.experiment = experiment
        self._client: Any | None = None

    @property
    def enabled(self) -> bool:
        return self.uri is not None

    def client(self) -> Any:
        """The ``MlflowClient`` for this tracker's URI (created on first use)."""
        if self._client is None:
            try:
                from mlflow.tracking import MlflowClient
            except ImportError:
                raise ConfigError(
                    "MLflow tracking was asked for but mlflow is not installed",
                    hint="pip install 'prorsa[tune]', or drop --mlflow / MLFLOW_TRACKING_URI",
                ) from None
            if self.uri.startswith("sqlite:///"):
                Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def experiment_id(self, name: str | None = None) -> str:
        name = name or self.experiment
        client = self.client()
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        from mlflow.exceptions import MlflowException

        try:
            return client.create_experiment(name, artifact_location=self._artifact_location(name))
        except MlflowException:  # another process created it meanwhile
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _artifact_location(self, name: str) -> str | None:
        # A SQLite store keeps its artifacts beside the database file, not in the cwd.
        if not self.uri.startswith("sqlite:///"):
            return None
        root = Path(self.uri.removeprefix("sqlite:///")).resolve().parent
        return (root / "artifacts" / name).as_uri()

    @contextmanager
    def run(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        *,
        experiment: str | None = None,
        parent: TrackedRun | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> Iterator[TrackedRun]:
        """Open a run for the ``with`` block; it ends FINISHED, or FAILED / KILLED when the
        block raises. ``parent`` nests it under another run of this tracker."""
        if not self.enabled:
            yield TrackedRun(None, None)
            return
        client = self.client()
        all_tags = dict(tags or {})
        if parent is not None and parent.run_id is not None:
            all_tags["mlflow.parentRunId"] = parent.run_id
        created = client.create_run(self.experiment_id(experiment), run_name=name, tags=all_tags)
        run = TrackedRun(client, created.info.run_id)
        status = "FAILED"
        try:
            if params:
                run.log_params(params)
            yield run
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            client.set_terminated(run.run_id, status=status)
            logger.info("MLflow run %s (%s) %s in %s", name, run.run_id, status, self.uri)


def log_compare(
    result: dict,
    config: dict,
    report_dir: Path,
    tracking_uri: str,
    experiment: str = "prorsa-compare",
) -> str:
    """Log a comparison: one parent run with the report, a child run per (workload, mode,
    policy) row with its metrics. Returns the parent run id."""
    tracker = Tracker(tracking_uri, experiment)
    with tracker.run("compare", params=config) as parent:
        parent.log_artifacts(report_dir)
        for row in result["summary"]:
            name = f"{row['workload']}/{row['mode']}/{row['policy']}"
            with tracker.run(
                name,
                params={"workload": row["workload"], "mode": row["mode"], "policy": row["policy"]},
                parent=parent,
            ) as child:
                child.log_metrics(
                    {
                        k: row.get(k)
                        for k in ("objective", "speedup", "completion_s_p99", "switches", "wall_s")
                    }
                )
        return parent.run_id


def _key(name: str) -> str:
    # MLflow keys allow alphanumerics, _ - . / and spaces only.
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in str(name))


def _flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}."))
        else:
            out[_key(name)] = value
    return out
