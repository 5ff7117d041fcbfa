"""Helpers shared by CLI commands: error handling and JSON output."""

from __future__ import annotations

import errno
import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
import typer
from rich.console import Console
from rich.markup import escape

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
    """Turn every expected failure into one line plus a hint (traceback with --debug).

    Exit codes: 1 for an expected failure (bad input or configuration, an output that
    cannot be written, a file that is not what it should be), 130 for Ctrl-C, 70 for an
    unexpected error (a bug: the message says so and ``--debug`` shows the traceback).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except KeyboardInterrupt:
            if _state["debug"]:
                raise
            err_console.print("[bold red]interrupted[/]", highlight=False)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:  # every error becomes one line; the bugs say so
            if _state["debug"]:
                raise
            message, hint, code = describe_error(exc)
            err_console.print(
                f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True
            )
            if hint:
                err_console.print(f"[dim]hint:[/] {escape(hint)}", highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]


EXIT_ERROR = 1
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: the program, not the input, is at fault
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT

_OS_HINTS = {
    errno.ENOSPC: "free space on that disk or write the output elsewhere",
    errno.EDQUOT: "free space within your quota or write the output elsewhere",
    errno.EROFS: "that file system is read-only; write the output elsewhere",
    errno.EACCES: "check the permissions of the file and its folder",
    errno.EPERM: "check the permissions of the file and its folder",
    errno.EISDIR: "give a file path, not a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENOENT: "check the path",
}


def describe_error(exc: BaseException) -> tuple[str, str | None, int]:
    """One line, an optional hint and the exit code for an error raised by a command."""
    import pyarrow as pa

    if isinstance(exc, ProrsaError):
        return str(exc), exc.hint, EXIT_ERROR
    if isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException):
        where = exc.filename if exc.filename is not None else None
        reason = exc.strerror or str(exc) or type(exc).__name__
        if exc.filename2 is not None:
            where = f"{exc.filename} -> {exc.filename2}"
        message = f"{where}: {reason}" if where is not None else reason
        return message, _OS_HINTS.get(exc.errno or 0), EXIT_ERROR
    if isinstance(exc, pa.ArrowException):
        return (
            f"cannot read the data: {exc}",
            "telemetry must be a .parquet file, a .ptel segment or a recorder folder; "
            "import public traces with `prorsa traces import`",
            EXIT_ERROR,
        )
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text: {exc}", "is this a binary file?", EXIT_ERROR
    if isinstance(exc, ValueError):
        return f"invalid value: {exc}", None, EXIT_ERROR
    return (
        f"internal error: {type(exc).__name__}: {exc}",
        "this is a bug in prorsa; rerun with --debug for the traceback and report it",
        EXIT_INTERNAL,
    )


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


def progress_bar(label: str, *, quiet: bool = False):
    """A transient "label [bar] done/total elapsed" rich progress bar (a context manager;
    add tasks to it)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        f"[bold]{escape(label)}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet,
    )


@contextmanager
def counted_progress(
    label: str, total: int | None = None, *, quiet: bool = False
) -> Iterator[Callable[..., None]]:
    """A :func:`progress_bar` with one task; yields the ``progress(done, total=None)``
    callback the long-running functions take (a total given there replaces the one
    given here, for work that learns its size late)."""
    with progress_bar(label, quiet=quiet) as bar:
        task = bar.add_task(label, total=total)

        def progress(done: int, total: int | None = None) -> None:
            if total is None:
                bar.update(task, completed=done)
            else:
                bar.update(task, completed=done, total=total)

        yield progress
