"""Rerun a saved regime map's dynamic policies alone, on the plans the map recorded.

A change to a policy moves only that policy's cells: colocation's and best-static's do not
read its code, and neither do the plans (layouts and start) the map chose from them. So a
policy can be judged on the whole map by rerunning its held-out cells only, on each
regime's recorded ``run_plan`` and scoring seeds, and scoring them against the
colocation@best and best-static objectives the map recorded for the same seeds
(predictive: 405 of 6,066 cells, ~18 min on two cores against ~2 h for the map).

The summaries this returns are the saved ones with the rerun policies' numbers, speedups
and failed cells replaced (``rerun_from`` keeps the speedups and switches the map had,
``rerun_params`` the parameters), so the map's goals and headline read them unchanged.
What it does not redo: when the simulator itself changes, every cell moves and only a
full map is a result; and code the policies share (``prorsa/policy/demand.py``) moves
every policy that reads it, so rerun all of those.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prorsa.errors import ConfigError
from prorsa.experiments.cells import Cell
from prorsa.experiments.families import ModelFamily
from prorsa.experiments.held_out import mean_run, paired_speedup
from prorsa.experiments.regimes import (
    DYNAMIC_POLICIES,
    MapConfig,
    Regime,
    RunPlan,
    _cell,
    _Progress,
    plan_regime,
    run_cell_recorded,
    run_metrics,
)
from prorsa.experiments.sweep import Sweep


def rerun_policies(
    summaries: Sequence[dict],
    policies: Sequence[str],
    *,
    params: Mapping[str, dict] | None = None,
    forecaster: str,
    families: Mapping[str, ModelFamily] | None = None,
    workers: int = 0,
    address: str | None = None,
    cells_path: Path | None = None,
    resume: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Rerun ``policies`` (of :data:`DYNAMIC_POLICIES`) on every regime of ``summaries``
    (a map's saved regimes) and return the summaries with their results replaced.

    ``params`` maps a policy to parameters merged over the map's (its start and split);
    they are recorded in each summary's ``rerun_params``. ``forecaster`` and ``families``
    are the map's (its :class:`MapConfig`'s). Regimes without a valid baseline are
    returned unchanged.
    """
    from prorsa.policy.params import check_policy_param_groups

    unknown = sorted(set(policies) - set(DYNAMIC_POLICIES))
    if unknown or not policies or len(set(policies)) != len(policies):
        raise ConfigError(
            f"rerun policies must be distinct and among {', '.join(DYNAMIC_POLICIES)}; "
            f"got {list(policies)}"
        )
    if not isinstance(params or {}, Mapping) or not all(
        isinstance(p, Mapping) for p in (params or {}).values()
    ):
        raise ConfigError(f"policy parameters must map a policy to its parameters: {params!r}")
    stray = sorted(set(params or {}) - set(policies))
    if stray:
        raise ConfigError(f"parameters given for policies not rerun: {stray}")
    # Known keys and values, numbers as the map's cells hold them (before any cell runs).
    params = check_policy_param_groups(params or {}, policies=policies)
    jobs: list[tuple[int, str, int, Cell]] = []
    for i, summary in enumerate(summaries):
        if not summary.get("valid", True):
            continue
        regime = Regime(**summary["regime"])
        cfg = MapConfig(
            regimes=[regime],
            forecaster=forecaster,
            dynamic_policies=tuple(policies),
            families=dict(families or {}),
        )
        plan = plan_regime(regime, cfg)
        run = RunPlan(**summary["run_plan"])
        for policy in policies:
            merged = {
                "start": run.start,
                "prefill_fraction": run.prefill_fraction,
                **params.get(policy, {}),
            }
            for seed in summary["eval_seeds"]:
                cell = _cell(cfg, plan, policy, run.layouts, params=merged, seed=int(seed))
                jobs.append((i, policy, int(seed), cell))
    counter = _Progress(progress)
    with Sweep(
        workers=workers,
        address=address,
        results_path=cells_path,
        resume=resume,
        fn=run_cell_recorded,
    ) as sweep:
        results = counter.map(sweep, [cell for *_, cell in jobs])
    by_regime: dict[int, dict[str, dict[int, dict]]] = {}
    for (i, policy, seed, _), result in zip(jobs, results, strict=True):
        by_regime.setdefault(i, {}).setdefault(policy, {})[seed] = run_metrics(result)
    out = []
    for i, summary in enumerate(summaries):
        if i not in by_regime:
            out.append(summary)
            continue
        out.append(_rescored(summary, by_regime[i], params))
    return out


def _rescored(summary: dict, runs: dict[str, dict[int, dict]], params: Mapping) -> dict:
    """``summary`` with the rerun policies' numbers (every one :func:`mean_run` gives:
    a compact summary keeps fewer when saved), speedups and failed cells."""
    new = copy.deepcopy(summary)
    baseline = {int(s): v for s, v in summary["colocate_best"]["objective_by_seed"].items()}
    new["rerun_from"] = {
        policy: {
            "speedup": summary["speedup"].get(policy),
            "switches": summary.get("policies", {}).get(policy, {}).get("switches"),
        }
        for policy in runs
    }
    new["rerun_params"] = {policy: dict(params.get(policy, {})) for policy in runs}
    labelled = summary.get("colocate", {}).get(summary["colocate_baseline"]["layout"])
    # Seeds keyed as the summary keys them (strings once saved as JSON), so that the
    # report code pairs the new runs with the saved ones.
    saved_key = type(next(iter(summary["colocate_best"]["objective_by_seed"])))
    for policy, by_seed in runs.items():
        run = mean_run(by_seed)
        paired = paired_speedup(baseline, run["objective_by_seed"])
        run["objective_by_seed"] = {saved_key(s): v for s, v in run["objective_by_seed"].items()}
        new.setdefault("policies", {})[policy] = run
        new["speedup"][policy] = paired["speedup"]
        new["speedup_ci95"][policy] = paired["ci95"]
        new["speedup_by_seed"][policy] = {saved_key(s): v for s, v in paired["by_seed"].items()}
        if labelled is not None and new.get("speedup_vs_baseline"):
            by_seed = {int(s): v for s, v in labelled["objective_by_seed"].items()}
            ran = {int(s): v for s, v in run["objective_by_seed"].items()}
            vs = paired_speedup(by_seed, ran)["speedup"]
            new["speedup_vs_baseline"][policy] = vs
        # A policy's entry in failed_cells is its name (summarise_regime).
        failed = [f for f in new.get("failed_cells", []) if f != policy]
        new["failed_cells"] = failed + ([policy] if "error" in run else [])
    return new
