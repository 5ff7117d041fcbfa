"""A Gymnasium environment around the simulator, for training allocation agents.

An episode is one simulated rollout drawn from a :class:`~prorsa.runtime.sim.rl_domain.
DomainConfig` (cluster family and size, load, scenario, sync/async). The first action
picks the initial layout (free, before any work arrives, but seeing the workload's expected
shape unless the episode hides it); each later action is the agent's
decision at the next decision point where the safety rule would let a change through
(the others hold without asking, as in the deployed policy), applied through the same
:class:`ExternalPolicy` machinery that the deployed ``rl`` policy uses.

Reward (switch-cost aware, relative to colocation on the same workload sample):

    r_t = -(dt_t / T_colocate) - switch_penalty * switching_slot_s_t / (N * T_colocate)

``dt_t`` is the simulated time the step covered, ``T_colocate`` the time colocation takes
to finish the same trajectories (a reference run at reset), ``N`` the slot count and
``switching_slot_s_t`` the slot-seconds spent switching during the step. The undiscounted
return is ``-T_agent / T_colocate`` minus the switching term: -1 means "as fast as
colocation", and it is comparable across cluster sizes, loads and scenarios.
"""

from __future__ import annotations

from typing import ClassVar

import gymnasium as gym
import numpy as np

from prorsa.policy import make_policy
from prorsa.policy.base import ClusterSpec, Policy
from prorsa.policy.rl import OBS_FEATURES, TARGETS, ExternalPolicy
from prorsa.policy.rl_actions import DECISION_INTERVAL_S, SwitchGuard
from prorsa.policy.types import Allocation, ClusterObservation, Forecast, WorkloadShape
from prorsa.runtime.sim.drivers import Driver, DriverResult
from prorsa.runtime.sim.rl_domain import DomainConfig, EpisodeConfig
from prorsa.runtime.sim.scenario import build_driver, reference_shape
from prorsa.runtime.sim.simulation import Simulation

# Stop just before a decision tick, so the agent's action is in place when it fires.
_BEFORE_TICK_S = 1e-6


