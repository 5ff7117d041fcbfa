"""The workload's expected shape: measured before a run, carried in every observation, and
read by the learned policy."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.policy.base import Policy
from prorsa.policy.rl import OBS_FEATURES
from prorsa.policy.rl_features import observation_vector
from prorsa.policy.types import Allocation, WorkloadShape
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.sim.gym_env import AllocationEnv
from prorsa.runtime.sim.rl_domain import DomainConfig, EpisodeConfig
from prorsa.runtime.sim.scenario import build_driver, reference_shape
from prorsa.runtime.sim.simulation import Simulation
from prorsa.workload.config import WorkloadConfig
from prorsa.workload.shape import shape_of
from prorsa.workload.spec import TrajectorySpec
from tests.conftest import REPO
from tests.policy_helpers import observation, spec

SHAPE_FEATURES = OBS_FEATURES[OBS_FEATURES.index("workload_known") :]


def _spec(name: str, new, out, tool) -> TrajectorySpec:
    return TrajectorySpec(name, np.array(new), np.array(out), np.array(tool, float))


def test_shape_of_takes_means_per_trajectory_and_per_turn():
    specs = [
        _spec("a", [100, 10, 30], [5, 5, 5], [2.0, 4.0, 0.0]),  # 3 turns, 2 tool calls
        _spec("b", [300], [20], [0.0]),  # 1 turn, no tool call
    ]
    shape = shape_of(specs)
    assert shape.turns_per_trajectory == 2.0
    assert shape.prompt_tokens == 200.0
    assert shape.new_tokens_per_turn == pytest.approx(40 / 2)  # later turns only
    assert shape.output_tokens_per_turn == pytest.approx(35 / 4)
    assert shape.tool_s_per_call == pytest.approx(6.0 / 2)
    assert shape.final_context_tokens == pytest.approx((155 + 320) / 2)


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_shape_refuses_negative_or_nan(bad):
    with pytest.raises(ConfigError, match="tool_s_per_call"):
        WorkloadShape(4.0, 100.0, 50.0, 200.0, bad, 1000.0)


def test_a_scenarios_shape_comes_from_a_reference_sample_not_the_run():
    runs = [
        build_driver(WorkloadConfig(scenario="search", trajectories=64, seed=s)) for s in (0, 5)
    ]
    # Different batches, one shape: it does not read the batch's realised outputs.
    assert (
        runs[0].batches[0][0].output_tokens.tolist() != runs[1].batches[0][0].output_tokens.tolist()
    )
    assert runs[0].shape == runs[1].shape == reference_shape(WorkloadConfig(scenario="search"))
    async_run = build_driver(WorkloadConfig(scenario="search", mode="async", trajectories=64))
    assert async_run.shape == runs[0].shape
    swe = build_driver(WorkloadConfig(scenario="swe", trajectories=64)).shape
    assert swe.turns_per_trajectory > 3 * runs[0].shape.turns_per_trajectory


def test_a_replayed_traces_shape_is_the_traces_means():
    from prorsa.workload import specs_from_trace

    trace = REPO / "datasets" / "traces" / "mini-swe-agent-swebench.parquet"
    work = WorkloadConfig(scenario=None, trace=str(trace), trajectories=4)
    expected = shape_of(specs_from_trace(str(trace)))
    assert build_driver(work).shape == expected == reference_shape(work)


class _Watcher(Policy):
    """Colocates and keeps every observation it is shown."""

    dynamic = True

    def reset(self, cluster, seed=0):
        super().reset(cluster, seed)
        self.seen = []

    def decide(self, obs, forecast):
        self.seen.append(obs)
        return Allocation(gpus={"colocated": self.cluster_.total_gpus})


def test_every_observation_of_a_simulated_run_carries_the_shape():
    work = WorkloadConfig(scenario="math-tool", trajectories=16)
    policy = _Watcher()
    Simulation(ClusterConfig(num_slots=2), policy, build_driver(work), record=False).run()
    assert len(policy.seen) > 2
    assert policy.seen[0].time_s == 0.0  # the free first decision sees it too
    assert all(obs.workload == reference_shape(work) for obs in policy.seen)


def test_rl_features_read_the_shape_and_zero_it_when_unknown():
    obs = observation(0.0, ["colocated"] * 4, decoding=0)
    assert obs.workload is None
    unknown = observation_vector(obs, spec(4))
    assert not unknown[len(OBS_FEATURES) - len(SHAPE_FEATURES) :].any()
    vectors = {}
    for scenario in ("search", "swe", "math-tool"):
        shaped = dataclasses.replace(
            obs, workload=reference_shape(WorkloadConfig(scenario=scenario))
        )
        vec = observation_vector(shaped, spec(4))
        assert ((vec >= 0) & (vec <= 1)).all()
        assert vec[OBS_FEATURES.index("workload_known")] == 1.0
        vectors[scenario] = vec
        # Nothing else changes.
        np.testing.assert_array_equal(vec[: -len(SHAPE_FEATURES)], unknown[: -len(SHAPE_FEATURES)])
    assert not np.allclose(vectors["search"], vectors["swe"])
    assert not np.allclose(vectors["search"], vectors["math-tool"])


def test_the_agents_first_observation_tells_search_from_swe_unless_hidden():
    env = AllocationEnv(DomainConfig())
    first = {}
    for scenario in ("search", "swe"):
        for known in (True, False):
            episode = EpisodeConfig(
                "qwen3-30b-a3b-h200-dp8", 2, scenario, "sync", 4, seed=1, workload_known=known
            )
            first[scenario, known], _ = env.reset(options={"episode": episode})
    assert not np.allclose(first["search", True], first["swe", True])
    np.testing.assert_array_equal(first["search", False], first["swe", False])
    assert first["search", False][OBS_FEATURES.index("workload_known")] == 0.0
    # A hidden shape stays hidden once the run starts.
    _, _, _, _, _ = env.step(1)
    assert env.sim.actuator.observe().workload is None


def test_the_domain_hides_the_shape_in_about_its_share_of_episodes():
    rng = np.random.default_rng(0)
    draws = [DomainConfig(hide_workload=0.25).sample(rng).workload_known for _ in range(400)]
    assert 0.18 < 1 - np.mean(draws) < 0.32
    with pytest.raises(ConfigError, match="hide_workload"):
        DomainConfig(hide_workload=1.5).validate()


def test_the_ray_runtimes_shape_is_fitted_to_its_engines_like_its_specs():
    from prorsa.runtime.ray.rollout import reference_shape as ray_shape
    from prorsa.runtime.ray.rollout_config import RolloutConfig

    def config(seed):
        return RolloutConfig.of(
            "model", scenario="swe", max_tokens=12, max_turns=3, max_model_len=512, seed=seed
        )

    shape = ray_shape(config(0))
    assert shape == ray_shape(config(9))  # not the run's own batch
    assert shape.output_tokens_per_turn <= 12 and shape.turns_per_trajectory <= 3
    assert shape.final_context_tokens <= 512
    assert shape.turns_per_trajectory < reference_shape(WorkloadConfig()).turns_per_trajectory


def test_serve_refuses_an_unknown_workload_scenario(tmp_path):
    from prorsa.serve.config import ServeConfig

    ServeConfig(model=str(tmp_path), workload_scenario="search").validate()
    with pytest.raises(ConfigError, match="unknown workload scenario"):
        ServeConfig(model=str(tmp_path), workload_scenario="chess").validate()


@pytest.mark.parametrize("read", [True, False])
def test_the_rl_policy_can_be_told_to_ignore_the_shape(read):
    from prorsa.policy import make_policy

    class Recorder:
        def __init__(self):
            self.seen = []

        def predict(self, features, deterministic=True):
            self.seen.append(features)
            return 1, None  # colocate

    # The agent's own first action (the opening model would take it otherwise).
    policy = make_policy("rl", read_workload=read, opening=False)
    policy.reset(spec(4))
    policy.agent_ = Recorder()
    shape = reference_shape(WorkloadConfig(scenario="search"))
    obs = dataclasses.replace(observation(0.0, ["colocated"] * 4, decoding=0), workload=shape)
    policy.decide(obs, None)
    known = policy.agent_.seen[-1][OBS_FEATURES.index("workload_known")]
    assert known == (1.0 if read else 0.0)


def test_a_trace_replays_in_order_on_seed_0_and_resamples_on_other_seeds():
    """Seed 0 replays the recorded trajectories in order; any other seed is a bootstrap
    draw of them, so a replay's held-out seeds are other samples, not the same run."""
    trace = str(REPO / "datasets" / "traces" / "mini-swe-agent-swebench.parquet")

    def ids(mode: str, seed: int) -> list[str]:
        work = WorkloadConfig(scenario=None, trace=trace, mode=mode, trajectories=40, seed=seed)
        driver = build_driver(work)
        specs = driver.batches[0] if mode == "sync" else list(itertools.islice(driver.specs, 40))
        return [s.trajectory_id.split("#")[0] for s in specs]

    from prorsa.workload import specs_from_trace

    recorded = [s.trajectory_id for s in specs_from_trace(trace)]
    for mode in ("sync", "async"):
        assert ids(mode, 0) == [recorded[i % len(recorded)] for i in range(40)]
        one, two = ids(mode, 1), ids(mode, 2)
        assert one == ids(mode, 1)  # deterministic
        assert one != two and one != ids(mode, 0)
        assert set(one) <= set(recorded) and len(set(one)) < 40  # with replacement
    with pytest.raises(ConfigError, match="seed must be >= 0"):
        WorkloadConfig(scenario=None, trace=trace, seed=-1).validate()
