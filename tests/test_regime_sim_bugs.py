"""Simulator failures the regime map found, kept as regression tests.

A data-parallel engine used to admit a prefill to the rank with the least prefill load
(``DPEngine._least_loaded_rank(with_prefill=True)`` ignores the rank's batch cap); when
the prefill ends, the turn joins that same rank (``req.rank`` is kept) even if its decode
batch is already full, while the engine-wide cap (``max_batch_per_rank * ranks``) still
lets it in. The rank then holds ``max_batch + 1`` sequences and the layout cost refuses
the step. Seen with Qwen3-235B-A22B, decode ``tp2-dp4-ep8`` (4 ranks of 256), 2,048
search trajectories on one decode slot. Each rank now schedules its own batch: a turn
waits for room on its rank.
"""

from __future__ import annotations

import pytest

from prorsa.experiments.cells import Cell, run_cell


def test_dp_decode_rank_never_exceeds_its_batch_cap():
    cell = Cell.of(
        scenario="search",
        mode="sync",
        policy="static",
        seed=0,
        num_slots=4,
        profile="h200-qwen3-235b-a22b-tp4",
        trajectories=2048,
        max_in_flight=2048,
        policy_params={"prefill_gpus": 24},
        layouts={"prefill": "tp2-dp2-ep4", "decode": "tp2-dp4-ep8", "colocated": "tp2-dp4-ep8"},
        series=False,
        record=False,
    )
    assert run_cell(cell)["objective"] > 0


def test_dp_rank_over_its_cap_in_a_mixed_step():
    # The same admission, seen in a step with prefill: the per-rank attention table is
    # indexed past max_batch (Qwen3-30B-A3B, decode tp1-dp4-ep4, 4,096 search trajectories).
    cell = Cell.of(
        scenario="search",
        mode="sync",
        policy="static",
        seed=0,
        num_slots=8,
        profile="h200-qwen3-30b-a3b-tp1",
        trajectories=4096,
        max_in_flight=4096,
        policy_params={"prefill_gpus": 28},
        layouts={"prefill": "tp1", "decode": "tp1-dp4-ep4", "colocated": "tp1-dp4-ep4"},
        series=False,
        record=False,
    )
    assert run_cell(cell)["objective"] > 0


def test_a_draw_too_long_for_the_layout_fails_its_cell_not_the_map():
    # Held-out seed 9 of Qwen3-30B-A3B mixed sync drew a trajectory of 68,929 tokens of
    # context where one layout's engine holds 68,892: that layout loses the draw (its
    # cell is recorded failed, named) and the map goes on.
    from prorsa.experiments.regimes import run_cell_recorded

    cell = Cell.of(
        scenario="swe", mode="sync", policy="colocate", seed=0, num_slots=2,
        trajectories=4, kv_capacity_tokens=2_000, series=False, record=False,
    )  # fmt: skip
    result = run_cell_recorded(cell)
    assert result["objective"] == float("inf") and result["infeasible"]
    assert result["error"].startswith("CapacityError: trajectory ")
    assert "2000 KV tokens" in result["error"]


def test_a_simulator_fault_stops_the_map_instead_of_scoring_a_loss(monkeypatch):
    # Found by review: any exception was recorded as an infinite objective, which moves
    # colocation's best layout or zeroes a policy's speedup.
    import prorsa.experiments.cells as cells
    from prorsa.experiments.regimes import run_cell_recorded

    def broken(cell):
        raise IndexError("a simulator bug")

    monkeypatch.setattr(cells, "run_cell", broken)
    with pytest.raises(IndexError, match="simulator bug"):
        run_cell_recorded(Cell.of(series=False, record=False))


def test_other_configuration_errors_still_stop_the_map():
    from prorsa.errors import ConfigError
    from prorsa.experiments.regimes import run_cell_recorded

    cell = Cell.of(policy="no-such-policy", series=False, record=False)
    with pytest.raises(ConfigError, match="no-such-policy"):
        run_cell_recorded(cell)
