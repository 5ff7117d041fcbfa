"""Train the `rl` allocation policy (PPO) in the simulator and ship it with a manifest,
a training curve and the curve's data.

PPO (stable-baselines3) runs on ``workers`` simulator processes (``SubprocVecEnv``; one
process runs the environments in-line). Episodes are drawn from a
:class:`~prorsa.runtime.sim.rl_domain.DomainConfig`; a curriculum raises the largest slot
count as training goes. Every ``eval_every`` steps the deterministic policy is scored on a
fixed validation set (speedup over colocation on the same trajectories), which is the
training curve. MLflow logging (:mod:`prorsa.tracking`) happens only when a tracking URI
is given (or set in ``$MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.runtime.sim.rl_domain import DomainConfig, EpisodeConfig
from prorsa.tracking import Tracker, resolve_uri

logger = logging.getLogger(__name__)

# Decision-level safety and reward settings shared by training and the deployed policy.
_POLICY_FIELDS = ("decision_interval_s", "min_hold_s", "max_changes_per_min")


def _help(text: str, **kw: object) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass
class TrainConfig:
    """What `prorsa rl train` trains, on what, and for how long."""

    timesteps: int = field(**_help("PPO environment steps (decisions)"), default=100_000)
    max_wall_s: float | None = field(
        **_help("stop after this many seconds even if steps remain (curriculum keeps pace)"),
        default=None,
    )
    workers: int = field(**_help("simulator processes (SubprocVecEnv when > 1)"), default=2)
    seed: int = field(**_help("seed of PPO and of the episode draws"), default=0)
    curriculum: tuple[tuple[float, int], ...] = field(
        **_help("(fraction of training, largest slot count) stages, small clusters first"),
        default=((0.0, 8), (0.25, 16), (0.5, 32)),
    )
    domain: DomainConfig = field(
        **_help("episodes to draw (cluster family, size, load, scenario, mode)"),
        default_factory=DomainConfig,
    )
    # None: the rl policy's own default (one set of defaults, in prorsa.policy.rl_actions).
    decision_interval_s: float | None = field(
        **_help("seconds between decisions (default: the rl policy's)"), default=None
    )
    min_hold_s: float | None = field(
        **_help("seconds a target is kept before a change (default: the rl policy's)"),
        default=None,
    )
    max_changes_per_min: float | None = field(
        **_help("average target changes allowed (default: the rl policy's)"), default=None
    )
    switch_penalty: float = field(
        **_help("reward weight of switching slot-seconds (per slot, per colocated run time)"),
        default=1.0,
    )
    n_steps: int = field(**_help("PPO rollout length per worker"), default=128)
    batch_size: int = field(**_help("PPO minibatch size"), default=64)
    learning_rate: float = field(**_help("Adam learning rate"), default=3e-4)
    ent_coef: float = field(**_help("entropy bonus (exploration)"), default=0.005)
    gamma: float = field(
        **_help("discount (near 1: the makespan counts to the end)"), default=0.999
    )
    net_arch: tuple[int, ...] = field(
        **_help("hidden layers of policy and value nets"), default=(64, 64)
    )
    eval_every: int = field(
        **_help("steps between validation scores (training curve)"), default=2_000
    )
    eval_episodes: int = field(**_help("validation episodes per score"), default=8)
    tracking_uri: str | None = field(
        **_help("MLflow tracking URI (none: $MLFLOW_TRACKING_URI, else no logging)"),
        default=None,
    )

    def validate(self) -> None:
        self.domain.validate()
        if self.timesteps < 1 or self.workers < 1 or self.n_steps < 2:
            raise ConfigError("timesteps, workers must be >= 1 and n_steps >= 2")
        if (self.n_steps * self.workers) % self.batch_size:
            raise ConfigError(
                f"batch_size {self.batch_size} must divide n_steps x workers "
                f"({self.n_steps * self.workers})"
            )
        fractions = [f for f, _ in self.curriculum]
        if not self.curriculum or fractions[0] != 0.0 or fractions != sorted(fractions):
            raise ConfigError("curriculum stages must start at 0.0 and be in increasing order")

    def policy_params(self) -> dict:
        """The deployed policy's decision period and safety rule, defaults resolved."""
        from prorsa.policy.rl_actions import DECISION_INTERVAL_S, SwitchGuard

        given = {k: getattr(self, k) for k in _POLICY_FIELDS}
        defaults = {
            "decision_interval_s": DECISION_INTERVAL_S,
            "min_hold_s": SwitchGuard.min_hold_s,
            "max_changes_per_min": SwitchGuard.max_changes_per_min,
        }
        return {k: defaults[k] if v is None else v for k, v in given.items()}

    def env_kwargs(self) -> dict:
        return {**self.policy_params(), "switch_penalty": self.switch_penalty}

    def progress(self, step: int, wall_s: float = 0.0) -> float:
        """Fraction of training done: of the steps, or of the wall-clock budget if sooner."""
        done = step / max(self.timesteps, 1)
        if self.max_wall_s:
            done = max(done, wall_s / self.max_wall_s)
        return min(done, 1.0)

    def max_slots_at(self, step: int, wall_s: float = 0.0) -> int:
        """Largest slot count of the curriculum stage training is in."""
        progress = self.progress(step, wall_s)
        return [n for f, n in self.curriculum if f <= progress][-1]


