"""The seed's three mechanisms, one small experiment each, each with its numbers and a plot.

* (a) **interference among data-parallel attention ranks**: decode step time and decode
  throughput of a colocated DP-attention engine, and of the same engine serving decode
  only next to prefill GPUs, as the prefill arrival rate grows (cost model, steady state);
* (b) **stage-specific parallelism**: through a simulated sync step, the best layout for
  prefill, for decode and for a single colocated layout at each moment's load, and the
  GPU-time each would cost (telemetry of one colocated run, priced by the cost model);
* (c) **trajectory completion time**: the distribution of completion times under
  colocation at its best layout and under the best split, and how the tail sets the sync
  makespan (simulation).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.io import atomic_write_text
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.workload.config import WorkloadConfig

MECHANISMS = ("a", "b", "c")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(out: Path, name: str, payload: dict, fig) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"mechanism-{name}.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    _plt().close(fig)
    payload = {**payload, "plot": str(png)}
    atomic_write_text(
        out / f"mechanism-{name}.json", json.dumps(payload, indent=1, default=float) + "\n"
    )
    return payload


# ---------------------------------------------------------------------------------------
# (a) interference among DP-attention ranks


@dataclass(frozen=True)
class InterferenceSetup:
    """A DP engine's decoding load and the prefill it may also serve."""

    model_prefix: str = "h200-qwen3-30b-a3b"
    layouts: tuple[str, ...] = ("tp1-dp8-ep8", "tp1-dp8-ep8-a2a")
    prefill_layout: str = "tp1"  # the disaggregated prefill GPUs
    batch_per_rank: int = 32
    context_tokens: int = 8192
    chunk_tokens: int = 2048
    points: int = 24
    semantics: str = "vllm"


def _rate_sweep(cost, setup: InterferenceSetup, prefill_tps_per_gpu: float) -> dict:
    """Steady state at prefill arrival rates up to what one rank's chunk per step serves.

    A step either decodes only (``d``) or has one rank add a chunk of ``n`` prefill tokens
    (``m``: every rank waits for it, pads to it, and the engine leaves CUDA graphs). At
    ``rate`` tokens/s a share ``f`` of steps carries a chunk: ``rate = f n / (f m + (1-f) d)``.
    Disaggregated, the engine always decodes at ``d`` and ``rate / prefill_tps`` prefill
    GPUs serve the prefill.
    """
    dp, b, c = cost.dp_ranks, setup.batch_per_rank, setup.context_tokens
    if b > cost.max_batch or b * c > cost.kv_capacity_tokens:
        raise ConfigError(
            f"{cost.name}: {b} sequences x {c} tokens per rank do not fit "
            f"(max batch {cost.max_batch}, KV {cost.kv_capacity_tokens:,} tokens)"
        )
    n = min(setup.chunk_tokens, cost.max_step_tokens - b)
    batches, ctxs = [b] * dp, [b * c] * dp
    chunks = [n] + [0] * (dp - 1)
    decode_s = cost.decode_step_s(batches, ctxs)
    parts = cost.step_breakdown(batches, ctxs, chunks, [0] * dp)
    mixed_s = parts["step_s"]
    saturation = n / mixed_s
    rates = np.linspace(0.0, 0.98 * saturation, setup.points)
    share = rates * decode_s / (n - rates * (mixed_s - decode_s))
    step_s = share * mixed_s + (1 - share) * decode_s
    decode_tokens_per_s = dp * b / step_s
    prefill_gpus = rates / prefill_tps_per_gpu
    return {
        "layout": cost.layout.name,
        "gpus": cost.gpus,
        "chunk_tokens": n,
        "decode_step_s": decode_s,
        "mixed_step_s": mixed_s,
        "mixed_step_parts": {k: v for k, v in parts.items() if isinstance(v, int | float)},
        "mixed_step_mode": parts.get("mode"),
        "prefill_tokens_per_s": rates.tolist(),
        "prefill_step_share": share.tolist(),
        "colocated_step_s": step_s.tolist(),
        "colocated_decode_tokens_per_s_per_gpu": (decode_tokens_per_s / cost.gpus).tolist(),
        "disaggregated_step_s": [decode_s] * len(rates),
        "disaggregated_decode_tokens_per_s_per_gpu": (
            dp * b / decode_s / (cost.gpus + prefill_gpus)
        ).tolist(),
        "saturation_prefill_tokens_per_s": saturation,
    }


