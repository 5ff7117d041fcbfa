"""Helpers shared by CLI commands: error handling, JSON output, progress bars."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from prorsa.errors import ProrsaError

console = Console()
err_console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])

_state = {"debug": False}


def set_debug(debug: bool) -> None:
    _state["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


def friendly_errors(func: F) -> F:
    """Turn known errors into one line plus a hint and exit code 1 (traceback with --debug)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ProrsaError as exc:
            if _state["debug"]:
                raise
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            if exc.hint:
                err_console.print(f"[dim]hint:[/] {exc.hint}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except FileNotFoundError as exc:
            if _state["debug"]:
                raise
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def print_json(data: Any) -> None:
    """Print machine-readable output on stdout (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
