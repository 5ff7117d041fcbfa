"""``prorsa traces``: import public agent traces into lifecycle telemetry and summarise them."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