def interference(out: Path, setup: InterferenceSetup | None = None) -> dict:
    """Mechanism (a): writes ``mechanism-a.json`` and ``mechanism-a.png`` under ``out``."""
    from prorsa.runtime.cluster.layouts import prefill_tokens_per_s_per_gpu
    from prorsa.runtime.sim.cost.layout_registry import get_layout_cost

    setup = setup or InterferenceSetup()
    prefill = get_layout_cost(f"{setup.model_prefix}-{setup.prefill_layout}")
    prefill_tps = prefill_tokens_per_s_per_gpu(prefill)
    sweeps = [
        _rate_sweep(
            get_layout_cost(f"{setup.model_prefix}-{name}", semantics=setup.semantics),
            setup,
            prefill_tps,
        )
        for name in setup.layouts
    ]
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    for i, sweep in enumerate(sweeps):
        x = np.asarray(sweep["prefill_tokens_per_s"]) / 1e3 / sweep["gpus"]
        color = f"C{i}"
        top.plot(
            x,
            np.asarray(sweep["colocated_step_s"]) * 1e3,
            color=color,
            label=f"colocated {sweep['layout']}",
        )
        top.plot(
            x,
            np.asarray(sweep["disaggregated_step_s"]) * 1e3,
            color=color,
            ls="--",
            label=f"decode-only {sweep['layout']}",
        )
        bottom.plot(
            x,
            sweep["colocated_decode_tokens_per_s_per_gpu"],
            color=color,
            label=f"colocated {sweep['layout']}",
        )
        bottom.plot(
            x,
            sweep["disaggregated_decode_tokens_per_s_per_gpu"],
            color=color,
            ls="--",
            label=f"split: {sweep['layout']} + {setup.prefill_layout} prefill",
        )
    top.set_ylabel("mean decode step (ms)")
    top.legend(fontsize=7)
    top.set_title(
        f"{setup.model_prefix}: {setup.batch_per_rank} sequences/rank at "
        f"{setup.context_tokens:,} tokens, prefill chunks of {setup.chunk_tokens:,}",
        fontsize=9,
    )
    bottom.set_ylabel("decode tokens/s per GPU\n(prefill GPUs included)")
    bottom.set_xlabel("prefill arrival (k tokens/s per decode-side GPU)")
    bottom.legend(fontsize=7)
    return _save(
        out,
        "a",
        {"setup": asdict(setup), "prefill_tokens_per_s_per_gpu": prefill_tps, "layouts": sweeps},
        fig,
    )


# ---------------------------------------------------------------------------------------
# (b) stage-specific parallelism through a sync step


def _load_over_time(telemetry, gpus: int, windows: int) -> dict:
    """Live decode sequences per GPU, their mean context, and prefill and decode tokens
    per second, in ``windows`` equal windows of the run."""
    from prorsa.telemetry.views import turn_table

    turns = turn_table(telemetry)
    start = turns["decode_start"].to_numpy(dtype=float)
    end = turns["decode_end"].to_numpy(dtype=float)
    ok = np.isfinite(start) & np.isfinite(end)
    start, end = start[ok], end[ok]
    context = turns["context_tokens"].to_numpy(dtype=float)[ok]
    output = turns["output_tokens"].to_numpy(dtype=float)[ok]
    prefill_at = turns["prefill_start"].to_numpy(dtype=float)
    prefill_new = turns["new_tokens"].to_numpy(dtype=float)
    horizon = float(np.nanmax(end)) if len(end) else 0.0
    edges = np.linspace(0.0, horizon, windows + 1)
    rows = []
    for t0, t1 in itertools.pairwise(edges):
        width = max(t1 - t0, 1e-9)
        overlap = np.clip(np.minimum(end, t1) - np.maximum(start, t0), 0.0, None)
        seqs = overlap.sum() / width
        ctx = float(np.average(context, weights=overlap)) if overlap.sum() > 0 else 0.0
        decode_rate = float((output * overlap / np.maximum(end - start, 1e-9)).sum() / width)
        in_window = (prefill_at >= t0) & (prefill_at < t1)
        prefill_rate = float(prefill_new[in_window].sum() / width)
        rows.append(
            {
                "t0_s": float(t0),
                "t1_s": float(t1),
                "decode_sequences_per_gpu": float(seqs / gpus),
                "decode_context_tokens": ctx,
                "decode_tokens_per_s": decode_rate,
                "prefill_tokens_per_s": prefill_rate,
            }
        )
    return {"windows": rows, "horizon_s": horizon}


def _gpu_s_per_s(option, prefill_rate: float, decode_rate: float, role: str) -> float:
    """GPU-seconds per second a role of this layout needs for the window's work."""
    if role == "prefill":
        return prefill_rate / max(option.prefill_tokens_per_s_per_gpu, 1e-9)
    if role == "decode":
        return decode_rate / max(option.decode_tokens_per_s_per_gpu, 1e-9)
    return prefill_rate * option.colocated_gpu_s_per_prefill_token + decode_rate / max(
        option.decode_tokens_per_s_per_gpu, 1e-9
    )


