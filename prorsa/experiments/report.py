"""Report of a comparison: a markdown summary and the plots that say more than tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from prorsa.experiments.cells import cell_of
from prorsa.io import atomic_write_text

COLORS = {
    "colocate": "#7f7f7f",
    "static": "#bcbd22",
    "best-static": "#8c564b",
    "threshold": "#ff7f0e",
    "predictive": "#1f77b4",
    "mpc": "#2ca02c",
    "oracle": "#9467bd",
    "rl": "#17becf",
}
LINESTYLES = ("-", "--", "-.", ":")


def _json_value(obj: object) -> object:
    """JSON for what results and configs hold besides plain values: paths, numpy scalars."""
    if isinstance(obj, Path):
        return str(obj)
    return float(obj)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def workload_label(workload: str, sep: str = " ") -> str:
    """A short name for plots and headings: a replayed trace shows as ``replay <file stem>``."""
    if "/" in workload or workload.endswith(".parquet"):
        return f"replay{sep}{Path(workload).name.split('.')[0]}"
    return workload


def speedup_bars(summary: list[dict], path: Path) -> Path:
    """Speedup over colocation per workload/mode and policy, with 95% CIs."""
    plt = _plt()
    groups = sorted({(r["workload"], r["mode"]) for r in summary})
    policies = [p for p in COLORS if any(r["policy"] == p for r in summary)]
    policies += sorted({r["policy"] for r in summary} - set(policies))
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(max(6, 2.0 * len(groups)), 4.2))
    for i, policy in enumerate(policies):
        xs, ys, err = [], [], []
        for g, (workload, mode) in enumerate(groups):
            row = next(
                (
                    r
                    for r in summary
                    if (r["workload"], r["mode"], r["policy"]) == (workload, mode, policy)
                ),
                None,
            )
            if row is None or row["speedup"] is None:
                continue
            xs.append(g + (i - (len(policies) - 1) / 2) * width)
            ys.append(row["speedup"])
            ci = row["speedup_ci95"]
            err.append(0.0 if ci is None else (ci[1] - ci[0]) / 2)
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=policy, color=COLORS.get(policy))
    ax.axhline(1.0, color="black", lw=0.8)
    # Speedups cluster near 1x; an axis from 0 would hide the differences that matter.
    shown = [r["speedup"] for r in summary if r["speedup"] is not None] or [1.0]
    low, high = min(min(shown), 1.0), max(max(shown), 1.0)
    pad = max(0.02, 0.1 * (high - low))
    ax.set_ylim(low - pad, high + pad)
    ax.set_xticks(range(len(groups)), [f"{workload_label(w, sep=chr(10))}\n{m}" for w, m in groups])
    ax.set_ylabel("speedup over colocation (x)")
    ax.legend(fontsize=8, ncol=min(len(policies), 4))
    ax.set_title("Rollout speedup (95% CI over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _seed0_runs(runs: list[dict], workload: str, mode: str) -> list[dict]:
    """Runs of seed 0 of one workload and mode that kept their time series."""
    chosen = []
    for run in runs:
        cell = cell_of(run)
        if (cell.mode, cell.workload, cell.seed) == (mode, workload, 0) and "series" in run:
            chosen.append(run)
    return chosen


def allocation_plot(runs: list[dict], workload: str, mode: str, path: Path) -> Path | None:
    """Prefill GPUs over time per dynamic policy, against prefill demand and its forecast."""
    plt = _plt()
    chosen = _seed0_runs(runs, workload, mode)
    if not chosen:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    demand_drawn = False
    for i, run in enumerate(chosen):
        s, policy = run["series"], cell_of(run).policy
        t = np.asarray(s["time_s"])
        if not demand_drawn:
            top.plot(
                t,
                np.asarray(s["prefill_tokens_per_s"]) / 1e3,
                color="black",
                lw=0.8,
                label="actual",
            )
            # The first tick carries every first prompt at once; scale to the steady part.
            demand = np.asarray(s["prefill_tokens_per_s"]) / 1e3
            if demand.size > 10:
                top.set_ylim(0, 1.3 * float(np.percentile(demand, 99)) + 1e-9)
            demand_drawn = True
        if s["forecast_prefill_tokens_per_s"]:
            ft, fv = zip(*s["forecast_prefill_tokens_per_s"], strict=True)
            top.plot(
                ft,
                np.asarray(fv) / 1e3,
                lw=1,
                label=f"forecast ({policy})",
                color=COLORS.get(policy),
            )
        bottom.step(
            t,
            s["gpus"]["prefill"],
            where="post",
            label=policy,
            color=COLORS.get(policy),
            # Policies often hold the same allocation; dashes keep coinciding lines visible.
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            lw=2.2 - 0.25 * (i % 4),
        )
    top.set_ylabel("prefill demand (k tokens/s)")
    top.legend(fontsize=8)
    bottom.set_ylabel("GPUs serving prefill")
    bottom.set_xlabel("time (s)")
    bottom.legend(fontsize=8, ncol=3)
    top.set_title(f"Allocation against demand — {workload_label(workload)}, {mode}, seed 0")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def completion_cdf(runs: list[dict], workload: str, mode: str, path: Path) -> Path | None:
    """Trajectory completion-time CDF per policy (seed 0)."""
    plt = _plt()
    chosen = [r for r in _seed0_runs(runs, workload, mode) if r["series"]["completion_s"]]
    if not chosen:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in chosen:
        c = np.asarray(run["series"]["completion_s"])
        policy = cell_of(run).policy
        ax.plot(c, np.arange(1, len(c) + 1) / len(c), label=policy, color=COLORS.get(policy))
    ax.set_xlabel("trajectory completion time (s)")
    ax.set_ylabel("fraction of trajectories")
    ax.set_title(f"Completion-time CDF — {workload_label(workload)}, {mode}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(
    result: dict, out: Path, *, title: str = "Policy comparison", config: dict | None = None
) -> Path:
    """results.json, PNG plots and report.md under ``out``; returns the report path."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "results.json",
        json.dumps({"config": config, **result}, indent=1, default=_json_value) + "\n",
    )
    summary, runs = result["summary"], result["runs"]
    lines = [f"# {title}", ""]
    if config:
        lines += ["```", json.dumps(config, indent=1, default=str), "```", ""]
    bars = speedup_bars(summary, out / "speedup.png")
    lines += [f"![speedup]({bars.name})", ""]
    for workload, mode in sorted({(r["workload"], r["mode"]) for r in summary}):
        rows = [r for r in summary if (r["workload"], r["mode"]) == (workload, mode)]
        lines += [f"## {workload_label(workload)} — {mode}", "", table_markdown(rows), ""]
        key = f"{workload}/{mode}"
        if key in result.get("best_static", {}):
            found = result["best_static"][key]
            lines += [
                f"best-static: {found['prefill_slots']} prefill slots "
                f"({found['prefill_gpus']} GPUs; searched "
                f"{len(found['objective_by_prefill_slots'])} splits on a seed of its own, "
                "one past the evaluated ones)",
                "",
            ]
        slug = f"{workload_label(workload, sep='-')}-{mode}"
        for name, maker in (("allocation", allocation_plot), ("completion", completion_cdf)):
            png = maker(runs, workload, mode, out / f"{name}-{slug}.png")
            if png is not None:
                lines += [f"![{name}]({png.name})", ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


TABLE_COLUMNS = (
    "policy",
    "makespan s / traj/h",
    "speedup (95% CI)",
    "p99 completion s",
    "switches",
    "busy P / D / C",
)


def ordered(rows: list[dict]) -> list[dict]:
    """Summary rows in the canonical policy order."""
    order = list(COLORS)
    return sorted(rows, key=lambda r: order.index(r["policy"]) if r["policy"] in order else 99)


def row_cells(r: dict) -> list[str]:
    """One summary row as the table's cells (markdown report and CLI share them)."""
    value = (
        f"{r['makespan_s']:,.1f}"
        if r["mode"] == "sync"
        else f"{r['throughput_traj_per_hour']:,.0f}"
    )
    ci = r["speedup_ci95"]
    speed = (
        "-"
        if r["speedup"] is None
        else f"{r['speedup']:.3f}x" + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else "")
    )
    busy = " / ".join(
        "-" if r["busy_fraction"][k] is None else f"{r['busy_fraction'][k]:.0%}"
        for k in ("prefill", "decode", "colocated")
    )
    p99 = "-" if r["completion_s_p99"] is None else f"{r['completion_s_p99']:,.1f}"
    return [r["policy"], value, speed, p99, f"{r['switches']:.1f}", busy]


def table_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in ordered(rows)]
    return "\n".join(lines)
