"""Entry point of the ``prorsa`` command. Each command group lives in its own module.

A command's module is imported only when that command runs: the modules behind
``simulate`` or ``serve`` pull in pandas, torch or Ray, and ``prorsa traces import``
should not wait for them. ``--help`` and unknown commands build the whole app.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

from prorsa.cli.common import set_debug

#: Command groups: name -> (module with an ``app``, help line).
GROUPS: dict[str, tuple[str, str]] = {
    "traces": ("prorsa.cli.traces", "Import and summarise real agent traces."),
    "profile": ("prorsa.cli.profile", "List, inspect and refit engine cost profiles."),
    "workload": ("prorsa.cli.workload", "Fit, inspect and sample task profiles."),
    "forecast": ("prorsa.cli.forecast", "Train and backtest demand forecasters."),
    "models": ("prorsa.cli.models", "Make small local models for tests and demos."),
    "rl": ("prorsa.cli.rl", "Train the learned (PPO) allocation policy."),
}
#: Single commands: name -> (module, function).
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("prorsa.cli.simulate", "simulate_cmd"),
    "rollout": ("prorsa.cli.rollout", "rollout_cmd"),
    "serve": ("prorsa.cli.serve", "serve_cmd"),
    "compare": ("prorsa.cli.compare", "compare_cmd"),
    "demo": ("prorsa.cli.demo", "demo_cmd"),
    "policies": ("prorsa.cli.compare", "policies_cmd"),
    "tune": ("prorsa.cli.tune", "tune_cmd"),
    "explore": ("prorsa.cli.explore", "explore_cmd"),
}


def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
    set_debug(debug)


def build_app(only: str | None = None) -> typer.Typer:
    """The ``prorsa`` app with every command, or with only the command named ``only``."""
    app = typer.Typer(
        name="prorsa",
        help="Forecast-driven prefill/decode allocation for agentic RL rollout.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for name, (module, help_line) in GROUPS.items():
        if only in (None, name):
            app.add_typer(importlib.import_module(module).app, name=name, help=help_line)
    for name, (module, function) in COMMANDS.items():
        if only in (None, name):
            app.command(name)(getattr(importlib.import_module(module), function))
    return app


def command_named(argv: list[str]) -> str | None:
    """The command ``argv`` runs, if it names a known one (the root takes only flags)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in GROUPS or arg in COMMANDS else None
    return None


def __getattr__(name: str) -> Any:
    # ``from prorsa.cli.main import app``: the whole app, built on first use.
    if name == "app":
        app = build_app()
        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    build_app(command_named(sys.argv[1:]))()


if __name__ == "__main__":
    main()