def stage_layouts(out: Path, regime=None, *, windows: int = 24) -> dict:
    """Mechanism (b): one colocated sync run of ``regime`` (default Qwen3-30B-A3B, mixed,
    16 per GPU) at its family's TP1; per window of the step, the best layout per role and
    the best single colocated layout at that moment's load, and the GPU-time each needs."""
    from prorsa.experiments.cells import Cell
    from prorsa.experiments.regimes import Regime
    from prorsa.runtime.cluster.layouts import OperatingPoint, layout_options
    from prorsa.runtime.sim.cost.layout import Layout

    regime = regime or Regime("qwen3-30b-a3b", "mixed", "sync", 16)
    family = regime.family
    scenario, trace = regime.workload_source()
    layout = family.baseline_layout
    cell = Cell(
        work=WorkloadConfig(
            scenario=scenario,
            trace=trace,
            mode="sync",
            trajectories=regime.load_per_gpu * family.gpus,
            seed=regime.seed,
        ),
        cluster=ClusterConfig(
            profile=family.profile,
            num_slots=family.gpus // Layout.parse(layout).gpus,
            layouts={r: layout for r in ("prefill", "decode", "colocated")},
        ),
        control=ControlConfig(policy="colocate"),
        knobs=regime.knobs,
        series=False,
    )
    telemetry = _run_with_telemetry(cell)
    load = _load_over_time(telemetry, family.gpus, windows)
    rows = []
    for w in load["windows"]:
        if w["decode_sequences_per_gpu"] <= 0 and w["prefill_tokens_per_s"] <= 0:
            continue
        point = OperatingPoint(
            batch_per_gpu=max(w["decode_sequences_per_gpu"], 1e-3),
            context_tokens=max(int(w["decode_context_tokens"]), 1),
        )
        options = layout_options(family.prefix, list(family.layouts), point)
        p, d = w["prefill_tokens_per_s"], w["decode_tokens_per_s"]
        need = {
            role: {o.name: _gpu_s_per_s(o, p, d, role) for o in options}
            for role in ("prefill", "decode", "colocated")
        }
        best = {role: min(v, key=v.get) for role, v in need.items()}
        per_role = need["prefill"][best["prefill"]] + need["decode"][best["decode"]]
        rows.append(
            {
                **w,
                "best_prefill": best["prefill"],
                "best_decode": best["decode"],
                "best_single": best["colocated"],
                "gpus_per_role_best": per_role,
                "gpus_single_best": need["colocated"][best["colocated"]],
                "gpus_colocated": need["colocated"],
            }
        )
    plt = _plt()
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    t = [(r["t0_s"] + r["t1_s"]) / 2 for r in rows]
    top.plot(t, [r["decode_sequences_per_gpu"] for r in rows], label="decode sequences/GPU")
    top2 = top.twinx()
    top2.plot(
        t, [r["prefill_tokens_per_s"] / 1e3 for r in rows], color="C1", label="prefill k tokens/s"
    )
    top.set_ylabel("decode sequences / GPU")
    top2.set_ylabel("prefill (k tokens/s)", color="C1")
    names = list(family.layouts)
    for i, key in enumerate(("best_prefill", "best_decode", "best_single")):
        mid.plot(
            t,
            [names.index(r[key]) + 0.08 * (i - 1) for r in rows],
            marker="o",
            ms=3,
            lw=1,
            label=key.replace("_", " "),
        )
    mid.set_yticks(range(len(names)), names, fontsize=7)
    mid.legend(fontsize=7)
    for name in names:
        bottom.plot(
            t, [r["gpus_colocated"][name] for r in rows], lw=0.8, alpha=0.6, label=f"single {name}"
        )
    bottom.plot(
        t,
        [r["gpus_per_role_best"] for r in rows],
        color="black",
        lw=2,
        label="best layout per role",
    )
    bottom.set_ylabel("GPUs needed at this load")
    bottom.set_xlabel("time in the sync step (s)")
    bottom.legend(fontsize=6, ncol=2)
    top.set_title(f"{regime.label}: best layouts as load moves through the step", fontsize=9)
    single = {name: float(np.sum([r["gpus_colocated"][name] for r in rows])) for name in names}
    fixed = min(single, key=single.get)
    per_role = float(np.sum([r["gpus_per_role_best"] for r in rows]))
    payload = {
        "regime": asdict(regime),
        "run_layout": layout,
        "windows": rows,
        "gpu_time_fixed_single_layout": {"layout": fixed, "gpu_s": single[fixed]},
        "gpu_time_best_single_per_window": float(np.sum([r["gpus_single_best"] for r in rows])),
        "gpu_time_best_per_role_per_window": per_role,
        "layout_changes": {
            key: sum(1 for a, b in itertools.pairwise(rows) if a[key] != b[key])
            for key in ("best_prefill", "best_decode", "best_single")
        },
    }
    return _save(out, "b", payload, fig)