class AllocationEnv(gym.Env):
    """Allocation as a sequential decision problem over one simulated rollout.

    Args:
        domain: what episodes are drawn from (default: the full training domain).
        interval_s / min_dwell_s: the controller's tick and per-slot dwell (as in
            ``prorsa compare``).
        decision_interval_s / min_hold_s / max_changes_per_min: the policy's decision
            period and safety rule (see :class:`~prorsa.policy.rl.TargetPolicy`).
        switch_penalty: weight of the switching slot-seconds term of the reward.
        max_steps: truncate an episode after this many decisions.

    ``reset(options={"episode": EpisodeConfig(...)})`` pins the episode (evaluation).
    """

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(
        self,
        domain: DomainConfig | None = None,
        *,
        interval_s: float = 1.0,
        min_dwell_s: float = 10.0,
        decision_interval_s: float = DECISION_INTERVAL_S,
        min_hold_s: float = SwitchGuard.min_hold_s,
        max_changes_per_min: float = SwitchGuard.max_changes_per_min,
        switch_penalty: float = 1.0,
        max_steps: int = 1000,
    ) -> None:
        self.domain = domain or DomainConfig()
        self.domain.validate()
        self.interval_s = interval_s
        self.min_dwell_s = min_dwell_s
        self.decision_interval_s = decision_interval_s
        self.min_hold_s = min_hold_s
        self.max_changes_per_min = max_changes_per_min
        self.switch_penalty = switch_penalty
        self.max_steps = max_steps
        self.observation_space = gym.spaces.Box(
            0.0, 1.0, shape=(len(OBS_FEATURES),), dtype=np.float32
        )
        self.action_space = gym.spaces.Discrete(len(TARGETS))
        self.sim: Simulation | None = None
        self.episode: EpisodeConfig | None = None

    def set_max_slots(self, max_slots: int) -> None:
        """Curriculum hook: later episodes use at most ``max_slots`` slots."""
        self.domain.max_slots = max_slots

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        pinned = (options or {}).get("episode")
        self.episode = pinned or self.domain.sample(self.np_random)
        self.reference_s = self._colocated_end_s(self.episode)
        self.policy = self.new_policy()
        shape = reference_shape(self.episode.workload()) if self.episode.workload_known else None
        idle = _IdleDriver(self.episode.trajectories, shape)
        obs, spec = _first_observation(self._simulation(self.episode, _FirstObservation(), idle))
        self.policy.reset(spec, self.episode.seed)
        self.sim = None
        self.steps = 0
        self.elapsed_s = 0.0
        return self.policy.features(obs), {"episode": self.episode.as_dict()}

    def step(self, action):
        if self.episode is None:
            raise RuntimeError("call reset() before step()")
        self.policy.action = int(action)
        if self.sim is None:
            self.sim = self._simulation(self.episode, self.policy, self._driver(self.episode))
            self.sim.start()
            tick = self.policy.next_decision_s_
        else:
            tick = self.policy.next_decision_s_ + self.decision_interval_s
        before_s, switching_before = self.sim.env.now, self.policy.switching_slot_s_
        # Run to the next decision point the safety rule would let a change through (the
        # policy holds without asking at the others), or to the end.
        while True:
            done = self.sim.advance(tick - _BEFORE_TICK_S)
            obs = self.sim.actuator.observe()
            if done or self.policy.may_change(obs, at_s=tick):
                break
            tick += self.decision_interval_s
        self.steps += 1
        now = self.sim.env.now
        switching = self.policy.switching_slot_s_ - switching_before
        scale = self.reference_s
        reward = -(now - before_s) / scale
        reward -= self.switch_penalty * switching / (self.episode.num_slots * scale)
        truncated = not done and self.steps >= self.max_steps
        info = {"time_s": now}
        if done or truncated:
            info.update(self._summary(now))
        return self.policy.features(obs), float(reward), bool(done), bool(truncated), info

    def _summary(self, end_s: float) -> dict:
        metrics = self.sim.finish().metrics
        minutes = max(end_s / 60.0, 1e-9)
        return {
            "speedup_vs_colocate": self.reference_s / max(end_s, 1e-9),
            "target_changes_per_min": self.policy.target_changes / minutes,
            "switches_per_min": metrics["switches_completed"] / minutes,
            "initial_target": self.policy.initial_target_.label,
        }

    def new_policy(self) -> ExternalPolicy:
        """The policy the agent acts through, with this environment's safety rule."""
        return ExternalPolicy(
            decision_interval_s=self.decision_interval_s,
            min_hold_s=self.min_hold_s,
            max_changes_per_min=self.max_changes_per_min,
        )

    @staticmethod
    def _driver(episode: EpisodeConfig) -> Driver:
        driver = build_driver(episode.workload())
        if not episode.workload_known:
            driver.shape = None
        return driver

    def _simulation(self, episode: EpisodeConfig, policy: Policy, driver: Driver) -> Simulation:
        return Simulation(
            episode.cluster(),
            policy,
            driver,
            interval_s=self.interval_s,
            min_dwell_s=self.min_dwell_s,
            seed=episode.seed,
            record=False,
        )

    def _colocated_end_s(self, episode: EpisodeConfig) -> float:
        """Seconds colocation takes on the same trajectories (the reward's yardstick)."""
        return self.run_to_end(episode, make_policy("colocate"), build_driver(episode.workload()))

    def run_to_end(
        self, episode: EpisodeConfig, policy: Policy, driver: Driver | None = None
    ) -> float:
        """Seconds ``episode`` takes under ``policy`` from start to finish, with this
        environment's controller settings (``driver``: the episode's own by default,
        its shape hidden where the episode hides it)."""
        sim = self._simulation(episode, policy, driver or self._driver(episode))
        sim.start()
        sim.advance(None)
        return max(float(sim.env.now), 1e-9)


class _FirstObservation(Policy):
    """Captures what a policy sees before any work arrives (the free initial decision)."""

    dynamic = False

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        self.seen: ClusterObservation | None = None

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        self.seen = obs
        return Allocation(gpus={"colocated": self.cluster_.total_gpus})


def _first_observation(sim: Simulation) -> tuple[ClusterObservation, ClusterSpec]:
    sim.start()
    return sim.policy.seen, sim.spec


class _IdleDriver(Driver):
    """A driver that launches nothing: lets :func:`_first_observation` start a simulation
    for its initial observation without sampling the workload twice."""

    mode = "sync"

    def __init__(self, total: int, shape: WorkloadShape | None) -> None:
        self.total = total
        self.shape = shape
        self.result = DriverResult(mode="sync")

    def start(self, env, launch) -> None:
        pass

    def on_done(self, traj) -> None:
        pass
