"""Optional MLflow logging. Nothing is logged unless a tracking URI is given explicitly."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def log_compare(
    result: dict,
    config: dict,
    report_dir: Path,
    tracking_uri: str,
    experiment: str = "prorsa-compare",
) -> str:
    """Log a comparison to MLflow: one parent run with the report, a child run per
    (workload, mode, policy) row with its metrics. Returns the parent run id."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name="compare") as parent:
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})
        mlflow.log_artifacts(str(report_dir))
        for row in result["summary"]:
            name = f"{row['workload']}/{row['mode']}/{row['policy']}"
            with mlflow.start_run(run_name=name, nested=True):
                mlflow.log_params(
                    {"workload": row["workload"], "mode": row["mode"], "policy": row["policy"]}
                )
                metrics = {
                    k: float(row[k])
                    for k in ("objective", "speedup", "completion_s_p99", "switches", "wall_s")
                    if row.get(k) is not None
                }
                mlflow.log_metrics(metrics)
        return parent.info.run_id
