"""Small LightGBM helpers shared by the LightGBM forecasters (imported lazily)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError


def lightgbm():
    """The lightgbm module, or a ConfigError with an install hint."""
    try:
        import lightgbm
    except ImportError:  # pragma: no cover - lightgbm is a core dependency
        raise ConfigError(
            "lightgbm is not installed", hint="pip install lightgbm (a prorsa dependency)"
        ) from None
    return lightgbm


def train(
    x: np.ndarray,
    y: np.ndarray,
    *,
    objective: str,
    seed: int,
    n_estimators: int,
    learning_rate: float,
    num_leaves: int,
    min_child_samples: int,
    alpha: float | None = None,
    categorical: list[int] | None = None,
    feature_names: list[str] | None = None,
    init_score: np.ndarray | None = None,
):
    """Train one booster deterministically on one thread (the machine is shared).

    ``init_score`` is an offset the trees correct (add it back after ``predict``).
    """
    lgb = lightgbm()
    params = {
        "objective": objective,
        "learning_rate": learning_rate,
        "num_leaves": num_leaves,
        "min_child_samples": min_child_samples,
        "feature_fraction": 0.9,
        "bagging_fraction": 0.9,
        "bagging_freq": 1,
        "seed": seed,
        "deterministic": True,
        "force_row_wise": True,
        "num_threads": 1,
        "verbose": -1,
    }
    if alpha is not None:
        params["alpha"] = alpha
    data = lgb.Dataset(
        x,
        y,
        feature_name=feature_names or "auto",
        categorical_feature=categorical or "auto",
        init_score=init_score,
        free_raw_data=True,
    )
    return lgb.train(params, data, num_boost_round=n_estimators)


def predict(booster, x: np.ndarray) -> np.ndarray:
    # One thread: per-tick batches are small and the thread pool start-up costs more.
    return booster.predict(x, num_threads=1)


def save_boosters(boosters: dict[str, object], path: Path) -> str:
    """Write ``{key: booster}`` as one gzipped JSON of LightGBM model strings."""
    text = {key: b.model_to_string() for key, b in boosters.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same models give the same bytes (reproducible shipped files).
    data = json.dumps(text).encode("utf-8")
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f,
    ):
        f.write(data)
    return path.name


def load_boosters(path: Path) -> dict[str, object]:
    from prorsa.errors import InputError

    lgb = lightgbm()
    if not path.exists():
        raise InputError("model file missing", source=str(path))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = json.load(f)
    return {key: lgb.Booster(model_str=s) for key, s in text.items()}


def check_width(booster, expected: int, *, source: str) -> None:
    """Refuse a booster whose inputs differ from what this version of prorsa builds."""
    from prorsa.errors import InputError

    got = booster.num_feature()
    if got != expected:
        raise InputError(
            f"model expects {got} input features, this prorsa builds {expected}",
            source=source,
            hint="it was saved by another version of prorsa: retrain it "
            "(`prorsa forecast ship` regenerates the shipped models)",
        )
