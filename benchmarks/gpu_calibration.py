"""GPU calibration of the layout cost model: real layer shapes on one GPU, PyTorch only.

For each model (shapes from ``datasets/model_configs/*.json``, random bf16 weights) a few
decoder layers are built from PyTorch ops — RMSNorm, fused QKV/O projections, scaled-dot-
product attention over a KV cache, a dense SwiGLU MLP or a top-k routed MoE (grouped GEMM
over the experts this GPU holds) — and timed for decode-only, prefill-only and mixed steps
over batch {32, 64, 128} x context {8k, 16k, 32k} x prefill chunk {0, 512, 2048, 8192},
once replayed from a CUDA graph and once run eagerly. Qwen3-235B-A22B is measured as one
rank of its DP8/EP8 layout (full attention, 16 of 128 experts, fed all 8 ranks' tokens).

Writes into ``--out`` (default ``benchmarks/results/gpu_calibration``):

* ``measured.json``: per point the per-layer graph and eager times and the lm_head time;
* ``terms/<profile>.json``: measured terms a layout loads
  (``prorsa.runtime.sim.cost.calibration.apply_measured_terms``);
* ``report.json``: measured full-model device time next to ``LayoutCost``'s, relative
  error per point (also printed); a summary goes to ``benchmarks/results/gpu_calibration.json``.

``measured.json`` is rewritten after every point and ``--max-wall-s`` stops starting new
ones, so a run cut short keeps what it measured; a point that fails (out of memory, a
missing kernel) is listed under ``failed`` and the rest still run. ``--components`` also
times the attention kernels alone. The measuring part needs only PyTorch (and Triton
through it); the report and terms need prorsa (numpy): without it they are skipped, and
``--report-from run1.json [run2.json ...]`` makes them later on any machine, merging
repeated runs. ``--dry-run`` runs the whole pipeline on CPU with a tiny shape.

    python benchmarks/gpu_calibration.py --components    # one H200, ~4 minutes
    R=benchmarks/results/gpu_calibration   # the shipped H200 runs, reported on any machine
    python benchmarks/gpu_calibration.py --out $R --report-from $R/measured-h200-run*.json
    python benchmarks/gpu_calibration.py --dry-run --out /tmp/cal
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "datasets" / "model_configs"
SCHEMA = "prorsa.gpu_calibration/1"
# model -> (layout it is compared against, expert-parallel ranks this GPU is one of)
# (measured in this order: MoE first, the terms the regime map most needs)
TARGETS = {
    "qwen3-30b-a3b": ("tp1", 1),
    "qwen3-235b-a22b": ("tp1-dp8-ep8", 8),
    "qwen2.5-7b": ("tp1", 1),
    "qwen2.5-32b": ("tp1", 1),
}
GRID = {"batch": (32, 64, 128), "context": (8192, 16384, 32768), "chunk": (0, 512, 2048, 8192)}
DRY_GRID = {"batch": (2, 4), "context": (32, 64), "chunk": (0, 16)}
TINY_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


@dataclass(frozen=True)
class Shape:
    """What the layers need from a Hugging Face config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    experts: int
    topk: int
    moe_inter: int

    @classmethod
    def from_config(cls, c: dict) -> Shape:
        experts = int(c.get("num_experts", 0) or 0)
        return cls(
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            inter=0 if experts else c["intermediate_size"],
            vocab=c["vocab_size"],
            experts=experts,
            topk=int(c.get("num_experts_per_tok", 0) or 0),
            moe_inter=int(c.get("moe_intermediate_size", 0) or 0),
        )


# ---- the layers ------------------------------------------------------------------------
def _rand(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype) * 0.02


