"""The regime map and the three mechanism experiments, with the issue's goals.

Runs ``prorsa explore``'s full grid (or ``--quick``) through the sweep runner (local Ray
with one worker per CPU, or ``--address``), resumable from
benchmarks/results/regimes/cells.jsonl, and writes:

* benchmarks/results/regimes.json: per regime the speedups of best-static, predictive,
  mpc and oracle over colocation at its best layout (and over colocation at TP1 or the
  smallest TP, labelled), every plan chosen on seed 0 and scored on held-out seeds 9-11
  (geometric mean of paired ratios, 95% interval), the headline per model, the goals
  cell by cell, the mechanisms;
* benchmarks/results/regimes/: report.md, a heatmap per model, mechanism plots;
* docs/img/regimes-*.png and the README's headline table (between its
  ``regime-map`` markers), so the README shows the map's summary, never typed by hand.

    .venv/bin/python benchmarks/regimes_bench.py              # full map (~1 h on 2 idle cores)
    .venv/bin/python benchmarks/regimes_bench.py --quick      # minutes
    .venv/bin/python benchmarks/regimes_bench.py --regime "qwen3-30b-a3b tau2 sync 64/GPU"

``--regime LABEL`` (repeatable) reruns regimes of the full grid alone, on the code and
models checked out, into benchmarks/results/regimes-rerun.json (its cells in
benchmarks/results/regimes/rerun-cells.jsonl): a check of one regime after a change,
which leaves the map's own files as they are.

``--rerun-policies predictive[,mpc]`` reruns only those policies' held-out cells of every
regime in regimes.json, on the plans and seeds the map recorded, and scores them against
the colocation@best and best-static the map recorded
(:mod:`prorsa.experiments.policy_rerun`): a policy change judged on the whole map in
405 of its 6,066 cells. ``--policy-params '{"predictive": {...}}'`` runs them with other
parameters. It writes benchmarks/results/regimes-policies.json (goals before and after,
the regimes that moved) and leaves the map's files alone, unless ``--apply`` (default
parameters only): then the rerun policies' results replace the map's in regimes.json and
regimes/results.json (``policies_rerun`` records the commit) and report.md and the README
are redone, as after a policy change that leaves the simulator as it was.
``--forecaster NAME`` with ``--rerun-policies predictive,mpc --apply`` changes the map's
forecaster: only those two policies read it, and the plans do not. It warns when
simulator code outside the policies changed since the map's commit (then the rerun is
not exact).

    .venv/bin/python benchmarks/regimes_bench.py --rerun-policies predictive   # ~18 min
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS, machine, save
from prorsa.experiments import DEFAULT_FORECASTER, mechanisms
from prorsa.experiments.grids import get_grid, select
from prorsa.experiments.regime_report import (
    FDR,
    POLICY_NUMBERS,
    chance_pays,
    colocate_misses_by_cause,
    headline,
    headline_markdown,
    pays,
    pays_at_fdr,
    write_map_report,
)
from prorsa.experiments.regimes import MapConfig, Regime, goals, run_map
from prorsa.io import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
OUT = RESULTS / "regimes"
IMG = REPO / "docs" / "img"
README = REPO / "README.md"
START, END = "<!-- regime-map:start -->", "<!-- regime-map:end -->"
TITLE = "Regime map (benchmarks/regimes_bench.py)"


def compact(summary: dict) -> dict:
    """A regime's summary without per-split detail (regimes.json stays readable)."""
    keep = (
        "label",
        "regime",
        "variant",
        "gpus",
        "shape",
        "eval_seeds",
        "selection",
        "planned_layouts",
        "run_plan",
        "colocate_best",
        "colocate_baseline",
        "planner_colocated_regret",
        "best_static",
        "speedup",
        "speedup_ci95",
        "speedup_by_seed",
        "speedup_vs_baseline",
        "ceiling",
        "valid",
        "failed_cells",
    )
    out = {k: summary[k] for k in keep if k in summary}
    if out["best_static"]:
        out["best_static"] = {
            k: v for k, v in out["best_static"].items() if k != "objective_by_prefill_slots"
        }
    out["colocate"] = {
        k: {"objective": v["objective"], "objective_by_seed": v["objective_by_seed"]}
        for k, v in summary["colocate"].items()
    }
    out["policies"] = {
        name: {k: p.get(k) for k in POLICY_NUMBERS if k in p}
        for name, p in summary["policies"].items()
    }
    return out


