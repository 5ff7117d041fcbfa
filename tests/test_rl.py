from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from prorsa.errors import ConfigError
from prorsa.policy import make_policy
from prorsa.policy.rl import OBS_FEATURES
from prorsa.runtime.sim.gym_env import AllocationEnv
from tests.policy_helpers import spec


def test_gymnasium_contract():
    check_env(AllocationEnv(trajectories=16), skip_render_check=True)


def test_episode_return_tracks_makespan_and_actions_move_slots():
    env = AllocationEnv(trajectories=32, engines=4, min_dwell_s=0.0)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (len(OBS_FEATURES),) and env.observation_space.contains(obs)
    shares, total, done = [], 0.0, False
    while not done:
        obs, reward, terminated, truncated, info = env.step(2)  # always +1 prefill slot
        shares.append(obs[0])
        total += reward
        done = terminated or truncated
    assert terminated and max(shares) == pytest.approx(3 / 4)  # clamped at N-1
    assert total <= -info["time_s"] / env.interval_s + 1.0


def test_rl_policy_needs_a_trained_model(tmp_path):
    with pytest.raises(ConfigError, match="no trained RL policy"):
        make_policy("rl", model=str(tmp_path / "missing")).reset(spec(8))


def test_rl_policy_is_deterministic():
    from tests.policy_helpers import forecast, observation

    a, b = make_policy("rl"), make_policy("rl")
    a.reset(spec(8))
    b.reset(spec(8))
    roles = ["prefill"] * 2 + ["decode"] * 6
    for t in np.linspace(1, 20, 8):
        obs = observation(float(t), roles, prefill_queue=int(t) * 50_000)
        assert a.decide(obs, forecast(t, 1.0)).gpus == b.decide(obs, None).gpus
