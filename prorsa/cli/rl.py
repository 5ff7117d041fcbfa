"""``prorsa rl``: train the learned allocation policy in the simulator."""

from __future__ import annotations

from pathlib import Path

import typer

from prorsa.cli.common import console, friendly_errors

app = typer.Typer(no_args_is_help=True)


@app.command("train")
@friendly_errors
def train(
    out: Path = typer.Option(Path("models/rl-ppo"), help="output directory"),
    scenario: str = typer.Option("swe", help="scenario to train on"),
    engines: int = typer.Option(8, help="engine slots"),
    trajectories: int = typer.Option(64, help="trajectories per episode"),
    timesteps: int = typer.Option(30_000, help="PPO environment steps"),
    seed: int = typer.Option(0),
) -> None:
    """Train a PPO agent on simulated rollouts; `--policy rl` then loads it."""
    from prorsa.runtime.sim.rl_train import train_ppo

    manifest = train_ppo(
        out,
        scenario=scenario,
        engines=engines,
        trajectories=trajectories,
        timesteps=timesteps,
        seed=seed,
    )
    console.print(f"saved {out / 'model.zip'} ({manifest['timesteps']} steps on {scenario})")
