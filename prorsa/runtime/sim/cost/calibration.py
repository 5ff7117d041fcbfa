"""GPU calibration: timings measured by ``benchmarks/gpu_calibration.py`` against the model.

The script times real layer shapes on one GPU (random weights, PyTorch ops) and writes
``measured.json``: per grid point (batch, context, prefill chunk) the per-layer time
replayed from a CUDA graph and run eagerly. Here those points become

* a report: the measured full-model device time (per-layer time x layers + lm_head)
  next to ``LayoutCost``'s device time for the same work, and the relative error;
* measured terms a layout can load (``apply_measured_terms``): a device-time scale (the
  median measured/model ratio over the points) and the graph loss per layer (the median
  eager-minus-graph time of the decode points, per layer).

The measured shapes run one GPU's share of a layout: a whole TP1 engine, or one rank of
an expert-parallel layout (its attention and its ``E/ep`` experts, fed the gathered tokens
of every rank); the DP exchange is not on one GPU and is left out on both sides.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from prorsa.errors import ConfigError, InputError
from prorsa.runtime.sim.cost.layout_cost import LayoutCost
from prorsa.runtime.sim.cost.layout_terms import LayoutTerms

MEASURED_SCHEMA = "prorsa.gpu_calibration/1"
POINT_FIELDS = ("model", "layout", "batch", "context", "chunk", "graph_s", "eager_s", "layers")


def predicted_device_s(cost: LayoutCost, batch: int, context: int, chunk: int) -> float:
    """Model device time of one GPU's step: every rank decodes ``batch`` sequences of
    ``context`` tokens and prefills ``chunk`` tokens over ``context`` cached ones; the DP
    exchange, graph loss and scheduling are left out (the GPU script measures none)."""
    dp = cost.dp_ranks
    parts = cost.step_breakdown(
        [batch] * dp, [batch * context] * dp, [chunk] * dp, [context if chunk else 0] * dp
    )
    return parts["device_s"] - parts["exchange_s"]


def predicted_attention_s(cost: LayoutCost, batch: int, context: int, chunk: int) -> float:
    """The model's attention-kernel time of one rank's step (every layer): decode rows
    over ``context`` cached tokens each, plus a chunk over ``context`` prior tokens."""
    seconds = 0.0
    if batch:
        seconds += cost.decode_attention_s(batch, batch * context)
    if chunk:
        seconds += cost.prefill_attention_s(chunk, context)
    return seconds


def step_kind(point: dict) -> str:
    """decode (no chunk), prefill (no decode rows) or mixed."""
    if not point["chunk"]:
        return "decode"
    return "prefill" if not point["batch"] else "mixed"


def merge_measured(runs: list[dict]) -> dict:
    """One measurement from repeated runs of the same grid: per point the median graph
    and lm_head time and the *smallest* eager time (eager steps are host-launch bound, and
    host interference only ever adds to them: run 2 of the shipped H200 runs had eager
    outliers up to +0.5 ms/layer while its graph times matched run 1 within 2 %)."""
    if not runs:
        raise ConfigError("merge_measured needs at least one run")
    if len(runs) == 1:
        return runs[0]

    def key(p):
        return (p["model"], p["layout"], p["batch"], p["context"], p["chunk"], p["layers"])

    by_key: dict[tuple, list[dict]] = {}
    for run in runs:
        for point in run["points"]:
            by_key.setdefault(key(point), []).append(point)
    points = []
    for same in by_key.values():
        merged = {k: v for p in same for k, v in p.items()}  # later runs add fields
        merged["graph_s"] = statistics.median(p["graph_s"] for p in same)
        merged["eager_s"] = min(p["eager_s"] for p in same)
        merged["lm_head_s"] = statistics.median(p.get("lm_head_s", 0.0) for p in same)
        cores = [p["attention_core_s"] for p in same if "attention_core_s" in p]
        if cores:
            merged["attention_core_s"] = statistics.median(cores)
        merged["runs"] = len(same)
        points.append(merged)
    first = runs[0]
    return {
        **{k: v for k, v in first.items() if k not in ("points", "failed", "wall_s")},
        "runs": len(runs),
        "wall_s": sum(r.get("wall_s", 0.0) for r in runs),
        "points": points,
    }


def load_measured(path: str | Path) -> dict:
    """Read and check a ``measured.json`` written by the GPU script."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read measured timings ({exc})", source=str(path)) from None
    if data.get("schema") != MEASURED_SCHEMA:
        raise InputError(f"schema must be {MEASURED_SCHEMA!r}", source=str(path), field="schema")
    for i, point in enumerate(data.get("points", [])):
        for name in POINT_FIELDS:
            if name not in point:
                raise InputError("missing field", source=str(path), record=i, field=name)
        for name in ("graph_s", "eager_s"):
            if not point[name] > 0:
                raise InputError("seconds must be > 0", source=str(path), record=i, field=name)
    return data


def full_model_s(point: dict, num_layers: int, key: str = "graph_s") -> float:
    """Per-layer measured time scaled to every layer, plus the measured lm_head."""
    return point[key] / point["layers"] * num_layers + point.get("lm_head_s", 0.0)


