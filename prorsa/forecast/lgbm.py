"""Small LightGBM helpers shared by the LightGBM forecasters (imported lazily)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
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
    valid: tuple[np.ndarray, np.ndarray] | None = None,
    early_stopping_rounds: int = 15,
):
    """Train one booster deterministically on one thread (the machine is shared).

    ``init_score`` is an offset the trees correct (add it back after ``predict``).
    ``valid`` (x, y): stop adding trees once the loss there has not improved for
    ``early_stopping_rounds``; the booster's ``best_iteration`` says how many helped.
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
    if valid is None:
        return lgb.train(params, data, num_boost_round=n_estimators)
    check = lgb.Dataset(
        valid[0], valid[1], reference=data, categorical_feature=categorical or "auto"
    )
    return lgb.train(
        params,
        data,
        num_boost_round=n_estimators,
        valid_sets=[check],
        callbacks=[lgb.early_stopping(early_stopping_rounds, verbose=False)],
    )


def predict(booster, x: np.ndarray) -> np.ndarray:
    # One thread: per-tick batches are small and the thread pool start-up costs more.
    return booster.predict(x, num_threads=1)


def predict_online(booster, x: np.ndarray, threads: int | None = None) -> np.ndarray:
    """:func:`predict` on a controller's hot path: large batches go to the booster's
    compiled library once it is built (same values, see :mod:`compiled_trees`), on
    ``threads`` threads (default: the library's own count)."""
    from prorsa.forecast import compiled_trees

    if len(x) >= compiled_trees.MIN_ROWS:
        compiled = compiled_trees.compiled_for(booster)
        if compiled is not None:
            return compiled.predict(x, threads)
    return predict(booster, x)


BOOSTERS_FORMAT = "prorsa-boosters/2"


def save_boosters(boosters: dict[str, object], path: Path) -> str:
    """Write ``{key: booster}`` as one gzipped JSON of LightGBM model strings, each with its
    SHA-256 (checked on load: LightGBM crashes the process on a damaged model string)."""
    text = {key: b.model_to_string() for key, b in boosters.items()}
    payload = {
        "format": BOOSTERS_FORMAT,
        "models": text,
        "sha256": {key: hashlib.sha256(s.encode()).hexdigest() for key, s in text.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same models give the same bytes (reproducible shipped files).
    data = json.dumps(payload).encode("utf-8")
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f,
    ):
        f.write(data)
    return path.name


def load_boosters(path: Path, required: tuple[str, ...] = ()) -> dict[str, object]:
    """Boosters saved by :func:`save_boosters`; ``required`` keys must be present.

    Every model string is checked (digest, and that it is complete) before LightGBM
    parses it. Raises InputError naming the file (and the key) for a missing, truncated or
    damaged file.
    """
    from prorsa.errors import InputError
    from prorsa.forecast.model_folder import read_gzip_json

    lgb = lightgbm()
    if not path.is_file():
        raise InputError("model file missing", source=str(path))
    payload = read_gzip_json(path)
    digests: dict = {}
    if isinstance(payload, dict) and payload.get("format") == BOOSTERS_FORMAT:
        models, digests = payload.get("models"), payload.get("sha256")
        if not isinstance(digests, dict):
            raise InputError("digests missing", source=str(path), field="sha256")
    else:
        models = payload  # first format: the object of model strings itself
    if not isinstance(models, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in models.items()
    ):
        raise InputError(
            "expected an object of LightGBM model strings", source=str(path), field="models"
        )
    missing = [k for k in required if k not in models]
    if missing:
        raise InputError(
            f"model(s) {', '.join(missing[:3])} missing", source=str(path), field=missing[0]
        )
    out = {}
    for key, model in models.items():
        if digests and hashlib.sha256(model.encode()).hexdigest() != digests.get(key):
            raise InputError("model string does not match its digest", source=str(path), field=key)
        if not complete_model_string(model):
            raise InputError("truncated or damaged model string", source=str(path), field=key)
        try:
            out[key] = lgb.Booster(model_str=model)
        except (lgb.basic.LightGBMError, ValueError) as exc:
            raise InputError(
                f"LightGBM cannot read this model: {exc}", source=str(path), field=key
            ) from None
    return out


def complete_model_string(model: str) -> bool:
    """Whether a LightGBM model string is whole: its header's ``tree_sizes`` add up to the
    tree section, one ``Tree=`` per size, and the trailer is there."""
    if not model.startswith("tree\n") or "end of parameters" not in model:
        return False
    match = re.search(r"^tree_sizes=([0-9 ]*)$", model, re.M)
    first = model.find("Tree=0\n")
    end = model.find("end of trees")
    if match is None or first < 0 or end < 0:
        return False
    sizes = [int(x) for x in match.group(1).split()]
    return end - first == sum(sizes) and model.count("\nTree=") == len(sizes)


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
