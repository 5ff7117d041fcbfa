"""Compiled tree inference gives LightGBM's own predictions, and falls back cleanly."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from prorsa.forecast import compiled_trees, lgbm

pytest.importorskip("tl2cgen")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture()
def booster():
    """A small regression booster with a categorical column (like the per-turn models)."""
    rng = np.random.default_rng(3)
    x = rng.gamma(2.0, 50.0, size=(3000, 6))
    x[:, 0] = rng.integers(0, 5, size=3000)  # task code
    x[rng.random(x.shape) < 0.05] = np.nan
    x[:, 0] = np.nan_to_num(x[:, 0])
    y = np.log1p(np.nan_to_num(x[:, 1])) + 0.3 * x[:, 0] + rng.normal(0, 0.1, 3000)
    return lgbm.train(
        x,
        y,
        objective="regression",
        seed=0,
        n_estimators=40,
        learning_rate=0.1,
        num_leaves=15,
        min_child_samples=20,
        categorical=[0],
    )


def _rows(n: int, seed: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.gamma(2.0, 50.0, size=(n, 6))
    x[:, 0] = rng.integers(0, 7, size=n)  # codes the model never saw included
    x[rng.random(x.shape) < 0.1] = np.nan
    x[:, 0] = np.nan_to_num(x[:, 0])
    return x


@needs_gcc
def test_compiled_predictions_equal_lightgbm(booster, tmp_path, monkeypatch):
    monkeypatch.setenv("PRORSA_CACHE_DIR", str(tmp_path))
    assert compiled_trees.warm([booster], timeout_s=120)
    x = _rows(2000)
    compiled = compiled_trees.compiled_for(booster)
    assert compiled is not None
    np.testing.assert_array_equal(compiled.predict(x), booster.predict(x, num_threads=1))
    # The online entry point uses it for large batches, LightGBM for small ones: same values.
    np.testing.assert_array_equal(lgbm.predict_online(booster, x), booster.predict(x))
    np.testing.assert_array_equal(lgbm.predict_online(booster, x[:3]), booster.predict(x[:3]))
    # One library per model text, reused by a new predictor of the same model.
    libs = list((tmp_path / "trees").glob("*.so"))
    assert [p.stem for p in libs] == [compiled.digest]
    again = compiled_trees.CompiledBooster(booster)
    assert again.wait(timeout_s=30)
    assert list((tmp_path / "trees").glob("*.so")) == libs


def test_without_a_compiler_lightgbm_predicts(booster, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRORSA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_trees.shutil, "which", lambda name: None)
    assert not compiled_trees.warm([booster], timeout_s=30)
    assert "compiled tree inference unavailable" in caplog.text
    x = _rows(1000)
    np.testing.assert_array_equal(lgbm.predict_online(booster, x), booster.predict(x))
    assert not list(tmp_path.rglob("*.so"))


def test_switched_off_by_environment(booster, monkeypatch):
    monkeypatch.setenv("PRORSA_COMPILED_TREES", "0")
    assert compiled_trees.compiled_for(booster) is None
    assert not compiled_trees.warm([booster])


@needs_gcc
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_compiled_predictions_do_not_depend_on_the_thread_count(
    booster, tmp_path, monkeypatch, threads
):
    monkeypatch.setenv("PRORSA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PRORSA_FORECAST_THREADS", threads)
    compiled = compiled_trees.CompiledBooster(booster)
    assert compiled.wait(timeout_s=120)
    assert compiled.threads == min(int(threads), os.cpu_count() or 1)
    x = _rows(2000)
    np.testing.assert_array_equal(compiled.predict(x), booster.predict(x, num_threads=1))
    # A call may ask for another pool size (the library loaded again with it): same values.
    np.testing.assert_array_equal(compiled.predict(x, threads=1), compiled.predict(x))


def test_forecast_threads_reads_the_environment(monkeypatch):
    from prorsa.errors import ConfigError
    from prorsa.forecast.threads import forecast_threads

    monkeypatch.delenv("PRORSA_FORECAST_THREADS", raising=False)
    assert forecast_threads() == min(2, os.cpu_count() or 1)
    monkeypatch.setenv("PRORSA_FORECAST_THREADS", "3")
    assert forecast_threads() == min(3, os.cpu_count() or 1)  # at most the machine's cores
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv("PRORSA_FORECAST_THREADS", bad)
        with pytest.raises(ConfigError, match="PRORSA_FORECAST_THREADS"):
            forecast_threads()


def test_a_bad_thread_setting_is_the_callers_error(booster, monkeypatch):
    from prorsa.errors import ConfigError

    monkeypatch.setenv("PRORSA_FORECAST_THREADS", "none")
    with pytest.raises(ConfigError, match="PRORSA_FORECAST_THREADS"):
        compiled_trees.CompiledBooster(booster)
