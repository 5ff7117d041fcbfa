"""Scoring on held-out seeds: paired speedups, their interval, and runs over seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from prorsa.experiments.held_out import geometric_mean, mean_run, paired_speedup


def test_paired_speedup_is_the_geometric_mean_of_per_seed_ratios_with_a_t_interval():
    baseline = {1: 100.0, 2: 50.0, 3: 80.0}
    policy = {1: 80.0, 2: 50.0, 3: 64.0, 9: 1.0}  # seed 9 has no baseline: left out
    out = paired_speedup(baseline, policy)
    logs = np.log([1.25, 1.0, 1.25])
    assert out["by_seed"] == {1: 1.25, 2: 1.0, 3: 1.25}
    assert out["speedup"] == pytest.approx(math.exp(logs.mean()))
    half = stats.t.ppf(0.975, 2) * logs.std(ddof=1) / math.sqrt(3)
    assert out["ci95"] == pytest.approx(
        [math.exp(logs.mean() - half), math.exp(logs.mean() + half)]
    )
    # the interval is about the pairing: the same ratio on every seed has no width,
    # however different the seeds' makespans are
    same = paired_speedup({1: 10.0, 2: 1000.0}, {1: 5.0, 2: 500.0})
    assert same["speedup"] == pytest.approx(2.0) and same["ci95"] == pytest.approx([2.0, 2.0])
    assert paired_speedup({1: 10.0}, {1: 5.0})["ci95"] is None  # one seed: no interval


def test_a_failed_seed_makes_the_speedup_zero_and_names_itself():
    failed = paired_speedup({1: 10.0, 2: 10.0}, {1: 5.0, 2: math.inf})
    assert failed["speedup"] == 0.0 and failed["ci95"] is None
    with pytest.raises(ValueError, match="no seed"):
        paired_speedup({1: 1.0}, {2: 1.0})
    run = mean_run({1: {"objective": 5.0}, 2: {"objective": math.inf, "error": "ValueError: x"}})
    assert run["objective"] == math.inf and run["error"] == "seed 2: ValueError: x"
    assert run["objective_by_seed"] == {1: 5.0, 2: math.inf}


def test_mean_run_averages_numbers_and_per_role_dicts():
    run = mean_run(
        {
            2: {"objective": 4.0, "switches": 1, "by_role": {"prefill": 2.0}, "hit": None},
            1: {"objective": 2.0, "switches": 0, "by_role": {"prefill": 4.0}, "hit": 0.5},
        }
    )
    # the objective's geometric mean (speedups are ratios of it), other numbers' mean
    assert run["objective"] == pytest.approx(math.sqrt(8.0)) and run["switches"] == 0.5
    assert run["by_role"] == {"prefill": 3.0}
    assert run["hit"] is None  # not known on every seed
    assert run["objective_by_seed"] == {1: 2.0, 2: 4.0}
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert geometric_mean([1.0, math.inf]) == math.inf
