"""Report of the regime map: a heatmap per model, the headline table and report.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from prorsa.experiments.regimes import VS_COLOCATE_GOAL, goals
from prorsa.experiments.report import workload_label
from prorsa.io import atomic_write_text

PAYS = 1.02  # a split "pays" when it beats colocation at its best layout by more than 2%
HEADLINE_POLICIES = ("best-static", "predictive", "mpc", "oracle")
FDR = 0.05  # the false discovery rate at which "pays" is read over a whole map


#: A policy's numbers over the scoring seeds that a saved map keeps per regime.
POLICY_NUMBERS = (
    "objective",
    "objective_by_seed",
    "switches",
    "completion_s_p99",
    "busy_fraction",
    "cache_hit_rate",
    "error",
)


def pays(summary: dict, policy: str = "predictive") -> bool:
    """``policy`` beats colocation at its best layout by more than 2% (geometric mean over
    the held-out seeds) and its 95% interval lies above 1 (when it has one); never in a
    regime without a colocation baseline."""
    if not summary.get("valid", True):
        return False
    value = summary["speedup"].get(policy)
    if value is None or value <= PAYS:
        return False
    ci = summary.get("speedup_ci95", {}).get(policy)
    return ci is None or ci[0] > 1.0


def p_value(summary: dict, policy: str = "predictive") -> float | None:
    """One-sided p-value of ``policy`` being no faster than colocation at its best layout
    (a t-test of its per-seed log speedups against 0): 1 where its run failed on a seed
    (tested, no evidence), None with fewer than two seeds."""
    from scipy.stats import ttest_1samp

    ratios = list(summary.get("speedup_by_seed", {}).get(policy, {}).values())
    if len(ratios) < 2:
        return None
    if not all(0 < r < np.inf for r in ratios):
        return 1.0
    logs = np.log(ratios)
    if np.ptp(logs) == 0:  # no spread: the t statistic is undefined, the sign is not
        return 0.0 if logs[0] > 0 else 1.0
    return float(ttest_1samp(logs, 0.0, alternative="greater").pvalue)


def pays_at_fdr(summaries: list[dict], policy: str = "predictive", q: float = FDR) -> list[str]:
    """The regimes where the split pays (:func:`pays`) and still does once the map's many
    tests are accounted for: Benjamini-Hochberg at false discovery rate ``q`` over every
    regime with a baseline. A map of ~130 regimes tested at 95% would call about three
    "paying" by chance even if none did; this keeps the expected share of such calls
    among those kept at ``q``."""
    from scipy.stats import false_discovery_control

    tested = _tests(summaries, policy)
    if not tested:
        return []
    adjusted = false_discovery_control([p for _, p in tested], method="bh")
    return [
        s["label"] for (s, _), a in zip(tested, adjusted, strict=True) if a <= q and pays(s, policy)
    ]


def chance_pays(summaries: list[dict]) -> float:
    """How many regimes :func:`pays` would call paying by chance if the split paid in
    none: a one-sided 2.5% per regime with a baseline (the interval's lower end above
    1), an upper bound since the 1.02x threshold also has to be cleared."""
    return 0.025 * len(_tests(summaries, "predictive"))


def _tests(summaries: list[dict], policy: str) -> list[tuple[dict, float]]:
    """The map's family of tests with their p-values: the regimes with a baseline where
    ``policy`` ran on two seeds or more."""
    tests = []
    for s in summaries:
        if s.get("valid", True) and policy in s.get("speedup", {}):
            p = p_value(s, policy)
            if p is not None:
                tests.append((s, p))
    return tests


def layout_choice(summary: dict, policy: str = "predictive") -> dict | None:
    """``policy``'s speedup over colocation@best as two paired factors, per held-out seed
    and so for their geometric means: colocation at the layout the plan chose (on the
    selection seed, confirmed on more where close) over colocation@best
    (``colocate_chosen_vs_best``, at most 1: the best layout is picked on the held-out
    seeds themselves), times ``policy`` over colocation at that
    chosen layout (``vs_colocate_chosen``: the policy against colocation chosen the way
    its own plan was). None where either run is missing, or where colocation at the
    chosen layout failed on a seed (the factors are then 0 and inf, whose product says
    nothing)."""
    from prorsa.experiments.held_out import paired_speedup

    chosen = summary.get("selection", {}).get("colocate_best_layout")
    colocate = summary.get("colocate", {})
    run = summary.get("policies", {}).get(policy)
    if chosen not in colocate or run is None or not summary.get("colocate_best"):
        return None
    at_chosen = colocate[chosen]["objective_by_seed"]
    if not all(math.isfinite(v) for v in at_chosen.values()):
        return None
    regret = paired_speedup(summary["colocate_best"]["objective_by_seed"], at_chosen)
    own = paired_speedup(at_chosen, run["objective_by_seed"])
    best = summary["colocate_best"]["layout"]
    by_seed = layout_ratio_by_seed(summary, chosen, best)
    return {
        "chosen_layout": chosen,
        "best_layout": best,
        "colocate_chosen_vs_best": regret["speedup"],
        "vs_colocate_chosen": own["speedup"],
        "vs_colocate_chosen_ci95": own["ci95"],
        "best_over_chosen_time_by_seed": by_seed,
        "seeds_chosen_not_slower": sum(1 for ratio in by_seed.values() if ratio >= 1.0),
    }


def layout_ratio_by_seed(summary: dict, chosen: str, best: str) -> dict[str, float]:
    """Colocation's time at ``best`` over its time at ``chosen`` on every seed both ran:
    the selection seed, the confirmation seeds where both were contenders, and the
    held-out seeds (keys: seed numbers as strings; below 1: ``best`` was faster). Where
    the two layouts trade places from seed to seed, the layout choice is a draw of the
    workload, not a planning error."""
    selection = summary.get("selection", {})
    out: dict[str, float] = {}
    first = selection.get("colocate", {})
    if chosen in first and best in first:
        out[str(selection.get("seed", 0))] = first[best] / first[chosen]
    confirmed = selection.get("confirmed", {})
    if chosen in confirmed and best in confirmed:
        for seed, time_s in confirmed[chosen].items():
            if seed in confirmed[best]:
                out[str(seed)] = confirmed[best][seed] / time_s
    held_out = summary.get("colocate", {})
    at_chosen = held_out.get(chosen, {}).get("objective_by_seed", {})
    at_best = held_out.get(best, {}).get("objective_by_seed", {})
    for seed, time_s in at_chosen.items():
        if seed in at_best and time_s > 0:
            out[str(seed)] = at_best[seed] / time_s
    return out


#: Why a policy is below the goal against colocation@best (:func:`colocate_misses_by_cause`).
MISS_CAUSES = ("layout", "policy", "both", "unknown")


def colocate_misses_by_cause(
    summaries: list[dict], policy: str = "predictive", goal: float = VS_COLOCATE_GOAL
) -> dict[str, list[dict]]:
    """The regimes where ``policy`` is below ``goal`` x colocation@best, by which factor
    of :func:`layout_choice` is below ``goal``: ``layout`` (only colocation at the chosen
    layout against colocation@best: colocation chosen the way the policy's plan was would
    miss too), ``policy`` (only the policy against colocation at the chosen layout),
    ``both``, or ``unknown`` where the factors cannot be had (a run missing or failed)."""
    out: dict[str, list[dict]] = {cause: [] for cause in MISS_CAUSES}
    for s in summaries:
        value = s.get("speedup", {}).get(policy)
        if not s.get("valid", True) or value is None or value >= goal:
            continue
        split = layout_choice(s, policy)
        if split is None:
            cause = "unknown"
        else:
            layout = split["colocate_chosen_vs_best"] < goal
            own = split["vs_colocate_chosen"] < goal
            cause = "both" if layout and own else "layout" if layout else "policy"
        out[cause].append({"label": s["label"], "speedup": value, **(split or {})})
    return out


def colocate_misses_markdown(
    summaries: list[dict], policy: str = "predictive", goal: float = VS_COLOCATE_GOAL
) -> str:
    """:func:`colocate_misses_by_cause` as a table."""
    causes = colocate_misses_by_cause(summaries, policy, goal)
    if not any(causes.values()):
        return f"{policy} is at least {goal:g}x colocation@best in every regime."
    lines = [
        f"Where {policy} is below {goal:g}x colocation@best: colocation's best layout is the "
        "fastest on the held-out seeds themselves, while every plan of the policy "
        "(colocated layout included) is chosen on the selection seed, confirmed on two more "
        "where options were close. The speedup is the product of colocation at the layout "
        "the plan chose over colocation@best "
        f"and {policy} over colocation at that layout; the cause names the factor below "
        f"{goal:g}x.",
        "",
        f"| regime | cause | {policy} / colocation@best | colocation chosen / @best "
        f"(layouts) | chosen layout not slower | {policy} / colocation chosen |",
        "|---|---|---|---|---|---|",
    ]
    for cause, rows in causes.items():
        for r in rows:
            if "chosen_layout" not in r:
                lines.append(f"| {r['label']} | {cause} | {r['speedup']:.3f}x | - | - | - |")
                continue
            seeds = r["best_over_chosen_time_by_seed"]
            trades = (
                "- (the same layout)"
                if r["chosen_layout"] == r["best_layout"]
                else f"on {r['seeds_chosen_not_slower']} of {len(seeds)} seeds"
            )
            lines.append(
                f"| {r['label']} | {cause} | {r['speedup']:.3f}x | "
                f"{r['colocate_chosen_vs_best']:.3f}x ({r['chosen_layout']} / "
                f"{r['best_layout']}) | {trades} | {r['vs_colocate_chosen']:.3f}x |"
            )
    lines += [
        "",
        "*Chosen layout not slower*: on how many of the seeds both layouts ran (selection, "
        "confirmation and held-out) colocation at the chosen layout was at least as fast "
        "as at colocation@best's. Where that is most of them, the two layouts trade places "
        "from one draw of the workload to the next and the held-out seeds' own best is "
        "partly that draw.",
    ]
    return "\n".join(lines)


def with_interval(summary: dict, policy: str) -> str:
    """``1.043x`` or ``1.043x (0.98-1.11)``: a speedup and its 95% interval."""
    value = summary["speedup"].get(policy)
    if value is None:
        return "-"
    ci = summary.get("speedup_ci95", {}).get(policy)
    return f"{value:.3f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def models_of(summaries: list[dict]) -> list[str]:
    seen: list[str] = []
    for s in summaries:
        if s["regime"]["model"] not in seen:
            seen.append(s["regime"]["model"])
    return seen


def _main(summaries: list[dict], model: str) -> list[dict]:
    """The plain regimes of one model (no knob changed)."""
    return [s for s in summaries if s["regime"]["model"] == model and not s["variant"]]


def heatmap(summaries: list[dict], model: str, path: Path, policy: str = "predictive") -> Path:
    """Speedup of ``policy`` over colocation at its best layout: rows workload x mode,
    columns load; each cell also shows best-static's speedup."""
    plt = _plt()
    rows = [s for s in _main(summaries, model) if s.get("valid", True)]
    keys = sorted({(s["regime"]["workload"], s["regime"]["mode"]) for s in rows})
    loads = sorted({s["regime"]["load_per_gpu"] for s in rows})
    grid = np.full((len(keys), len(loads)), np.nan)
    text = [["" for _ in loads] for _ in keys]
    for s in rows:
        r = s["regime"]
        i, j = keys.index((r["workload"], r["mode"])), loads.index(r["load_per_gpu"])
        value = s["speedup"].get(policy)
        if value is None:
            continue
        grid[i, j] = value
        static = s["speedup"].get("best-static")
        mark = "*" if pays(s, policy) else ""  # above 1.02x with its interval above 1
        text[i][j] = f"{value:.2f}{mark}" + (f"\n({static:.2f})" if static is not None else "")
    fig, ax = plt.subplots(figsize=(max(4.8, 2.4 + 1.15 * len(loads)), 1.4 + 0.55 * len(keys)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.4, aspect="auto")
    for i in range(len(keys)):
        for j in range(len(loads)):
            if text[i][j]:
                ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(loads)), [str(v) for v in loads])
    ax.set_yticks(range(len(keys)), [f"{workload_label(w)} {m}" for w, m in keys])
    ax.set_xlabel("trajectories per GPU")
    gpus = rows[0]["gpus"] if rows else "?"
    ax.set_title(
        f"{model}, {gpus} GPUs\nspeedup of {policy} (best-static) over colocation@best"
        "\n(* pays: over 1.02x, 95% interval above 1)",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="speedup (x)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def speedup_bars(summaries: list[dict], path: Path) -> Path:
    """Speedup over colocation at its best layout per regime and policy (one bar each,
    with its 95% interval over the held-out seeds)."""
    plt = _plt()
    from prorsa.experiments.report import COLORS

    summaries = [s for s in summaries if s.get("valid", True)]  # no baseline: no speedup
    policies = [p for p in HEADLINE_POLICIES if any(p in s["speedup"] for s in summaries)]
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(summaries)), 4.2))
    for i, policy in enumerate(policies):
        xs = [g + (i - (len(policies) - 1) / 2) * width for g in range(len(summaries))]
        ys = [s["speedup"].get(policy, np.nan) for s in summaries]
        cis = [
            s.get("speedup_ci95", {}).get(policy) or [y, y]
            for s, y in zip(summaries, ys, strict=True)
        ]
        err = np.abs(np.array([[y - lo, hi - y] for y, (lo, hi) in zip(ys, cis, strict=True)]).T)
        ax.bar(xs, ys, width, label=policy, color=COLORS.get(policy), yerr=err, capsize=2)
    ax.axhline(1.0, color="black", lw=0.8)
    shown = [v for s in summaries for v in s["speedup"].values()]
    shown += [b for s in summaries for ci in s.get("speedup_ci95", {}).values() if ci for b in ci]
    shown = [v for v in shown if np.isfinite(v)] or [1.0]
    ax.set_ylim(min(min(shown), 1.0) - 0.05, max(max(shown), 1.0) + 0.05)
    labels = [
        f"{s['regime']['model']}\n{workload_label(s['regime']['workload'])} "
        f"{s['regime']['mode']}\n{s['regime']['load_per_gpu']}/GPU"
        for s in summaries
    ]
    ax.set_xticks(range(len(summaries)), labels, fontsize=8)
    ax.set_ylabel("speedup vs colocation@best (x)")
    ax.set_title("error bars: 95% interval over the held-out seeds", fontsize=9)
    ax.legend(fontsize=8, ncol=len(policies))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def headline(summaries: list[dict]) -> list[dict]:
    """One row per model: cells, where the split pays, and the range of speedups (over
    the regimes with a colocation baseline; the others are named in ``invalid``)."""
    out = []
    kept = set(pays_at_fdr(summaries))  # over the whole map: one family of tests
    for model in models_of(summaries):
        every = [s for s in summaries if s["regime"]["model"] == model]
        rows = [s for s in every if s.get("valid", True)]
        invalid = [s["label"] for s in every if not s.get("valid", True)]
        if not rows:
            out.append({"model": model, "gpus": every[0]["gpus"], "cells": 0, "invalid": invalid})
            continue
        best = max(rows, key=lambda s: s["speedup"].get("predictive", 0.0))
        entry = {
            "model": model,
            "gpus": rows[0]["gpus"],
            "cells": len(rows),
            "invalid": invalid,
            # over 1.02x, with the 95% interval over the held-out seeds above 1
            "split_pays_cells": sum(1 for s in rows if pays(s)),
            # ... and still at a 5% false discovery rate over the map's regimes
            "split_pays_fdr_cells": sum(1 for s in rows if s["label"] in kept),
            "best_cell": best["label"],
        }
        for policy in HEADLINE_POLICIES:
            values = [s["speedup"][policy] for s in rows if policy in s["speedup"]]
            if values:
                entry[policy] = {
                    "min": min(values),
                    "median": float(np.median(values)),
                    "max": max(values),
                }
        vs_tp1 = [
            s["speedup_vs_baseline"]["predictive"]
            for s in rows
            if "predictive" in s.get("speedup_vs_baseline", {})
        ]
        if vs_tp1:
            entry["predictive_vs_baseline_max"] = max(vs_tp1)
        out.append(entry)
    return out


