"""``prorsa profile``: list, inspect and refit engine cost profiles."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from prorsa.cli.common import console, friendly_errors, print_json

app = typer.Typer(no_args_is_help=True)

PREFILL_POINTS = (2048, 8192)
DECODE_BATCHES = (1, 64, 128)
DECODE_CONTEXT = 2048


def profile_summary(name: str) -> dict:
    """The numbers `profile show` prints, as a JSON-ready dict (times in milliseconds)."""
    from prorsa.runtime.sim.cost import get_profile

    p = get_profile(name)
    return {
        "name": p.name,
        "source": p.source,
        "model": p.model,
        "hardware": p.hardware,
        "tp": p.tp,
        "prefill_ms": {str(n): round(1e3 * p.prefill_time_s(n), 3) for n in PREFILL_POINTS},
        "decode_step_ms_at_2k_context": {
            str(b): round(1e3 * p.decode_step_time_s(b, b * DECODE_CONTEXT), 3)
            for b in DECODE_BATCHES
        },
        "kv_capacity_tokens": p.kv_capacity_tokens,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "max_batch": p.max_batch,
        "max_step_tokens": p.max_step_tokens,
        "coefficients": {
            "prefill_base_s": p.prefill_base_s,
            "prefill_per_token_s": p.prefill_per_token_s,
            "prefill_attn_s_per_token2": p.prefill_attn_s_per_token2,
            "decode_base_s": p.decode_base_s,
            "decode_per_seq_s": p.decode_per_seq_s,
            "decode_per_ctx_token_s": p.decode_per_ctx_token_s,
            "decode_floor_s": p.decode_floor_s,
            "mixed_overhead_s": p.mixed_overhead_s,
        },
    }


@app.command("list")
@friendly_errors
def list_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the registered cost profiles (name, source, model, GPU, TP, KV capacity)."""
    from prorsa.runtime.sim.cost import get_profile, list_profiles

    names = list_profiles()
    if as_json:
        print_json(names)
        return
    table = Table("profile", "source", "model", "GPU", "TP", "KV tokens")
    for name in names:
        p = get_profile(name)
        table.add_row(name, p.source, p.model, p.hardware, str(p.tp), f"{p.kv_capacity_tokens:,}")
    console.print(table)


@app.command("show")
@friendly_errors
def show_command(
    name: str = typer.Argument(..., help="Profile name (see `prorsa profile list`)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Prefill and decode step times, KV capacity and source of one profile."""
    summary = profile_summary(name)
    if as_json:
        print_json(summary)
        return
    title = (
        f"{summary['name']} ({summary['source']}: {summary['model']} on "
        f"{summary['tp']} x {summary['hardware']})"
    )
    table = Table("quantity", "value", title=title)
    for n, ms in summary["prefill_ms"].items():
        table.add_row(f"prefill {n} tokens", f"{ms:.2f} ms")
    for b, ms in summary["decode_step_ms_at_2k_context"].items():
        table.add_row(f"decode step, batch {b}, 2k context", f"{ms:.2f} ms")
    table.add_row("KV capacity", f"{summary['kv_capacity_tokens']:,} tokens")
    table.add_row("KV bytes per token", f"{summary['kv_bytes_per_token']:,}")
    console.print(table)


@app.command("fit-aiconfigurator")
@friendly_errors
def fit_aiconfigurator_command(
    data: Path = typer.Option(
        None,
        "--data",
        help="Folder with the three kernel-table parquet files "
        "(default: ../shared/data/profiles/aiconfigurator-h200-vllm-0.19).",
    ),
    out: Path = typer.Option(Path("datasets/profiles"), "--out", "-o", help="Folder for JSON."),
) -> None:
    """Refit the H200 profiles to the measured kernel tables and write them as JSON."""
    from prorsa.io import check_output
    from prorsa.runtime.sim.cost.aiconfigurator import fit_aiconfigurator_profiles

    check_output(out, kind="dir", inputs=[data])
    profiles = fit_aiconfigurator_profiles(data, out)
    for p in profiles:
        fit = p.provenance
        console.print(
            f"{p.name}: prefill fit MAPE {fit['prefill_fit']['mape']:.1%}, decode fit MAPE "
            f"{fit['decode_fit']['mape']:.1%} -> {out / (p.name + '.json')}",
            highlight=False,
        )


@app.command("fit-layouts")
@friendly_errors
def fit_layouts_command(
    data: Path = typer.Option(
        None,
        "--data",
        help="Folder with the H200 kernel, MoE and communication parquet files "
        "(default: ../shared/data/profiles/aiconfigurator-h200-vllm-0.19).",
    ),
    out: Path = typer.Option(
        Path("datasets/profiles/layouts"), "--out", "-o", help="Folder for JSON."
    ),
) -> None:
    """Refit the layout costs (TP x DP-attention x EP) of every model and write JSON."""
    from prorsa.runtime.sim.cost.layout_fit import fit_layout_terms_all

    for terms in fit_layout_terms_all(data, out):
        fit = terms.provenance["decode_attention_fit"]
        console.print(
            f"{terms.name}: decode attention fit MAPE {fit['mape']:.1%} -> "
            f"{out / (terms.name + '.json')}",
            highlight=False,
        )


@app.command("layouts")
@friendly_errors
def layouts_command(
    model: str = typer.Argument(..., help="Model name, e.g. qwen3-30b-a3b."),
    batch: int = typer.Option(64, "--batch", help="Decode sequences per DP rank."),
    context: int = typer.Option(8192, "--context", help="Context tokens per sequence."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The fitted layouts of a model with their decode and prefill throughput per GPU."""
    from prorsa.runtime.sim.cost import layout_cost_for, layouts_for

    rows = []
    for layout in layouts_for(model):
        cost = layout_cost_for(model, layout)
        fits = batch * context <= cost.kv_capacity_tokens
        rows.append(
            {
                "layout": layout.name,
                "gpus": layout.gpus,
                # None where the rank cannot hold batch x context tokens of KV
                "decode_tokens_per_s_per_gpu": round(
                    cost.decode_tokens_per_s_per_gpu(batch, context), 1
                )
                if fits
                else None,
                "prefill_tokens_per_s_per_gpu": round(cost.prefill_tokens_per_s_per_gpu(), 1),
                "kv_capacity_tokens_per_rank": cost.kv_capacity_tokens,
            }
        )
    if as_json:
        print_json(rows)
        return
    table = Table(
        "layout",
        "GPUs",
        "decode tok/s/GPU",
        "prefill tok/s/GPU",
        "KV tokens/rank",
        title=f"{model}: decode at {batch} x {context} tokens per rank",
    )
    for r in rows:
        table.add_row(
            r["layout"],
            str(r["gpus"]),
            "-"
            if r["decode_tokens_per_s_per_gpu"] is None
            else f"{r['decode_tokens_per_s_per_gpu']:,.0f}",
            f"{r['prefill_tokens_per_s_per_gpu']:,.0f}",
            f"{r['kv_capacity_tokens_per_rank']:,}",
        )
    console.print(table)