def report_rows(measured: dict, costs: dict[tuple[str, str], LayoutCost]) -> list[dict]:
    """One row per measured point with the model's device time and the relative error."""
    rows = []
    for point in measured["points"]:
        cost = costs.get((point["model"], point["layout"]))
        row = {k: point[k] for k in ("model", "layout", "batch", "context", "chunk")}
        if cost is None:
            row.update(measured_s=None, model_s=None, rel_error=None, skipped="no layout")
        elif not within_step_budget(cost, point):
            # the modelled engine never runs this step (its scheduler caps tokens per step)
            row.update(
                measured_s=full_model_s(point, cost.terms.num_layers),
                model_s=None,
                rel_error=None,
                skipped=f"over max_step_tokens {cost.max_step_tokens}",
            )
        else:
            measured_s = full_model_s(point, cost.terms.num_layers)
            model_s = predicted_device_s(cost, point["batch"], point["context"], point["chunk"])
            row.update(
                kind=step_kind(point),
                measured_s=measured_s,
                model_s=model_s,
                rel_error=(model_s - measured_s) / measured_s,
                eager_minus_graph_per_layer_s=(point["eager_s"] - point["graph_s"])
                / point["layers"],
            )
            if "attention_core_s" in point:  # the attention kernels alone, every layer
                layers = cost.terms.num_layers
                attn_measured = point["attention_core_s"] / point["layers"] * layers
                attn_model = predicted_attention_s(
                    cost, point["batch"], point["context"], point["chunk"]
                )
                row.update(
                    attention_measured_s=attn_measured,
                    attention_model_s=attn_model,
                    attention_rel_error=(attn_model - attn_measured) / attn_measured,
                    rest_measured_s=measured_s - attn_measured,
                    rest_model_s=model_s - attn_model,
                )
        rows.append(row)
    return rows


def within_step_budget(cost: LayoutCost, point: dict) -> bool:
    """Whether the layout's engine would run this point's tokens in one step."""
    return point["batch"] + point["chunk"] <= cost.max_step_tokens


def measured_terms(measured: dict, model: str, layout: str, cost: LayoutCost) -> dict:
    """The terms a layout loads from one model's measured points (see module docstring)."""
    points = [
        p
        for p in measured["points"]
        if p["model"] == model and p["layout"] == layout and within_step_budget(cost, p)
    ]
    if not points:
        raise ConfigError(f"no measured points for {model} at {layout}")
    ratios = [
        full_model_s(p, cost.terms.num_layers)
        / predicted_device_s(cost, p["batch"], p["context"], p["chunk"])
        for p in points
    ]
    decode = [p for p in points if step_kind(p) == "decode"] or points
    loss = [max(p["eager_s"] - p["graph_s"], 0.0) / p["layers"] for p in decode]
    by_kind = {}
    for kind in ("decode", "prefill", "mixed"):
        r = [x for x, p in zip(ratios, points, strict=True) if step_kind(p) == kind]
        by_kind[kind] = statistics.median(r) if r else None
    cores = [p for p in points if "attention_core_s" in p and p["chunk"] and not p["batch"]]
    prefill_attention_scale = (
        statistics.median(
            p["attention_core_s"]
            / p["layers"]
            * cost.terms.num_layers
            / predicted_attention_s(cost, 0, p["context"], p["chunk"])
            for p in cores
        )
        if cores
        else None
    )
    return {
        "model": model,
        "layout": layout,
        "device": measured.get("device", "unknown"),
        "dry_run": bool(measured.get("dry_run", False)),
        "points": len(points),
        "device_scale": statistics.median(ratios),
        "graph_loss_per_layer_s": statistics.median(loss),
        "device_scale_by_kind": by_kind,
        "prefill_attention_scale": prefill_attention_scale,
        "method": "device_scale: median of measured (per-layer x layers + lm_head) over the "
        "model's device time; graph_loss_per_layer_s: median eager-minus-graph per layer "
        "of the decode points (PyTorch eager, an upper bound for vLLM's piecewise mode); "
        "device_scale_by_kind: the same median over decode-only, prefill-only and mixed "
        "points; prefill_attention_scale: median measured attention kernels alone over the "
        "model's prefill attention term, prefill-only points",
    }


def apply_measured_terms(terms: LayoutTerms, measured: dict) -> LayoutTerms:
    """A copy of ``terms`` with device curves scaled and the graph loss replaced."""
    if measured.get("model") != terms.model or measured.get("layout") != terms.layout:
        raise ConfigError(
            f"measured terms are for {measured.get('model')} at {measured.get('layout')}, "
            f"not {terms.model} at {terms.layout}"
        )
    scale = float(measured["device_scale"])
    if not scale > 0:
        raise ConfigError("measured terms: field 'device_scale' must be > 0")

    def scaled(values: list) -> list:
        return [v * scale for v in values]

    provenance = dict(terms.provenance)
    provenance["measured"] = measured
    return dataclasses.replace(
        terms,
        dense_s=scaled(terms.dense_s),
        lm_head_s=scaled(terms.lm_head_s),
        attn_decode_fixed_s=scaled(terms.attn_decode_fixed_s),
        attn_decode_per_ctx_token_s=scaled(terms.attn_decode_per_ctx_token_s),
        attn_prefill_per_chunk_s=terms.attn_prefill_per_chunk_s * scale,
        attn_prefill_s_per_token2=terms.attn_prefill_s_per_token2 * scale,
        moe_s={k: scaled(v) for k, v in terms.moe_s.items()},
        graph_loss_s=terms.num_layers * float(measured["graph_loss_per_layer_s"]),
        source="timings",
        provenance=provenance,
    )
