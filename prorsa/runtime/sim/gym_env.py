"""A Gymnasium environment around the simulator, for training allocation agents.

Each ``step`` applies one action (prefill slots -1, 0 or +1) at a control tick and
simulates until the next tick. The reward is minus the simulated time that passed (in
control intervals) minus a small penalty per queued trajectory share, so an episode's
return tracks minus the rollout's makespan.
"""

from __future__ import annotations

from typing import ClassVar

import gymnasium as gym
import numpy as np

from prorsa.policy.rl import ACTIONS, OBS_FEATURES, ExternalPolicy, observation_vector
from prorsa.runtime.sim.config import ClusterConfig
from prorsa.runtime.sim.scenario import WorkloadConfig, build_driver
from prorsa.runtime.sim.simulation import Simulation


class AllocationEnv(gym.Env):
    """Allocation as a sequential decision problem over one simulated rollout."""

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(
        self,
        scenario: str = "swe",
        engines: int = 8,
        profile: str = "h200-qwen2.5-7b-tp1",
        trajectories: int = 64,
        mode: str = "sync",
        interval_s: float = 2.0,
        min_dwell_s: float = 4.0,
        group_size: int = 8,
        queue_penalty: float = 0.5,
        max_steps: int = 5000,
    ) -> None:
        self.scenario = scenario
        self.engines = engines
        self.profile = profile
        self.trajectories = trajectories
        self.mode = mode
        self.interval_s = interval_s
        self.min_dwell_s = min_dwell_s
        self.group_size = group_size
        self.queue_penalty = queue_penalty
        self.max_steps = max_steps
        self.observation_space = gym.spaces.Box(
            0.0, 1.0, shape=(len(OBS_FEATURES),), dtype=np.float32
        )
        self.action_space = gym.spaces.Discrete(len(ACTIONS))
        self.sim: Simulation | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        work = WorkloadConfig(
            scenario=self.scenario,
            mode=self.mode,
            trajectories=self.trajectories,
            group_size=self.group_size,
            seed=int(self.np_random.integers(2**31)),
        )
        self.policy = ExternalPolicy()
        self.sim = Simulation(
            ClusterConfig(profile=self.profile, num_slots=self.engines),
            self.policy,
            build_driver(work),
            interval_s=self.interval_s,
            min_dwell_s=self.min_dwell_s,
            seed=work.seed,
            record=False,
        )
        self.sim.start()
        self.steps = 0
        self.sim.advance(self.interval_s * 0.5)
        return self._obs(), {}

    def step(self, action):
        if self.sim is None:
            raise RuntimeError("call reset() before step()")
        self.policy.action = int(action)
        before = self.sim.env.now
        # The controller ticks at multiples of interval_s; run through the next one.
        done = self.sim.advance(before + self.interval_s)
        self.steps += 1
        obs = self._obs()
        elapsed = (self.sim.env.now - before) / self.interval_s
        queued = float(obs[OBS_FEATURES.index("queued_share")])
        reward = -elapsed - self.queue_penalty * queued
        truncated = not done and self.steps >= self.max_steps
        return obs, float(reward), bool(done), bool(truncated), {"time_s": self.sim.env.now}

    def _obs(self) -> np.ndarray:
        return observation_vector(self.sim.actuator.observe(), self.sim.spec)