def _run_with_telemetry(cell):
    """Telemetry of one cell (run_cell keeps only summaries)."""
    from prorsa.experiments.knobs import simulate_with_knobs
    from prorsa.runtime.sim.scenario import RunRequest

    request = RunRequest(work=cell.work, cluster=cell.cluster, control=cell.control, record=True)
    return simulate_with_knobs(request, cell.knobs).telemetry


# ---------------------------------------------------------------------------------------
# (c) completion times and the sync tail


def completion_tail(out: Path, summary: dict, cfg) -> dict:
    """Mechanism (c) for one mapped regime (``summary`` from :func:`run_map`): completion
    times under colocation at its best layout, best-static and predictive on the first
    held-out seed the map scored them on; the makespan is the slowest trajectory, so how
    much of it is the tail after most have finished."""
    from prorsa.experiments.cells import run_cell
    from prorsa.experiments.regimes import (
        Regime,
        RunPlan,
        _cell,
        _dynamic_cell,
        _same,
        _static_layouts,
        analytic_run_plan,
        plan_regime,
    )

    regime = Regime(**summary["regime"])
    if regime.mode != "sync":
        raise ConfigError("mechanism (c) is about sync steps: give a sync regime")
    plan = plan_regime(regime, cfg)
    seed = min(summary.get("eval_seeds") or [regime.seed])
    best = summary["colocate_best"]["layout"]
    cells = {"colocation@best": _cell(cfg, plan, "colocate", _same(best), seed=seed)}
    # A plan that failed on this seed (a draw too long for its layout) has no completion
    # times to show; the others are compared.
    ran = {
        name
        for name, p in summary["policies"].items()
        if math.isfinite(p.get("objective_by_seed", {}).get(seed, math.inf))
    }
    static = summary.get("best_static")
    if static and "best-static" in ran:  # scored where its search finished
        layouts = _static_layouts(static["prefill_layout"], static["decode_layout"])
        params = {"prefill_gpus": static["prefill_gpus"]}
        cells["best-static"] = _cell(cfg, plan, "static", layouts, params=params, seed=seed)
    if "predictive" in ran:
        # the plan the map ran the policy with (summaries before it was recorded: the
        # cost-model planner's)
        recorded = summary.get("run_plan")
        run_plan = RunPlan(**recorded) if recorded else analytic_run_plan(plan)
        cells["predictive"] = _dynamic_cell(cfg, plan, "predictive", run_plan, seed)
    runs = {name: run_cell(replace(cell, series=True)) for name, cell in cells.items()}
    stats = {}
    for name, run in runs.items():
        c = np.asarray(run["series"]["completion_s"], dtype=float)
        makespan = float(run["metrics"]["makespan_s"])
        p50, p90, p99 = (float(np.percentile(c, q)) for q in (50, 90, 99))
        stats[name] = {
            "makespan_s": makespan,
            "completion_s_p50": p50,
            "completion_s_p90": p90,
            "completion_s_p99": p99,
            "tail_after_p90_s": makespan - p90,
            "tail_share_of_makespan": (makespan - p90) / makespan if makespan else None,
            "completion_s": c.tolist(),
        }
    base = stats["colocation@best"]
    for s in stats.values():
        s["speedup_at_p50"] = base["completion_s_p50"] / s["completion_s_p50"]
        s["speedup_at_makespan"] = base["makespan_s"] / s["makespan_s"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (name, s) in enumerate(stats.items()):
        c = np.asarray(s["completion_s"])
        ax.plot(
            c,
            np.arange(1, len(c) + 1) / len(c),
            color=f"C{i}",
            ls=("-", "--", ":")[i % 3],
            label=(f"{name}: makespan {s['makespan_s']:.0f} s, p50 {s['completion_s_p50']:.0f} s"),
        )
        ax.axvline(s["makespan_s"], color=f"C{i}", ls=":", lw=0.8)
    ax.axhline(0.9, color="grey", lw=0.6)
    ax.set_xlabel("trajectory completion time (s)")
    ax.set_ylabel("fraction of trajectories done")
    ax.set_title(f"{regime.label}, seed {seed}: the tail sets the sync makespan", fontsize=9)
    ax.legend(fontsize=7)
    return _save(out, "c", {"regime": asdict(regime), "seed": seed, "runs": stats}, fig)


def brief(result: dict, max_items: int = 8) -> dict:
    """``result`` without its long series (for printing)."""

    def shorten(value):
        if isinstance(value, dict):
            return {k: shorten(v) for k, v in value.items()}
        if isinstance(value, list):
            if len(value) > max_items:
                return f"[{len(value)} values]"
            return [shorten(v) for v in value]
        return value

    return shorten(result)