def update_readme(summaries: list[dict]) -> bool:
    """Replace the README's block between the regime-map markers with the headline."""
    text = README.read_text()
    if START not in text or END not in text:
        return False
    block = (
        f"{START}\n{headline_markdown(summaries)}\n\n"
        "![Qwen3-30B-A3B regime map](docs/img/regimes-qwen3-30b-a3b.png)\n"
        f"{END}"
    )
    README.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), block, text, flags=re.S))
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the quick grid (minutes)")
    parser.add_argument("--models", default="", help="only these models, comma-separated")
    parser.add_argument(
        "--forecaster",
        default=None,
        help=f"of predictive and mpc (default {DEFAULT_FORECASTER}; a policy rerun: the map's)",
    )
    parser.add_argument("--workers", type=int, default=0, help="0: one per CPU")
    parser.add_argument("--address", default=None, help="Ray cluster to run cells on")
    parser.add_argument("--fresh", action="store_true", help="ignore finished cells")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md alone")
    parser.add_argument(
        "--reanalyse",
        action="store_true",
        help="run nothing: redo the derived parts of regimes.json, report.md and the README "
        "block from the regimes in regimes.json",
    )
    parser.add_argument(
        "--regime",
        action="append",
        default=[],
        metavar="LABEL",
        help="rerun only this regime of the full grid (its label, e.g. 'qwen3-30b-a3b tau2 "
        "sync 64/GPU'; repeatable) into regimes-rerun.json, leaving the map's files alone",
    )
    parser.add_argument(
        "--rerun-policies",
        default="",
        metavar="P[,P]",
        help="rerun only these dynamic policies on regimes.json's recorded plans into "
        "regimes-policies.json",
    )
    parser.add_argument(
        "--policy-params",
        default="{}",
        metavar="JSON",
        help="with --rerun-policies: parameters per policy, e.g. "
        '\'{"predictive": {"min_gain": 0.2}}\'',
    )
    parser.add_argument(
        "--apply",
        action="store_true",
        help="with --rerun-policies and default parameters: write the results into the map",
    )
    args = parser.parse_args()
    if args.apply and not args.rerun_policies:
        parser.error("--apply writes a rerun of the policies into the map: --rerun-policies")
    if not args.rerun_policies:
        args.forecaster = args.forecaster or DEFAULT_FORECASTER
    if args.rerun_policies:
        if args.quick or args.models or args.reanalyse or args.regime:
            parser.error("--rerun-policies reruns regimes.json's regimes: it takes no grid")
        try:
            params = json.loads(args.policy_params)
        except json.JSONDecodeError as exc:
            parser.error(f"--policy-params is not JSON: {exc}")
        if args.apply and params:
            parser.error("--apply writes the policies' defaults only: no --policy-params")
        policies = [p.strip() for p in args.rerun_policies.split(",") if p.strip()]
        rerun_policies_of_map(policies, params, args)
        return
    if args.regime:
        if args.quick or args.models or args.reanalyse:
            parser.error("--regime takes regimes of the full grid by label, alone")
        rerun(args.regime, args.forecaster, args.workers, args.address, fresh=args.fresh)
        return
    if args.reanalyse:
        if args.quick or args.models or args.fresh or args.address:
            parser.error("--reanalyse runs no cell: it takes only --no-readme")
        reanalyse(readme=not args.no_readme)
        return
    regimes = get_grid("quick" if args.quick else "full")
    if args.models:
        regimes = select(regimes, models=[m for m in args.models.split(",") if m])
    cfg = MapConfig(
        regimes=regimes,
        forecaster=args.forecaster,
        workers=args.workers,
        address=args.address,
        cells_path=OUT / "cells.jsonl",
        resume=not args.fresh,
    )
    started = time.perf_counter()
    progress = progress_printer(started)

    result = run_map(cfg, progress=progress)
    map_s = time.perf_counter() - started
    summaries = result["regimes"]
    write_map_report(result, OUT, title=TITLE)
    copy_heatmaps()

    mech = {}
    mech["a"] = mechanisms.brief(mechanisms.interference(OUT))
    mech["b"] = mechanisms.brief(mechanisms.stage_layouts(OUT))
    # (c) on the seed's setting: Qwen3-30B-A3B, mixed, sync, 16 per GPU (if mapped)
    wanted = Regime("qwen3-30b-a3b", "mixed", "sync", 16)
    sync = [s for s in summaries if s["regime"]["mode"] == "sync"]
    tail_of = next((s for s in sync if Regime(**s["regime"]) == wanted), sync[0])
    mech_cfg = MapConfig(regimes=[Regime(**tail_of["regime"])], forecaster=args.forecaster)
    mech["c"] = mechanisms.brief(mechanisms.completion_tail(OUT, tail_of, mech_cfg))
    for name in mechanisms.MECHANISMS:
        shutil.copy(OUT / f"mechanism-{name}.png", IMG / f"mechanism-{name}.png")

    readme = False if (args.no_readme or args.quick) else update_readme(summaries)
    path = save(
        "regimes",
        {
            "quick": args.quick,
            "forecaster": args.forecaster,
            "regimes": [compact(s) for s in summaries],
            **derived(summaries),
            "mechanisms": mech,
            "cells": result["cells"],
            "map_wall_s": map_s,
            "wall_s": time.perf_counter() - started,
        },
    )
    print(headline_markdown(summaries))
    print(json.dumps(goals(summaries), indent=1))
    print(f"map {map_s:,.0f} s; saved {path}; README updated: {readme}")


