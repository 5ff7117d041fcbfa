from __future__ import annotations

import pytest

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell
from prorsa.tune import TuneConfig, tune


def _base(tmp_path):
    return Cell(
        scenario="search",
        trace=None,
        mode="sync",
        policy="static",
        seed=0,
        engines=4,
        profile="h200-qwen2.5-7b-tp1",
        trajectories=24,
        group_size=4,
    )


def test_study_persists_and_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    cfg = TuneConfig(policy="static", base=_base(tmp_path), trials=3, seeds=1, storage=storage)
    first = tune(cfg)
    assert len(first.trials) == 3
    assert 0.05 <= first.best_params["prefill_fraction"] <= 0.75
    again = tune(
        TuneConfig(policy="static", base=_base(tmp_path), trials=5, seeds=1, storage=storage)
    )
    assert len(again.trials) == 5  # two more, the first three kept
    assert again.best_value <= first.best_value


def test_tune_rejects_bad_config(tmp_path):
    with pytest.raises(ConfigError):
        tune(TuneConfig(policy="nope", base=_base(tmp_path)))
    with pytest.raises(ConfigError):
        tune(TuneConfig(policy="static", base=_base(tmp_path), trials=0))
