"""Optional MLflow logging of forecaster training and backtests.

Nothing is logged unless a tracking URI is given (``--mlflow URI`` or the
``MLFLOW_TRACKING_URI`` environment variable), and then only through an explicit
``MlflowClient`` for that URI: no global tracking state is set and no run is left open
behind the caller's back.
"""

from __future__ import annotations

import os
from pathlib import Path

from prorsa.errors import ConfigError

EXPERIMENT = "prorsa-forecast"


def tracking_uri(option: str | None) -> str | None:
    """The URI to log to: the option, else ``MLFLOW_TRACKING_URI``, else None (no logging)."""
    return option or os.environ.get("MLFLOW_TRACKING_URI") or None


def log_run(
    uri: str,
    *,
    run_name: str,
    params: dict,
    metrics: dict[str, float],
    artifacts: str | os.PathLike[str] | None = None,
    tags: dict[str, str] | None = None,
) -> str:
    """Log one finished run (params, metrics, a folder of artifacts); returns its run id."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError(
            "MLflow logging was asked for but mlflow is not installed",
            hint="pip install 'prorsa[tune]' or drop --mlflow / MLFLOW_TRACKING_URI",
        ) from None
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(EXPERIMENT)
    run = client.create_run(exp_id, run_name=run_name, tags=tags or {})
    run_id = run.info.run_id
    status = "FAILED"
    try:
        for key, value in _flat(params).items():
            client.log_param(run_id, key, str(value)[:500])
        for key, value in metrics.items():
            if value == value:  # skip NaN
                client.log_metric(run_id, _key(key), float(value))
        if artifacts is not None and Path(artifacts).exists():
            client.log_artifacts(run_id, str(artifacts), artifact_path="model")
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status=status)
    return run_id


def _key(name: str) -> str:
    # MLflow keys allow alphanumerics, _ - . / and spaces only.
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def _flat(params: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[_key(name)] = value
    return out