def rerun(labels: list[str], forecaster: str, workers: int, address: str | None, *, fresh: bool):
    """Run the full grid's regimes named ``labels`` alone; print and save their summaries."""
    grid = {r.label: r for r in get_grid("full")}
    unknown = [x for x in labels if x not in grid]
    if unknown:
        raise SystemExit(f"not a regime of the full grid: {unknown}; e.g. {next(iter(grid))!r}")
    cfg = MapConfig(
        regimes=[grid[x] for x in labels],
        forecaster=forecaster,
        workers=workers,
        address=address,
        cells_path=OUT / "rerun-cells.jsonl",
        resume=not fresh,
    )
    started = time.perf_counter()
    result = run_map(cfg)
    summaries = [compact(s) for s in result["regimes"]]
    for summary in summaries:
        speedups = json.dumps(summary["speedup_by_seed"])
        print(summary["label"], json.dumps(summary["speedup"]), speedups)
    path = save(
        "regimes-rerun",
        {
            "forecaster": forecaster,
            "regimes": summaries,
            "cells": result["cells"],
            "wall_s": time.perf_counter() - started,
        },
    )
    print(f"saved {path}")


def progress_printer(started: float) -> Callable[[int, int], None]:
    """A sweep's progress callback: cells done and seconds since ``started``, at most
    every 30 s and at the end."""
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 30 or done == total:
            last[0] = now
            print(f"{done}/{total} cells, {now - started:,.0f} s", flush=True)

    return progress


#: The map's policies that read the forecaster (the oracle has its own).
FORECASTING = frozenset({"predictive", "mpc"})


def rerun_policies_of_map(policies: list[str], params: dict, args) -> None:
    """Rerun ``policies`` on the saved map's plans; print and save what moved (and with
    ``--apply`` write it into the map)."""
    from prorsa.errors import ConfigError
    from prorsa.experiments.policy_rerun import rerun_policies

    saved = json.loads((RESULTS / "regimes.json").read_text())
    forecaster = args.forecaster or saved.get("forecaster") or DEFAULT_FORECASTER
    forecaster_before = saved.get("forecaster", forecaster)
    if args.apply and forecaster != forecaster_before and not set(policies) >= FORECASTING:
        # Only the policies that read the forecast depend on it: all of them must rerun.
        sys.exit(
            f"--apply: the map ran {forecaster_before}; a map with {forecaster} reruns "
            f"{', '.join(sorted(FORECASTING))}"
        )
    # The full summaries (every metric of every run) where the map's results.json has
    # them for the same regimes; regimes.json's compact ones otherwise.
    full_path = OUT / "results.json"
    full = json.loads(full_path.read_text()) if full_path.exists() else None
    labels = [s["label"] for s in saved["regimes"]]
    same = full is not None and [s["label"] for s in full.get("regimes", [])] == labels
    before = full["regimes"] if same else saved["regimes"]
    changed = simulator_changes_since(saved.get("machine", {}).get("commit"))
    if changed:
        print(f"warning: simulator code changed since the map outside the policies: {changed}")
    started = time.perf_counter()
    try:
        after = rerun_policies(
            before,
            policies,
            params=params,
            forecaster=forecaster,
            workers=args.workers,
            address=args.address,
            cells_path=OUT / "policy-cells.jsonl",
            resume=not args.fresh,
            progress=progress_printer(started),
        )
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    others = [n for n in ("best-static", "predictive", "mpc", "oracle") if n not in policies]
    moved = [
        {
            "label": a["label"],
            "before": {p: b["speedup"].get(p) for p in policies},
            "after": {p: a["speedup"].get(p) for p in policies},
            "others": {n: a["speedup"].get(n) for n in others},
        }
        for b, a in zip(before, after, strict=True)
        if any(abs(a["speedup"].get(p, 0) - b["speedup"].get(p, 0)) > 1e-9 for p in policies)
    ]
    goals_before, goals_after = goals(before), goals(after)
    rerun_cells = len(policies) * sum(len(s["eval_seeds"]) for s in after if "rerun_from" in s)
    path = save(
        "regimes-policies",
        {
            "map_commit": saved.get("machine", {}).get("commit"),
            "simulator_changed_since_map": changed,
            "policies": policies,
            "params": params,
            "forecaster": forecaster,
            "cells": rerun_cells,
            "goals_before": goals_before,
            "goals_after": goals_after,
            "geomean_before": {p: _geomean(before, p) for p in policies},
            "geomean_after": {p: _geomean(after, p) for p in policies},
            "moved": moved,
            "regimes": [compact(s) for s in after],
            "wall_s": time.perf_counter() - started,
        },
    )
    for row in moved:
        print(row["label"], json.dumps({"before": row["before"], "after": row["after"]}))
    for name, g in (("before", goals_before), ("after", goals_after)):
        print(name, json.dumps({k: len(v) for k, v in g["missed"].items()}))
    print(f"saved {path}")
    if args.apply:
        ran = {k: v for k, v in machine().items() if k in ("commit", "when")}
        record = {
            **ran,
            "policies": policies,
            "cells": rerun_cells,
            "simulator_changed_since_map": changed,
            # the mechanism experiments are the map's run (mechanism (c) reads predictive)
            "mechanisms_rerun": False,
            "forecaster": forecaster,
        }
        if forecaster != forecaster_before:
            record["forecaster_before"] = forecaster_before
            saved["forecaster"] = forecaster
        saved.setdefault("policies_rerun", []).append(record)
        saved["regimes"] = [compact(s) for s in after]
        saved.update(derived(saved["regimes"]))
        atomic_write_text(
            RESULTS / "regimes.json", json.dumps(saved, indent=2, default=float) + "\n"
        )
        if same:
            full.update(regimes=after, headline=headline(after), goals=goals_after)
            full.setdefault("policies_rerun", []).append(record)
            atomic_write_text(full_path, json.dumps(full, indent=1, default=str) + "\n")
        reanalyse(readme=not args.no_readme)


