"""Train the `rl` allocation policy (PPO) in the simulator and save it with a manifest."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from prorsa.policy.rl import OBS_FEATURES


def train_ppo(
    out: Path,
    *,
    scenario: str = "swe",
    engines: int = 8,
    trajectories: int = 64,
    timesteps: int = 30_000,
    seed: int = 0,
) -> dict:
    """Train a small PPO agent on :class:`AllocationEnv`; returns its manifest."""
    import stable_baselines3
    import torch
    from stable_baselines3 import PPO

    from prorsa.runtime.sim.gym_env import AllocationEnv

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    env = AllocationEnv(scenario=scenario, engines=engines, trajectories=trajectories)
    agent = PPO(
        "MlpPolicy",
        env,
        seed=seed,
        n_steps=512,
        batch_size=128,
        verbose=0,
        device="cpu",
        policy_kwargs={"net_arch": [32, 32]},
    )
    agent.learn(total_timesteps=timesteps)
    out.mkdir(parents=True, exist_ok=True)
    agent.save(out / "model.zip")
    manifest = {
        "policy": "rl",
        "algorithm": "PPO (stable-baselines3)",
        "features": list(OBS_FEATURES),
        "trained_on": {
            "scenario": scenario,
            "engines": engines,
            "trajectories": trajectories,
            "profile": env.profile,
            "interval_s": env.interval_s,
        },
        "timesteps": timesteps,
        "seed": seed,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "stable_baselines3": stable_baselines3.__version__,
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
