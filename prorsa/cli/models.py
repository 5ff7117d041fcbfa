"""``prorsa models``: make the small local models that tests and demos run on."""

from __future__ import annotations

from pathlib import Path

import typer

from prorsa.cli.common import console, friendly_errors

app = typer.Typer(no_args_is_help=True)


@app.command("make-tiny")
@friendly_errors
def make_tiny(
    out: Path = typer.Option(..., "--out", help="Folder to write the model and tokenizer to."),
    seed: int = typer.Option(0, "--seed", help="Weight seed; the same seed gives identical files."),
) -> None:
    """Write a random-initialised tiny Llama and a locally trained tokenizer (no download)."""
    from prorsa.io import check_output
    from prorsa.runtime.ray.tiny_model import make_tiny_model

    check_output(out, kind="dir")
    path = make_tiny_model(out, seed=seed)
    console.print(f"tiny model written to {path}", highlight=False)