def simulator_changes_since(commit: str | None) -> list[str]:
    """Simulator code (as the cell keys count it) changed between ``commit`` and the
    working tree, outside ``prorsa/policy/``: where any is, a policy rerun is not exact
    (the other cells would move too). Empty when git cannot tell."""
    import subprocess

    from prorsa.runtime.sim.version import is_simulator_code

    if not commit:
        return []
    try:
        names = subprocess.run(
            ["git", "diff", "--name-only", commit, "--", "prorsa", "datasets"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return []
    return [
        name
        for name in names
        if not name.startswith("prorsa/policy/")
        and (
            name.startswith("datasets/")
            or (name.endswith(".py") and is_simulator_code(Path(name).relative_to("prorsa")))
        )
    ]


def _geomean(summaries: list[dict], policy: str) -> float | None:
    from prorsa.experiments.held_out import geometric_mean

    values = [
        s["speedup"][policy] for s in summaries if s.get("valid", True) and policy in s["speedup"]
    ]
    return geometric_mean(values) if values else None


def copy_heatmaps() -> None:
    """The report's heatmaps into docs/img, where the README and docs show them."""
    IMG.mkdir(parents=True, exist_ok=True)
    for png in OUT.glob("heatmap-*.png"):
        shutil.copy(png, IMG / png.name.replace("heatmap-", "regimes-"))


def derived(summaries: list[dict]) -> dict:
    """What regimes.json reads off the regimes: headline, goals, the misses against
    colocation by cause, and the many tests."""
    return {
        "headline": headline(summaries),
        "goals": goals(summaries),
        # the misses against colocation@best that are its layout's choice, and the others
        "colocate_misses_by_cause": colocate_misses_by_cause(summaries),
        # how many "pays" chance alone would give, and those left at a 5% FDR
        "many_tests": {
            "pays": [s["label"] for s in summaries if pays(s)],
            "chance_pays_if_none_did": chance_pays(summaries),
            "fdr": FDR,
            "pays_at_fdr": pays_at_fdr(summaries),
        },
    }


def reanalyse(*, readme: bool) -> None:
    """Redo what the saved map's regimes give (after a change to the report code) without
    running a cell: regimes.json's derived parts, report.md, the heatmaps, the README."""
    path = RESULTS / "regimes.json"
    saved = json.loads(path.read_text())
    summaries = saved.get("regimes")
    if not isinstance(summaries, list) or not summaries:
        sys.exit(f"{path}: no 'regimes' list to reanalyse (run the map first)")
    saved.update(derived(summaries))
    # the run's own machine block stays; this says when and at which commit it was redone
    saved["reanalysed"] = {k: v for k, v in machine().items() if k in ("commit", "when")}
    atomic_write_text(path, json.dumps(saved, indent=2, default=float) + "\n")
    write_map_report({"regimes": summaries}, OUT, title=TITLE, results_json=False)
    copy_heatmaps()
    updated = readme and not saved.get("quick") and update_readme(summaries)
    causes = {k: len(v) for k, v in saved["colocate_misses_by_cause"].items()}
    print(f"misses against colocation@best by cause: {causes}")
    print(f"rewrote {path}, {OUT / 'report.md'}; README updated: {updated}")


if __name__ == "__main__":
    main()
