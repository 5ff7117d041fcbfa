"""The learned allocation policy: environment contract, features, safety rule, training."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from prorsa.errors import ConfigError
from prorsa.policy import make_policy
from prorsa.policy.rl import OBS_FEATURES, TARGETS, resolve_model_dir
from prorsa.policy.rl_actions import COLOCATED, HOLD, SwitchGuard, Target
from prorsa.policy.rl_features import observation_vector
from prorsa.runtime.sim.gym_env import AllocationEnv
from prorsa.runtime.sim.rl_domain import DomainConfig, EpisodeConfig
from tests.policy_helpers import forecast, observation, spec

# A small, fixed episode family where the layout matters: an MoE model with DP4 attention
# on two 4-GPU slots running math-tool (long decodes), where colocation beats any split by
# ~17%. Episodes take ~0.1 s.
TINY = DomainConfig(
    families=("qwen3-30b-a3b-h200-dp4",),
    scenarios=("math-tool",),
    modes=("sync",),
    loads_per_gpu=(4,),
    max_slots=2,
)
SPLIT_QUARTER = TARGETS.index(Target("split", 0.25))


def _run(env: AllocationEnv, actions, episode: EpisodeConfig | None = None):
    """Play ``actions(step)`` to the end; returns (return, last info, observations)."""
    obs, _ = env.reset(seed=0, options={"episode": episode} if episode else None)
    total, done, step, seen = 0.0, False, 0, [obs]
    while not done:
        obs, reward, terminated, truncated, info = env.step(actions(step))
        total += reward
        seen.append(obs)
        step += 1
        done = terminated or truncated
    return total, info, seen


def test_gymnasium_contract():
    check_env(AllocationEnv(TINY), skip_render_check=True)


def test_return_is_relative_to_colocation_and_first_action_sets_the_layout():
    env = AllocationEnv(TINY)
    episode = EpisodeConfig("qwen2.5-32b-h200-tp2", 4, "swe", "sync", 4, seed=3)
    colocated, info, _ = _run(env, lambda s: TARGETS.index(COLOCATED) if s == 0 else 0, episode)
    # Colocating and holding is the reference run itself: return -1, no switch.
    assert colocated == pytest.approx(-1.0, abs=1e-9)
    assert info["speedup_vs_colocate"] == pytest.approx(1.0)
    assert info["switches_per_min"] == 0 and info["initial_target"] == "colocated"
    split, info, seen = _run(env, lambda s: SPLIT_QUARTER if s == 0 else 0, episode)
    prefill_share = seen[1][OBS_FEATURES.index("prefill_share")]
    assert prefill_share == pytest.approx(0.25)  # 1 of 4 slots, set before any work
    assert info["switches_per_min"] == 0  # the initial layout is free
    assert split == pytest.approx(-1.0 / info["speedup_vs_colocate"], rel=1e-6)


def test_restless_agent_is_rationed_by_the_safety_rule():
    env = AllocationEnv(TINY, switch_penalty=0.0)
    # Alternate colocated / split at every decision: the guard lets few through.
    _, info, _ = _run(env, lambda s: TARGETS.index(COLOCATED) if s % 2 else SPLIT_QUARTER)
    minutes = info["time_s"] / 60.0
    assert 0 < env.policy.target_changes <= 1 + minutes
    assert info["target_changes_per_min"] <= 1.0 + 1.0 / minutes


def test_switch_guard_holds_and_rations():
    guard = SwitchGuard(min_hold_s=10.0, max_changes_per_min=1.0)
    guard.reset(100.0)
    assert not guard.allows(105.0)  # within the hold after the initial layout
    assert guard.allows(110.0)  # one change of credit at the start
    guard.record(110.0)
    assert not guard.allows(125.0)  # hold passed, but the bucket refills only by t = 170
    assert guard.allows(170.0)
    # A long quiet spell banks one change only: a burst of two is refused.
    guard.record(1000.0)
    assert not guard.allows(1010.0)
    with pytest.raises(ConfigError):
        SwitchGuard(max_changes_per_min=0.0)


def test_features_are_the_same_per_gpu_on_any_cluster_size():
    small, large = spec(8), spec(64)
    # The same demand per GPU on 8 and on 64 slots.
    a = observation(
        30.0,
        ["prefill"] * 2 + ["decode"] * 6,
        prefill_queue=80_000,
        decoding=100,
        decode_kv=600_000,
    )
    b = observation(
        30.0,
        ["prefill"] * 16 + ["decode"] * 48,
        prefill_queue=640_000,
        decoding=800,
        decode_kv=4_800_000,
    )
    va = observation_vector(a, small, since_change_s=5.0)
    vb = observation_vector(b, large, since_change_s=5.0)
    assert va.shape == (len(OBS_FEATURES),) and va.dtype == np.float32
    assert ((va >= 0) & (va <= 1)).all()
    np.testing.assert_allclose(va, vb, rtol=1e-5)
    assert va[OBS_FEATURES.index("prefill_backlog")] == pytest.approx(0.5 / 2.5)
    assert va[OBS_FEATURES.index("prefill_share")] == pytest.approx(0.25)


def test_targets_map_to_slot_counts_on_any_size():
    quarter = Target("split", 0.25)
    assert [quarter.prefill_slots(n) for n in (2, 4, 8, 48)] == [1, 1, 2, 12]
    assert Target("split", 0.625).prefill_slots(2) == 1  # always one slot per role
    assert TARGETS[0] is HOLD
    with pytest.raises(ConfigError):
        COLOCATED.prefill_slots(8)


def test_short_ppo_run_beats_a_random_policy(tmp_path):
    from stable_baselines3 import PPO

    from prorsa.runtime.sim.rl_train import TrainConfig, evaluate, train_ppo

    # Decisions every 30 s and a 2-minute hold: the first decision (the layout) is what
    # counts, so a random agent keeps its random layout (5 of 7 actions split).
    config = TrainConfig(
        timesteps=768,
        workers=1,
        curriculum=((0.0, 2),),
        domain=TINY,
        decision_interval_s=30.0,
        min_hold_s=120.0,
        n_steps=128,
        batch_size=64,
        learning_rate=3e-3,
        eval_every=10**9,
        eval_episodes=2,
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    out = tmp_path / "model"
    manifest = train_ppo(out, config)
    assert (out / "training_curve.png").stat().st_size > 0
    assert manifest["features"] == list(OBS_FEATURES)
    assert json.loads((out / "curve.json").read_text())[-1]["step"] >= 768
    # The training run and its validation score can be read back from MLflow.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=config.tracking_uri)
    experiment = client.get_experiment_by_name("prorsa-rl")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert "validation_speedup_mean" in run.data.metrics

    episodes = [
        EpisodeConfig("qwen3-30b-a3b-h200-dp4", 2, "math-tool", "sync", 4, s) for s in (7, 8)
    ]
    trained = evaluate(PPO.load(out / "model.zip"), episodes, config.env_kwargs())

    class Random:
        rng = np.random.default_rng(0)

        def predict(self, obs, deterministic=True):
            return self.rng.integers(len(TARGETS)), None

    random = evaluate(Random(), episodes * 4, config.env_kwargs())
    assert trained["speedup_vs_colocate_mean"] > random["speedup_vs_colocate_mean"] + 0.03


def test_shipped_model_decides_on_cluster_sizes_it_was_not_trained_on():
    manifest = json.loads((resolve_model_dir("rl-ppo") / "manifest.json").read_text())
    trained_sizes = {n for f in manifest["training"]["families"].values() for n in f["slots"]}
    for slots in (3, 48, 128):
        assert slots not in trained_sizes
        policy = make_policy("rl")
        policy.reset(spec(slots))
        first = policy.decide(observation(0.0, ["colocated"] * slots, decoding=0), None)
        assert sum(first.gpus.values()) == slots
        later = policy.decide(observation(10.0, ["colocated"] * slots, decoding=50 * slots), None)
        assert sum(later.gpus.values()) == slots


def test_rl_policy_needs_a_trained_model(tmp_path):
    with pytest.raises(ConfigError, match="no trained RL policy"):
        make_policy("rl", model=str(tmp_path / "missing")).reset(spec(8))


def test_rl_policy_refuses_a_model_trained_on_other_features(tmp_path):
    (tmp_path / "model.zip").write_bytes(b"")
    (tmp_path / "manifest.json").write_text(json.dumps({"features": ["old"], "actions": []}))
    with pytest.raises(ConfigError, match="other features"):
        make_policy("rl", model=str(tmp_path)).reset(spec(8))


def test_rl_policy_is_deterministic():
    a, b = make_policy("rl"), make_policy("rl")
    a.reset(spec(8))
    b.reset(spec(8))
    roles = ["prefill"] * 2 + ["decode"] * 6
    for t in np.linspace(0, 60, 13):
        obs = observation(float(t), roles, prefill_queue=int(t) * 50_000)
        assert a.decide(obs, forecast(t, 1.0)).gpus == b.decide(obs, None).gpus


def test_curriculum_and_bad_configs():
    from prorsa.cli.rl import parse_curriculum
    from prorsa.runtime.sim.rl_train import TrainConfig

    config = TrainConfig(timesteps=100, curriculum=parse_curriculum("0:4,0.5:16"))
    assert [config.max_slots_at(s) for s in (0, 49, 50, 100)] == [4, 4, 16, 16]
    with pytest.raises(ConfigError, match="FRACTION:SLOTS"):
        parse_curriculum("half:8")
    with pytest.raises(ConfigError, match="must start at"):
        TrainConfig(curriculum=((0.5, 8),)).validate()
    with pytest.raises(ConfigError, match="unknown cluster families"):
        DomainConfig(families=("tpu",)).validate()


def test_family_weights_skew_the_draws_and_are_checked():
    import numpy as np

    families = ("qwen2.5-7b-h200", "qwen3-30b-a3b-h200-dp8")
    weighted = DomainConfig(families=families, family_weights=(1.0, 3.0))
    weighted.validate()
    rng = np.random.default_rng(0)
    draws = [weighted.sample(rng).family for _ in range(2_000)]
    share = draws.count("qwen3-30b-a3b-h200-dp8") / len(draws)
    assert 0.70 < share < 0.80  # 3 of 4, within sampling noise
    with pytest.raises(ConfigError, match="1 family weights for 2 families"):
        DomainConfig(families=families, family_weights=(1.0,)).validate()
    with pytest.raises(ConfigError, match="not all zero"):
        DomainConfig(families=families, family_weights=(0.0, 0.0)).validate()
    with pytest.raises(ConfigError, match="not all zero"):
        DomainConfig(families=families, family_weights=(1.0, float("nan"))).validate()