def _grouped_mm_works(device) -> bool:
    """torch._grouped_mm (bf16 grouped GEMM, Hopper) is used when it runs here."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
        b = torch.randn(2, 64, 32, device=device, dtype=torch.bfloat16)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        torch._grouped_mm(a, b.transpose(-2, -1).contiguous().transpose(-2, -1), offs=offs)
        return True
    except (RuntimeError, TypeError):
        return False


class Layers:
    """``n`` decoder layers of one shape on one GPU (``local_experts`` of the experts)."""

    def __init__(self, shape: Shape, n: int, local_experts: int, device, dtype) -> None:
        self.s, self.n, self.device, self.dtype = shape, n, device, dtype
        h, d, kv = shape.heads, shape.head_dim, shape.kv_heads
        self.local = local_experts
        self.grouped = _grouped_mm_works(device)
        self.attention: dict[str, str] = {}
        self.w = []
        for _ in range(n):
            w = {
                "norm1": torch.ones(shape.hidden, device=device, dtype=dtype),
                "norm2": torch.ones(shape.hidden, device=device, dtype=dtype),
                "qkv": _rand(shape.hidden, (h + 2 * kv) * d, device=device, dtype=dtype),
                "o": _rand(h * d, shape.hidden, device=device, dtype=dtype),
            }
            if shape.experts:
                w["router"] = _rand(shape.hidden, shape.experts, device=device, dtype=dtype)
                # [E, N, K] row-major: transposed on use, the layout grouped GEMMs want
                w["w13"] = _rand(
                    local_experts, 2 * shape.moe_inter, shape.hidden, device=device, dtype=dtype
                )
                w["w2"] = _rand(
                    local_experts, shape.hidden, shape.moe_inter, device=device, dtype=dtype
                )
            else:
                w["gate_up"] = _rand(shape.hidden, 2 * shape.inter, device=device, dtype=dtype)
                w["down"] = _rand(shape.inter, shape.hidden, device=device, dtype=dtype)
            self.w.append(w)
        self.lm_head = _rand(shape.hidden, shape.vocab, device=device, dtype=dtype)

    @staticmethod
    def _norm(x, weight):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * weight

    def _attention(self, q, k_cache, v_cache, batch: int, context: int, chunk: int):
        """Decode rows attend to ``context`` cached tokens each; the chunk's rows attend
        causally to ``context`` cached tokens plus the chunk."""
        s = self.s
        outs = []
        if batch:
            qd = q[:batch].view(batch, s.heads, 1, s.head_dim)
            k = k_cache[:batch, :, :context]
            v = v_cache[:batch, :, :context]
            outs.append(self._attend("decode", qd, k, v, None).reshape(batch, -1))
        if chunk:
            qp = q[batch:].view(1, chunk, s.heads, s.head_dim).transpose(1, 2)
            k = k_cache[:1, :, : context + chunk]
            v = v_cache[:1, :, : context + chunk]
            out = self._attend("chunk", qp, k, v, (chunk, context + chunk))
            outs.append(out.transpose(1, 2).reshape(chunk, -1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend(self, path: str, q, k, v, causal):
        """Attention in the path's mode; the first call tries the modes in order."""
        if path in self.attention:
            return _sdpa(q, k, v, causal, self.attention[path])
        for mode in ATTENTION_MODES[path]:
            try:
                out = _sdpa(q, k, v, causal, mode)
            except (RuntimeError, TypeError) as exc:
                print(f"  attention {path}: {mode} unavailable ({str(exc).splitlines()[0][:80]})")
                continue
            self.attention[path] = mode
            return out
        raise RuntimeError(f"no attention kernel runs the {path} path")

    def _moe(self, x, w, ranks: int):
        s = self.s
        if ranks > 1:  # this GPU's MoE sees every rank's tokens after the all-gather
            x = x.repeat(ranks, 1)
        logits = x @ w["router"]
        weights, ids = torch.topk(logits.float().softmax(-1), s.topk, dim=-1)
        pairs = ids.reshape(-1)
        token_of_pair = torch.arange(x.shape[0], device=x.device).repeat_interleave(s.topk)
        # pairs on other GPUs' experts sort behind the local ones and are not computed
        key = torch.where(pairs < self.local, pairs, self.local)
        order = torch.argsort(key, stable=True)
        # scatter-add, not bincount: bincount syncs with the host, which a graph forbids
        counts = torch.zeros(self.local + 1, device=x.device, dtype=torch.int64)
        counts = counts.scatter_add_(0, key, torch.ones_like(key))[: self.local]
        rows = x[token_of_pair[order]]
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            up = torch._grouped_mm(rows, w["w13"].transpose(-2, -1), offs=offs)
            gate, val = up.chunk(2, dim=-1)
            out = torch._grouped_mm(F.silu(gate) * val, w["w2"].transpose(-2, -1), offs=offs)
        else:  # per-expert loop: eager only (sizes come back to the host)
            out = torch.zeros(rows.shape[0], s.hidden, device=x.device, dtype=x.dtype)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    up = rows[start : start + c] @ w["w13"][e].T
                    gate, val = up.chunk(2, dim=-1)
                    out[start : start + c] = (F.silu(gate) * val) @ w["w2"][e].T
                start += c
        scale = weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(x).index_add_(0, token_of_pair[order], out * scale)
        return combined[: x.shape[0] // ranks]

    def attention_core(self, qkv, k_cache, v_cache, batch: int, context: int, chunk: int):
        """Only the attention kernels of every layer (no projections, norms or MLP): the
        part of a step the model's attention terms stand for."""
        q = qkv[:, : self.s.heads * self.s.head_dim]
        for _ in self.w:
            out = self._attention(q, k_cache, v_cache, batch, context, chunk)
        return out

    def forward(self, x, k_cache, v_cache, batch: int, context: int, chunk: int, ranks: int):
        s = self.s
        for w in self.w:
            hs = self._norm(x, w["norm1"])
            qkv = hs @ w["qkv"]
            q = qkv[:, : s.heads * s.head_dim]
            attn = self._attention(q, k_cache, v_cache, batch, context, chunk)
            x = x + attn @ w["o"]
            hs = self._norm(x, w["norm2"])
            if s.experts:
                x = x + self._moe(hs, w, ranks)
            else:
                gate, val = (hs @ w["gate_up"]).chunk(2, dim=-1)
                x = x + (F.silu(gate) * val) @ w["down"]
        return x


# How attention runs, per path, decided by the first call that works: "gqa" (fused kernel,
# grouped KV heads), "fold" (decode only: a KV head's query heads become its query rows, no
# copy), "expanded" (KV heads repeated: a copy the engines do not make) or "math" (PyTorch's
# reference kernel). Later calls, CUDA-graph captures included, reuse the choice.
ATTENTION_MODES = {
    "decode": ("gqa", "fold", "expanded", "math"),
    "chunk": ("gqa", "expanded", "math"),
}


def _sdpa(q, k, v, causal, mode: str):
    """Scaled-dot-product attention with grouped KV heads; ``causal=(q_len, kv_len)``
    aligns the causal mask to the end of the keys (a chunk after its cached prefix).
    On a GPU the fused kernels are required unless ``mode`` is "math": a silent fallback
    would materialise a chunk x context mask and time PyTorch's reference kernel."""
    kwargs = {}
    if causal is not None:
        q_len, kv_len = causal
        if q_len == kv_len:
            kwargs["is_causal"] = True
        else:
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(q_len, kv_len)
    if mode == "fold":  # decode: (B, H, 1, d) -> (B, kv, H/kv, d), no mask
        b, h, _, d = q.shape
        out = _sdpa(q.reshape(b, k.shape[1], h // k.shape[1], d), k, v, None, "gqa")
        return out.reshape(b, h, 1, d)
    if q.shape[1] != k.shape[1]:
        if mode == "gqa":
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if q.device.type != "cuda" or mode == "math":
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        fused.append(SDPBackend.CUDNN_ATTENTION)
    with sdpa_kernel(fused):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


# ---- timing ---------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(fn, device, iters: int) -> float:
    """Median seconds per call, host launch included (events span the whole call)."""
    fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_graph(fn, device, iters: int) -> tuple[float, bool]:
    """Median seconds per CUDA-graph replay; on CPU (dry run) the eager call stands in."""
    if device.type != "cuda":
        return time_eager(fn, device, iters), False
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_eager(graph.replay, device, iters), True


# ---- the grid -------------------------------------------------------------------------
def grid_points(grid: dict) -> list[tuple[int, int, int]]:
    """(batch, context, chunk): decode-only, prefill-only (batch 0) and mixed steps."""
    points = []
    for context in grid["context"]:
        for chunk in grid["chunk"]:
            batches = grid["batch"] if chunk == 0 else (0, *grid["batch"])
            points += [(b, context, chunk) for b in batches]
    return points


def measure_point(layers: Layers, caches, batch: int, context: int, chunk: int, args) -> dict:
    """Graph and eager time of one step of ``layers`` (and the lm_head) at one grid point."""
    shape, device, dtype = layers.s, layers.device, layers.dtype
    k_cache, v_cache, ranks = caches
    x = torch.randn(batch + chunk, shape.hidden, device=device, dtype=dtype)
    h_last = torch.randn(batch + (1 if chunk else 0), shape.hidden, device=device, dtype=dtype)

    def step():
        return layers.forward(x, k_cache, v_cache, batch, context, chunk, ranks)

    def lm_head():
        return h_last @ layers.lm_head

    with torch.inference_mode():
        eager_s = time_eager(step, device, args.iters)
        graph_s, real_graph = eager_s, False
        if layers.grouped or not shape.experts:  # the per-expert loop is not capturable
            try:
                graph_s, real_graph = time_graph(step, device, args.iters)
            except RuntimeError as exc:  # keep measuring: record the point as eager only
                print(f"  no CUDA graph for this point ({str(exc).splitlines()[0][:100]})")
        lm_s, _ = time_graph(lm_head, device, args.iters)
        extra = {}
        if args.components:
            width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
            qkv = torch.randn(batch + chunk, width, device=device, dtype=dtype)

            def core():
                return layers.attention_core(qkv, k_cache, v_cache, batch, context, chunk)

            extra["attention_core_s"], _ = time_graph(core, device, args.iters)
    return {
        **extra,
        "batch": batch,
        "context": context,
        "chunk": chunk,
        "layers": args.layers,
        "graph_s": graph_s,
        "eager_s": eager_s,
        "lm_head_s": lm_s,
        "cuda_graph": real_graph,
        "attention": dict(layers.attention),
        "grouped_gemm": bool(shape.experts and layers.grouped),
    }


def measure_model(
    name: str, shape: Shape, args, device, dtype, grid: dict, deadline: float, sink
) -> tuple[list[dict], list[dict]]:
    """Every grid point of one model: (points, failures). ``sink(points)`` is called after
    each point so a run cut short keeps what it measured; points past ``deadline``
    (``time.perf_counter()``) are skipped and listed as failures."""
    layout, ranks = TARGETS.get(name, ("tp1", 1))
    local = shape.experts // ranks if shape.experts else 0
    layers = Layers(shape, args.layers, local, device, dtype)
    max_b, max_ctx, max_chunk = max(grid["batch"]), max(grid["context"]), max(grid["chunk"])
    cache_shape = (max_b, shape.kv_heads, max_ctx + max_chunk, shape.head_dim)
    caches = (
        torch.randn(cache_shape, device=device, dtype=dtype),
        torch.randn(cache_shape, device=device, dtype=dtype),
        ranks,
    )
    out, failed = [], []
    for batch, context, chunk in grid_points(grid):
        where = {
            "model": name,
            "layout": layout,
            "batch": batch,
            "context": context,
            "chunk": chunk,
        }
        if time.perf_counter() > deadline:
            failed.append({**where, "error": "skipped: --max-wall-s reached"})
            continue
        try:
            point = {**where, **measure_point(layers, caches, batch, context, chunk, args)}
        except RuntimeError as exc:  # out of memory, a kernel missing: the rest still runs
            failed.append({**where, "error": str(exc).splitlines()[0][:200]})
            print(f"{name:16} b={batch:4} ctx={context:6} chunk={chunk:5}  failed: {exc}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        out.append(point)
        sink(out)
        print(
            f"{name:16} b={batch:4} ctx={context:6} chunk={chunk:5}  "
            f"graph {point['graph_s'] * 1e3 / args.layers:8.3f} ms/layer  "
            f"eager {point['eager_s'] * 1e3 / args.layers:8.3f} ms/layer",
            flush=True,
        )
    return out, failed


def device_description(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


# ---- report (needs prorsa) ---------------------------------------------------------------
def write_report(measured: dict, out: Path, *, save_summary: bool) -> dict | None:
    """Model-vs-measured report and measured terms; None when prorsa cannot be imported."""
    try:
        sys.path.insert(0, str(REPO))
        from prorsa.runtime.sim.cost import layout_cost_for
        from prorsa.runtime.sim.cost.calibration import measured_terms, report_rows
    except ImportError as exc:
        print(f"report skipped ({exc}); run --report-from {out / 'measured.json'} with prorsa")
        return None
    keys = sorted({(p["model"], p["layout"]) for p in measured["points"]})
    costs = {(m, lay): layout_cost_for(m, lay) for m, lay in keys}
    rows = report_rows(measured, costs)
    terms_dir = out / "terms"
    terms_dir.mkdir(parents=True, exist_ok=True)
    terms = {}
    for model, layout in keys:
        t = measured_terms(measured, model, layout, costs[(model, layout)])
        path = terms_dir / f"h200-{model}-{layout}.json"
        path.write_text(json.dumps(t, indent=2) + "\n")
        terms[f"{model} {layout}"] = t
    errors = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    summary = {
        "device": measured["device"],
        "dry_run": measured["dry_run"],
        "runs": measured.get("runs", 1),
        "points": len(rows),
        "median_abs_rel_error": statistics.median(errors) if errors else None,
        "max_abs_rel_error": max(errors) if errors else None,
        "model_vs_measured": error_table(rows),
        "terms": terms,
    }
    report = {"summary": summary, "rows": rows}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_model_vs_measured(rows, out / "model-vs-measured.png", measured["device"])
    print(
        f"{'model':16} {'layout':12} {'b':>4} {'ctx':>6} {'chunk':>5} "
        f"{'measured ms':>12} {'model ms':>10} {'error':>7}"
    )
    for r in rows:
        if r["rel_error"] is None:
            continue
        print(
            f"{r['model']:16} {r['layout']:12} {r['batch']:4} {r['context']:6} {r['chunk']:5} "
            f"{r['measured_s'] * 1e3:12.2f} {r['model_s'] * 1e3:10.2f} {r['rel_error']:+7.1%}"
        )
    print("median (model - measured) / measured, by step kind; attention kernels alone:")
    for model, kinds in summary["model_vs_measured"].items():
        cells = "  ".join(f"{k} {v:+.0%}" for k, v in kinds.items() if v is not None)
        print(f"  {model:16} {cells}")
    for name, t in terms.items():
        print(
            f"{name}: device scale {t['device_scale']:.3f}, graph loss "
            f"{t['graph_loss_per_layer_s'] * 1e6:.1f} us/layer"
        )
    if save_summary:
        from benchmarks._common import save

        save("gpu_calibration", summary)
    return report


def plot_model_vs_measured(rows: list[dict], path: Path, device: str) -> None:
    """Model time against measured time per point, one panel per model, coloured by step
    kind, with the attention kernels alone as hollow markers (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows if r["rel_error"] is not None})
    if not models:
        return
    colours = {"decode": "tab:blue", "prefill": "tab:red", "mixed": "tab:purple"}
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model and r["rel_error"] is not None]
        for kind, colour in colours.items():
            pts = [r for r in mine if r["kind"] == kind]
            ax.scatter(
                [1e3 * r["measured_s"] for r in pts],
                [1e3 * r["model_s"] for r in pts],
                s=14,
                color=colour,
                label=f"{kind} step",
            )
            attn = [r for r in pts if "attention_model_s" in r and kind != "mixed"]
            ax.scatter(
                [1e3 * r["attention_measured_s"] for r in attn],
                [1e3 * r["attention_model_s"] for r in attn],
                s=14,
                facecolors="none",
                edgecolors=colour,
                label=f"{kind} attention" if attn else None,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.set_title(f"{model} ({mine[0]['layout']})", fontsize=9)
        ax.set_xlabel("measured (ms)")
    axes[0][0].set_ylabel("model (ms)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Step time, model vs measured on {device} (on the line: exact)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def error_table(rows: list[dict]) -> dict:
    """Per model, the median relative error of the whole step by kind (decode, prefill,
    mixed) and of the attention kernels alone (decode-only and prefill-only points)."""
    table: dict[str, dict] = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["rel_error"] is not None]
        cells = {}
        for kind in ("decode", "prefill", "mixed"):
            errs = [r["rel_error"] for r in mine if r["kind"] == kind]
            cells[kind] = statistics.median(errs) if errs else None
        for kind in ("decode", "prefill"):
            errs = [
                r["attention_rel_error"]
                for r in mine
                if r["kind"] == kind and "attention_rel_error" in r
            ]
            cells[f"attention_{kind}"] = statistics.median(errs) if errs else None
        table[model] = cells
    return table


# ---- main -----------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, small grid.")
    p.add_argument("--models", default=",".join(TARGETS), help="Comma-separated model names.")
    p.add_argument("--layers", type=int, default=4, help="Layers built and timed per model.")
    p.add_argument("--iters", type=int, default=10, help="Timed repetitions per point.")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_calibration")
    p.add_argument(
        "--report-from",
        type=Path,
        nargs="+",
        help="Only write the report of one measured.json, or of repeated runs merged "
        "(median graph time, smallest eager time per point).",
    )
    for axis in ("batch", "context", "chunk"):
        p.add_argument(
            f"--{axis}",
            type=lambda v: tuple(int(x) for x in v.split(",")),
            help=f"Comma-separated {axis} values instead of the default grid's.",
        )
    p.add_argument(
        "--components",
        action="store_true",
        help="Also time the attention kernels alone (attention_core_s) at every point.",
    )
    p.add_argument(
        "--max-wall-s",
        type=float,
        default=480.0,
        help="Stop starting new points after this many seconds (what was measured is kept).",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_from:
        sys.path.insert(0, str(REPO))
        from prorsa.runtime.sim.cost.calibration import load_measured, merge_measured

        measured = merge_measured([load_measured(path) for path in args.report_from])
        write_report(measured, args.out, save_summary=not measured.get("dry_run", True))
        return 0
    models = [m for m in args.models.split(",") if m]
    if args.dry_run:
        torch.set_num_threads(1)  # tiny ops: threads only add noise
        device, dtype, grid = torch.device("cpu"), torch.float32, DRY_GRID
        args.layers, args.iters = min(args.layers, 2), min(args.iters, 2)
        # the tiny shape stands in for the first model so the report path runs end to end
        shapes = {m: Shape.from_config(TINY_CONFIG) for m in models}
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run to check the pipeline on CPU")
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        grid = {axis: getattr(args, axis) or values for axis, values in GRID.items()}
        shapes = {
            m: Shape.from_config(json.loads((CONFIG_DIR / f"{m}.json").read_text())) for m in models
        }
    t0 = time.perf_counter()
    deadline = t0 + args.max_wall_s
    points: list[dict] = []
    failed: list[dict] = []

    def measured_so_far(extra: list[dict] = ()) -> dict:
        return {
            "schema": SCHEMA,
            "device": device_description(device),
            "torch": torch.__version__,
            "dry_run": bool(args.dry_run),
            "layers_timed": args.layers,
            "iters": args.iters,
            "grid": {k: list(v) for k, v in grid.items()},
            "wall_s": time.perf_counter() - t0,
            "points": points + list(extra),
            "failed": failed,
        }

    def write(extra: list[dict] = ()) -> None:
        (args.out / "measured.json").write_text(json.dumps(measured_so_far(extra), indent=2) + "\n")

    print(f"torch {torch.__version__} on {device_description(device)}", flush=True)
    for name, shape in shapes.items():
        got, lost = measure_model(name, shape, args, device, dtype, grid, deadline, write)
        points += got
        failed += lost
        write()
        if device.type == "cuda":  # the model's weights and KV cache are gone: hand back
            torch.cuda.empty_cache()
    measured = measured_so_far()
    write()
    print(
        f"{len(points)} points, {len(failed)} failed or skipped, in {measured['wall_s']:.0f} s "
        f"-> {args.out / 'measured.json'}"
    )
    write_report(measured, args.out, save_summary=not args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
