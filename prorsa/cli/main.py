"""Entry point of the ``prorsa`` command. Each command group lives in its own module."""

from __future__ import annotations

import typer

from prorsa.cli import forecast as forecast_cli
from prorsa.cli import models as models_cli
from prorsa.cli import profile as profile_cli
from prorsa.cli import rl as rl_cli
from prorsa.cli import traces as traces_cli
from prorsa.cli import workload as workload_cli
from prorsa.cli.common import set_debug
from prorsa.cli.compare import compare_cmd, policies_cmd
from prorsa.cli.demo import demo_cmd
from prorsa.cli.explore import explore_cmd
from prorsa.cli.rollout import rollout_cmd
from prorsa.cli.serve import serve_cmd
from prorsa.cli.simulate import simulate_cmd
from prorsa.cli.tune import tune_cmd

app = typer.Typer(
    name="prorsa",
    help="Forecast-driven prefill/decode allocation for agentic RL rollout.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
    set_debug(debug)


app.add_typer(traces_cli.app, name="traces", help="Import and summarise real agent traces.")
app.add_typer(profile_cli.app, name="profile", help="List, inspect and refit engine cost profiles.")
app.add_typer(workload_cli.app, name="workload", help="Fit, inspect and sample task profiles.")
app.add_typer(forecast_cli.app, name="forecast", help="Train and backtest demand forecasters.")
app.add_typer(models_cli.app, name="models", help="Make small local models for tests and demos.")
app.add_typer(rl_cli.app, name="rl", help="Train the learned (PPO) allocation policy.")
app.command("simulate")(simulate_cmd)
app.command("rollout")(rollout_cmd)
app.command("serve")(serve_cmd)
app.command("compare")(compare_cmd)
app.command("demo")(demo_cmd)
app.command("policies")(policies_cmd)
app.command("tune")(tune_cmd)
app.command("explore")(explore_cmd)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