def headline_markdown(summaries: list[dict]) -> str:
    """The headline table: per model, speedups over colocation at its best layout."""
    head = "| model | GPUs | cells | split pays (>1.02x, CI > 1; at FDR 5%) | " + " | ".join(
        f"{p} min / median / max" for p in HEADLINE_POLICIES
    )
    lines = [head + " | best cell |", "|" + "---|" * (5 + len(HEADLINE_POLICIES))]
    invalid = []
    for entry in headline(summaries):
        invalid += entry.get("invalid", [])
        cells = []
        for policy in HEADLINE_POLICIES:
            v = entry.get(policy)
            cells.append(f"{v['min']:.2f} / {v['median']:.2f} / {v['max']:.2f}x" if v else "-")
        lines.append(
            f"| {entry['model']} | {entry['gpus']} | {entry['cells']} | "
            f"{entry.get('split_pays_cells', '-')}; {entry.get('split_pays_fdr_cells', '-')} | "
            + " | ".join(cells)
            + f" | {entry.get('best_cell', '-')} |"
        )
    if invalid:
        lines += ["", f"Left out (no colocation layout finished): {', '.join(invalid)}."]
    return "\n".join(lines)


def regime_table(rows: list[dict]) -> str:
    """Every regime: colocation at its best layout, the dynamic policies' layouts and
    start, best-static's split and every speedup (and predictive's against colocation at
    TP1, labelled)."""
    head = (
        "| regime | colocation@best | policies' P / D / C, start | best-static split | "
        "best-static | predictive (95% CI) | mpc | oracle | ceiling | predictive vs coloc@TP1 |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in rows:
        best = s["colocate_best"]
        # summaries written before the run plan was recorded ran the planner's layouts
        run = s.get("run_plan") or {"layouts": s["planned_layouts"], "start": "-"}
        plan = run["layouts"]
        static = s.get("best_static") or {}
        where = (
            f"{static['prefill_layout']} x{static['prefill_gpus']} GPUs / {static['decode_layout']}"
            if static
            else "-"
        )
        base = s["colocate_baseline"]
        vs_base = s.get("speedup_vs_baseline", {}).get("predictive")
        tail = f" | {vs_base:.3f}x ({base['layout']}) |" if vs_base else " | - |"
        ceiling = s.get("ceiling")
        tail = (f" | {ceiling['ceiling']:.2f}x" if ceiling else " | -") + tail
        lines.append(
            f"| {s['label']} | {best['layout']} {_objective(best['objective'], s)} | "
            f"{plan['prefill']} / {plan['decode']} / {plan['colocated']}, {run['start']} | "
            f"{where} | "
            + " | ".join(
                _speedup_cell(s, p) for p in ("best-static", "predictive", "mpc", "oracle")
            )
            + tail
        )
    failed = [
        f"* {s['label']}: {', '.join(s['failed_cells'])}" for s in rows if s.get("failed_cells")
    ]
    if failed:
        lines += ["", "Runs that failed (a speedup of a failed plan reads 'failed'):", *failed]
    return "\n".join(lines)


def _speedup_cell(summary: dict, policy: str) -> str:
    """A speedup for the table; a plan that failed on a held-out seed says so (its
    speedup, 0, would read as merely slow)."""
    error = summary.get("policies", {}).get(policy, {}).get("error")
    if error:
        return "failed (" + error.split(":")[0] + ")"  # "seed 9"
    if policy == "predictive":
        return with_interval(summary, policy)
    value = summary["speedup"].get(policy)
    return f"{value:.3f}x" if value is not None else "-"


def many_tests_markdown(summaries: list[dict]) -> str:
    """What the count of paying regimes means over a whole map (chance and FDR)."""
    paying = [s["label"] for s in summaries if pays(s)]
    kept = pays_at_fdr(summaries)
    tested = len(_tests(summaries, "predictive"))
    if not tested:
        return f"Predictive's split pays in {len(paying)} regimes (one seed each: no test)."
    text = (
        f"Predictive's split pays in {len(paying)} of {tested} regimes with a baseline; "
        f"if it paid in none, about {chance_pays(summaries):.1f} would look paying by "
        f"chance. At a {FDR:.0%} false discovery rate over the map (Benjamini-Hochberg on "
        f"one-sided t-tests of the per-seed log speedups) {len(kept)} "
        f"{'remains' if len(kept) == 1 else 'remain'}"
    )
    return text + (": " + ", ".join(kept) + "." if kept else ".")


def _objective(value: float, summary: dict) -> str:
    if summary["regime"]["mode"] == "sync":
        return f"{value:,.1f} s"
    return f"{3600.0 / value:,.0f} traj/h"


def goals_markdown(met: dict) -> str:
    names = {
        "seed_1.3x": "predictive >= 1.3x colocation@best in the seed's setting",
        "vs_colocate_0.98": "predictive >= 0.98x colocation@best in every cell",
        "vs_oracle_5pct": "predictive within 5% of the oracle in every cell",
        "vs_best_static_2pct": "predictive never more than 2% below best-static",
        "valid_baseline": "every regime has a colocation baseline (left out where none ran)",
    }
    lines = []
    for key, text in names.items():
        missed = met["missed"].get(key, [])
        status = "met" if not missed else f"not met in {len(missed)} cell(s)"
        lines.append(f"* {text}: **{status}**")
        lines += [f"  * {label}" for label in missed[:12]]
        if len(missed) > 12:
            lines.append(f"  * ... and {len(missed) - 12} more")
    if met["seed_setting_cells"]:
        lines.append(
            f"* seed setting ({met['seed_setting_cells']} cells): predictive "
            f"{met['seed_setting_predictive_min']:.3f}x - "
            f"{met['seed_setting_predictive_max']:.3f}x"
        )
    beyond = met.get("seed_1.3x_beyond_ceiling", [])
    if beyond:
        lines.append(
            f"* seed cells where no allocation can reach 1.3x (ceiling below it): {len(beyond)}"
        )
        lines += [f"  * {label}" for label in beyond]
    return "\n".join(lines)


def write_map_report(
    result: dict,
    out: Path,
    *,
    title: str = "Regime map",
    config: dict | None = None,
    results_json: bool = True,
) -> Path:
    """results.json (unless ``results_json`` is False: a report redone from compact
    summaries keeps the full one), a heatmap per model and report.md under ``out``;
    returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = result["regimes"]
    met = goals(summaries)
    if results_json:
        payload = {"config": config, **result, "headline": headline(summaries), "goals": met}
        text = json.dumps(payload, indent=1, default=str) + "\n"
        atomic_write_text(out / "results.json", text)
    lines = [
        f"# {title}",
        "",
        "Speedup = colocation at its best layout / policy (sync makespan; async seconds "
        "per trajectory) on the same trajectories, scored on held-out seeds: every plan "
        "(best-static's split, the dynamic policies' layouts and start) is chosen on the "
        "regime's own seed (a close choice confirmed on two more), each speedup is the "
        "geometric mean of the per-seed ratios with a 95% interval, and the baseline's "
        "layout is the fastest on the held-out seeds themselves (which can only favour "
        "colocation). A 95% interval is wrong one time in "
        "twenty: over many regimes a few 'pays' and a few misses can be chance. Ceiling = "
        "the largest speedup any allocation could reach (prorsa/experiments/ceiling.py).",
        "",
    ]
    lines += [headline_markdown(summaries), "", many_tests_markdown(summaries)]
    lines += ["", "## Goals", "", goals_markdown(met), ""]
    heading = f"### Below {VS_COLOCATE_GOAL:g}x colocation@best, by cause"
    lines += [heading, "", colocate_misses_markdown(summaries)]
    lines.append("")
    for model in models_of(summaries):
        main = _main(summaries, model)
        if main:
            png = heatmap(summaries, model, out / f"heatmap-{model}.png")
            lines += [f"## {model}", "", f"![{model}]({png.name})", "", regime_table(main), ""]
        knobs = [s for s in summaries if s["regime"]["model"] == model and s["variant"]]
        if knobs:
            lines += [f"### {model}: one knob at a time", "", regime_table(knobs), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