def config_help(cls: type) -> dict[str, str]:
    """Field name -> help text of a config dataclass (for the CLI)."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def validation_episodes(domain: DomainConfig, count: int, seed: int = 12345) -> list[EpisodeConfig]:
    """A fixed set of episodes from ``domain`` (same draws every evaluation)."""
    rng = np.random.default_rng(seed)
    return [domain.sample(rng) for _ in range(count)]


def evaluate(agent, episodes: list[EpisodeConfig], env_kwargs: dict) -> dict:
    """Deterministic rollouts of ``agent``: speedup over colocation and change rates."""
    from prorsa.runtime.sim.gym_env import AllocationEnv

    env = AllocationEnv(**env_kwargs)
    rows = []
    for episode in episodes:
        obs, _ = env.reset(options={"episode": episode})
        done, info = False, {}
        while not done:
            action, _ = agent.predict(obs, deterministic=True)
            obs, _, terminated, truncated, info = env.step(int(action))
            done = terminated or truncated
        rows.append({**episode.as_dict(), **info})
    speedups = [r["speedup_vs_colocate"] for r in rows]
    return {
        "speedup_vs_colocate_mean": float(np.mean(speedups)),
        "speedup_vs_colocate_min": float(np.min(speedups)),
        "switches_per_min_mean": float(np.mean([r["switches_per_min"] for r in rows])),
        "target_changes_per_min_mean": float(np.mean([r["target_changes_per_min"] for r in rows])),
        "episodes": rows,
    }


def _make_env(domain: dict, env_kwargs: dict, seed: int):
    """Build one (monitored) training environment; top-level so worker processes can."""
    from stable_baselines3.common.monitor import Monitor

    from prorsa.runtime.sim.gym_env import AllocationEnv

    env = AllocationEnv(DomainConfig(**domain), **env_kwargs)
    env.reset(seed=seed)
    return Monitor(env, info_keywords=("speedup_vs_colocate", "switches_per_min"))


def train_ppo(out: Path, config: TrainConfig | None = None, *, progress=None) -> dict:
    """Train PPO per ``config``; save ``model.zip``, ``manifest.json``, ``curve.json`` and
    ``training_curve.png`` under ``out``; return the manifest.

    ``progress(step, total)`` is called as training goes (for a progress bar).
    """
    import stable_baselines3
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    config = config or TrainConfig()
    config.validate()
    torch.manual_seed(config.seed)
    torch.set_num_threads(1)
    started = time.perf_counter()
    domain = asdict(config.domain)
    domain["max_slots"] = config.max_slots_at(0)
    builders = [
        functools.partial(_make_env, domain, config.env_kwargs(), config.seed * 1000 + i)
        for i in range(config.workers)
    ]
    vec = SubprocVecEnv(builders) if config.workers > 1 else DummyVecEnv(builders)
    agent = PPO(
        "MlpPolicy",
        vec,
        seed=config.seed,
        n_steps=config.n_steps,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        ent_coef=config.ent_coef,
        gamma=config.gamma,
        verbose=0,
        device="cpu",
        policy_kwargs={"net_arch": list(config.net_arch)},
    )
    curve = _Curve(config, progress)
    tracker = Tracker(resolve_uri(config.tracking_uri), experiment="prorsa-rl")
    params = {k: v for k, v in asdict(config).items() if k != "tracking_uri"}
    with tracker.run("rl-ppo", params=params) as run:
        try:
            agent.learn(total_timesteps=config.timesteps, callback=curve.callback(run))
            if not curve.points or curve.points[-1]["step"] < agent.num_timesteps:
                curve.score(agent, agent.num_timesteps, run)
        finally:
            vec.close()
        out.mkdir(parents=True, exist_ok=True)
        agent.save(out / "model.zip")
        wall_s = time.perf_counter() - started
        manifest = _manifest(config, curve, wall_s, stable_baselines3, torch)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        # An opening fitted beside an earlier agent is vouched for by that agent's
        # manifest, which this one replaces: remove it (`prorsa rl opening` fits anew).
        from prorsa.policy.rl import OPENING_FILE

        stale = out / OPENING_FILE
        if stale.exists():
            stale.unlink()
            logging.getLogger(__name__).info("removed %s (fit before this agent)", stale)
        (out / "curve.json").write_text(json.dumps(curve.points, indent=2) + "\n")
        plot_curve(curve.points, out / "training_curve.png")
        run.log_artifacts(out)
    return manifest


class _Curve:
    """Validation scores and training-episode speedups over the steps (the training curve)."""

    def __init__(self, config: TrainConfig, progress) -> None:
        self.config = config
        self.progress = progress
        self.started = time.perf_counter()
        self.episodes = validation_episodes(config.domain, config.eval_episodes)
        self.points: list[dict] = []
        self.next_eval = config.eval_every

    def score(self, agent, step: int, run) -> None:
        result = evaluate(agent, self.episodes, self.config.env_kwargs())
        train = [e["speedup_vs_colocate"] for e in agent.ep_info_buffer]
        point = {
            "step": step,
            "validation_speedup_mean": result["speedup_vs_colocate_mean"],
            "validation_speedup_min": result["speedup_vs_colocate_min"],
            "validation_switches_per_min": result["switches_per_min_mean"],
            "train_speedup_mean": float(np.mean(train)) if train else None,
            "max_slots": self.config.max_slots_at(step, self.wall_s()),
            "wall_s": round(self.wall_s(), 1),
        }
        self.points.append(point)
        run.log_metrics(point, step=step)
        logger.info("step %d: %s", step, point)

    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def callback(self, run):
        from stable_baselines3.common.callbacks import BaseCallback

        curve = self

        class _Callback(BaseCallback):
            def _on_training_start(self) -> None:
                self.stage = curve.config.max_slots_at(0)

            def _on_step(self) -> bool:
                step, wall_s = self.num_timesteps, curve.wall_s()
                stage = curve.config.max_slots_at(step, wall_s)
                if stage != self.stage:
                    self.training_env.env_method("set_max_slots", stage)
                    self.stage = stage
                    logger.info("curriculum: up to %d slots from step %d", stage, step)
                if step >= curve.next_eval:
                    curve.next_eval += curve.config.eval_every
                    curve.score(self.model, step, run)
                if curve.progress is not None:
                    curve.progress(step, curve.config.timesteps)
                # Out of wall-clock budget: stop (the model trained so far is kept).
                return curve.config.progress(step, wall_s) < 1.0

        return _Callback()


def _manifest(config: TrainConfig, curve: _Curve, wall_s: float, sb3, torch) -> dict:
    from prorsa.policy.rl import OBS_FEATURES, TARGETS
    from prorsa.runtime.sim.rl_domain import FAMILIES

    last = curve.points[-1] if curve.points else {}
    return {
        "policy": "rl",
        "algorithm": "PPO (stable-baselines3), MlpPolicy",
        "features": list(OBS_FEATURES),
        "actions": [t.label for t in TARGETS],
        "policy_params": config.policy_params(),
        "training": {
            **{k: v for k, v in asdict(config).items() if k not in ("domain", "tracking_uri")},
            "domain": asdict(config.domain),
            "families": {
                name: {**asdict(FAMILIES[name]), "role_tp": dict(FAMILIES[name].role_tp)}
                for name in config.domain.families
            },
            "wall_s": round(wall_s, 1),
        },
        "validation": {k: v for k, v in last.items() if k not in ("max_slots", "wall_s")},
        "steps_trained": last.get("step"),
        "simulator": _simulator_version(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "stable_baselines3": sb3.__version__,
        },
    }


def _simulator_version() -> dict:
    """The package version and the commit of the simulator code the model was trained on."""
    import subprocess

    import prorsa

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%h", "--", "prorsa/runtime"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {"prorsa": getattr(prorsa, "__version__", "unknown"), "runtime_commit": commit}


def plot_curve(points: list[dict], path: Path) -> None:
    """Validation speedup over colocation (and the training episodes') against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    steps = [p["step"] for p in points]
    ax.plot(
        steps, [p["validation_speedup_mean"] for p in points], marker="o", label="validation mean"
    )
    ax.plot(steps, [p["validation_speedup_min"] for p in points], ls="--", label="validation worst")
    train = [(p["step"], p["train_speedup_mean"]) for p in points if p["train_speedup_mean"]]
    if train:
        ax.plot(*zip(*train, strict=True), alpha=0.6, label="training episodes (last 100)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("PPO steps (decisions)")
    ax.set_ylabel("speedup over colocation")
    ax.set_title("rl-ppo training curve")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
