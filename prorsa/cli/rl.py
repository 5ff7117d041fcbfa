"""``prorsa rl``: train and evaluate the learned allocation policy in the simulator."""

from __future__ import annotations

from pathlib import Path

import typer

from prorsa.cli.common import console, counted_progress, friendly_errors, print_json
from prorsa.errors import ConfigError
from prorsa.runtime.sim.rl_domain import DomainConfig
from prorsa.runtime.sim.rl_train import TrainConfig, config_help

app = typer.Typer(no_args_is_help=True)

_HELP = config_help(TrainConfig)
_DOMAIN_HELP = config_help(DomainConfig)
_DEFAULT = TrainConfig()


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _names(text))
    except ValueError:
        raise ConfigError(f"--{what} takes comma-separated integers, not '{text}'") from None


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in _names(text))
    except ValueError:
        raise ConfigError(f"--{what} takes comma-separated numbers, not '{text}'") from None


def parse_curriculum(text: str) -> tuple[tuple[float, int], ...]:
    """``"0:8,0.25:16,0.5:32"`` -> ((0.0, 8), (0.25, 16), (0.5, 32))."""
    stages = []
    for item in _names(text):
        fraction, _, slots = item.partition(":")
        try:
            stages.append((float(fraction), int(slots)))
        except ValueError:
            raise ConfigError(
                f"--curriculum stage '{item}' must look like FRACTION:SLOTS (e.g. 0.25:16)"
            ) from None
    return tuple(stages)


def _curriculum_text(stages: tuple[tuple[float, int], ...]) -> str:
    return ",".join(f"{f:g}:{n}" for f, n in stages)


@app.command("train")
@friendly_errors
def train(
    out: Path = typer.Option(Path("models/rl-ppo"), help="output directory"),
    timesteps: int = typer.Option(_DEFAULT.timesteps, help=_HELP["timesteps"]),
    max_wall_s: float | None = typer.Option(None, help=_HELP["max_wall_s"]),
    workers: int = typer.Option(_DEFAULT.workers, help=_HELP["workers"]),
    seed: int = typer.Option(_DEFAULT.seed, help=_HELP["seed"]),
    curriculum: str = typer.Option(_curriculum_text(_DEFAULT.curriculum), help=_HELP["curriculum"]),
    families: str = typer.Option(",".join(_DEFAULT.domain.families), help=_DOMAIN_HELP["families"]),
    family_weights: str = typer.Option("", help=_DOMAIN_HELP["family_weights"]),
    scenarios: str = typer.Option(
        ",".join(_DEFAULT.domain.scenarios), help=_DOMAIN_HELP["scenarios"]
    ),
    modes: str = typer.Option(",".join(_DEFAULT.domain.modes), help=_DOMAIN_HELP["modes"]),
    loads: str = typer.Option(
        ",".join(map(str, _DEFAULT.domain.loads_per_gpu)), help=_DOMAIN_HELP["loads_per_gpu"]
    ),
    max_trajectories: int = typer.Option(
        _DEFAULT.domain.max_trajectories, help=_DOMAIN_HELP["max_trajectories"]
    ),
    hide_workload: float = typer.Option(
        _DEFAULT.domain.hide_workload, help=_DOMAIN_HELP["hide_workload"]
    ),
    switch_penalty: float = typer.Option(_DEFAULT.switch_penalty, help=_HELP["switch_penalty"]),
    ent_coef: float = typer.Option(_DEFAULT.ent_coef, help=_HELP["ent_coef"]),
    eval_every: int = typer.Option(_DEFAULT.eval_every, help=_HELP["eval_every"]),
    eval_episodes: int = typer.Option(_DEFAULT.eval_episodes, help=_HELP["eval_episodes"]),
    tracking_uri: str | None = typer.Option(None, help=_HELP["tracking_uri"]),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
) -> None:
    """Train a PPO agent on randomised simulated rollouts; `--policy rl` then loads it."""
    from prorsa.runtime.sim.rl_train import train_ppo

    stages = parse_curriculum(curriculum)
    config = TrainConfig(
        timesteps=timesteps,
        max_wall_s=max_wall_s,
        workers=workers,
        seed=seed,
        curriculum=stages,
        domain=DomainConfig(
            families=_names(families),
            family_weights=_floats(family_weights, "family-weights"),
            scenarios=_names(scenarios),
            modes=_names(modes),
            loads_per_gpu=_ints(loads, "loads"),
            max_slots=stages[0][1] if stages else _DEFAULT.domain.max_slots,
            max_trajectories=max_trajectories,
            hide_workload=hide_workload,
        ),
        switch_penalty=switch_penalty,
        ent_coef=ent_coef,
        eval_every=eval_every,
        eval_episodes=eval_episodes,
        tracking_uri=tracking_uri,
    )
    with counted_progress("training", timesteps, quiet=as_json) as progress:
        manifest = train_ppo(out, config, progress=progress)
    if as_json:
        print_json(manifest)
        return
    score = manifest["validation"]
    console.print(
        f"saved {out / 'model.zip'}: {manifest['steps_trained']} steps, validation speedup "
        "over colocation "
        f"{score['validation_speedup_mean']:.3f}x (worst {score['validation_speedup_min']:.3f}x)"
    )


@app.command("opening")
@friendly_errors
def opening(
    model: Path = typer.Option(Path("models/rl-ppo"), help="trained agent's directory"),
    episodes: int = typer.Option(1200, help="episodes to simulate every opening of"),
    seed: int = typer.Option(7, help="episode draw seed"),
    held_out: float = typer.Option(0.2, help="share of episodes kept to score the model"),
    workers: int = typer.Option(2, help="parallel episodes (Ray tasks; 1: in this process)"),
    address: str | None = typer.Option(None, help="Ray cluster address (default: local)"),
    families: str = typer.Option(",".join(_DEFAULT.domain.families), help=_DOMAIN_HELP["families"]),
    family_weights: str = typer.Option(
        "", help="relative draw weight per family (empty: MoE families 3x, splits pay there)"
    ),
    data: Path = typer.Option(
        Path("out/rl-opening/episodes.jsonl"), help="payoffs file (a re-run skips its episodes)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Train the policy's opening move as a contextual bandit: simulate every target held
    from the start on each episode, regress the payoff over colocation, save beside the
    agent (`--policy rl` opens with it)."""
    from prorsa.policy.rl import OPENING_FILE
    from prorsa.runtime.sim.rl_opening import OpeningConfig, fit_opening, opening_weights

    config = OpeningConfig(
        episodes=episodes, seed=seed, held_out=held_out, workers=workers, address=address
    )
    names = _names(families)
    DomainConfig(families=names).validate()  # unknown families, before weighing them
    weights = _floats(family_weights, "family-weights") or opening_weights(names)
    domain = DomainConfig(families=names, family_weights=weights)
    with counted_progress("openings", episodes, quiet=as_json) as progress:
        result = fit_opening(model, config, domain, data, progress=progress)
    if as_json:
        print_json(result)
        return
    console.print(
        f"saved {model / OPENING_FILE}: on {result['episodes']} held-out episodes its pick is "
        f"{result['picked_speedup_geomean']:.3f}x colocation (best arm "
        f"{result['best_speedup_geomean']:.3f}x), within 2% of the best in "
        f"{100 * result['within_2pct_of_best']:.0f}%"
    )
