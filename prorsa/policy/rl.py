"""A learned allocation policy: a small PPO agent (stable-baselines3) that nudges the
prefill share one slot at a time from a compact view of the cluster.

The observation encoding lives here, in the policy layer, so the training environment
(``prorsa.runtime.sim.gym_env``) and the deployed policy see exactly the same features.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, SplitPolicy
from prorsa.policy.demand import current_load
from prorsa.policy.types import Allocation, ClusterObservation, Forecast

OBS_FEATURES = (
    "prefill_share",
    "switching_share",
    "prefill_backlog_s",
    "decode_batch_per_gpu",
    "decode_kv_use",
    "queued_share",
    "in_tool_share",
    "done_share",
)
ACTIONS = (-1, 0, 1)  # change in prefill slots


def observation_vector(obs: ClusterObservation, spec: ClusterSpec) -> np.ndarray:
    """The agent's view of ``obs``: scale-free numbers, roughly in [0, 1]."""
    load = current_load(obs)
    n = max(len(obs.slots), 1)
    switching = sum(1 for s in obs.slots if s.role == "switching")
    per_slot = spec.prefill_tokens_per_s_per_gpu * spec.slot_gpus
    backlog_s = load.prefill_backlog_tokens / max(load.prefill_slots * per_slot, 1.0)
    decode = [s for s in obs.slots if s.role in ("decode", "colocated")]
    kv_use = sum(s.kv_used_tokens for s in decode) / max(
        sum(s.kv_capacity_tokens for s in decode), 1
    )
    states = obs.trajectory_state
    live = max(sum(v for k, v in states.items() if k != "done"), 1)
    total = max(obs.total_trajectories or live + obs.completed_trajectories, 1)
    vec = [
        load.prefill_slots / n,
        switching / n,
        min(backlog_s / 10.0, 1.0),
        min(load.decode_sequences / max(load.decode_slots * spec.slot_gpus * 256.0, 1.0), 1.0),
        min(kv_use, 1.0),
        states.get("queued", 0) / live,
        states.get("in_tool", 0) / live,
        obs.completed_trajectories / total,
    ]
    return np.asarray(vec, dtype=np.float32)


class _DeltaPolicy(SplitPolicy):
    """Shared arithmetic: move the prefill share by one slot, clamped to [1, N-1]."""

    def __init__(self, prefill_fraction: float = 0.25) -> None:
        self.prefill_fraction = prefill_fraction

    def _apply(self, obs: ClusterObservation, delta: int, reason: str) -> Allocation:
        current = current_load(obs).prefill_slots
        if current == 0:
            current, delta = self.initial_prefill_slots(), 0
        return self.split(min(max(current + delta, 1), self.cluster_.num_slots - 1), reason)


class ExternalPolicy(_DeltaPolicy):
    """Applies whatever action the caller set last (the Gymnasium environment's agent)."""

    def __init__(self, prefill_fraction: float = 0.25) -> None:
        super().__init__(prefill_fraction)
        self.action = 1

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        return self._apply(obs, ACTIONS[self.action], f"external action {ACTIONS[self.action]:+d}")


@POLICIES.register("rl")
class RLPolicy(_DeltaPolicy):
    """A PPO agent trained in the simulator (`prorsa rl train`) moving one slot per tick.

    Args:
        model: directory holding ``model.zip`` and ``manifest.json`` (relative paths are
            looked up under the repository's ``models/``).
        prefill_fraction: split before the agent's first decision.
    """

    def __init__(self, model: str = "rl-ppo", prefill_fraction: float = 0.25) -> None:
        super().__init__(prefill_fraction)
        self.model = model

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        path = resolve_model_dir(self.model)
        if not (path / "model.zip").exists():
            raise ConfigError(
                f"no trained RL policy at {path}",
                hint="train one with `prorsa rl train --out models/rl-ppo`",
            )
        from stable_baselines3 import PPO

        self.agent_ = PPO.load(path / "model.zip", device="cpu")
        manifest = json.loads((path / "manifest.json").read_text())
        if tuple(manifest["features"]) != OBS_FEATURES:
            raise ConfigError(f"{path}: trained on other features {manifest['features']}")

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        action, _ = self.agent_.predict(observation_vector(obs, self.cluster_), deterministic=True)
        delta = ACTIONS[int(action)]
        return self._apply(obs, delta, f"rl action {delta:+d}")


def resolve_model_dir(name: str) -> Path:
    path = Path(name)
    if path.is_absolute() or path.exists():
        return path
    return Path(__file__).resolve().parents[2] / "models" / name
