"""The learned policy's opening move: payoffs per arm, the bandit regressor, the policy."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from prorsa.errors import ConfigError
from prorsa.forecast import lgbm
from prorsa.io import file_sha256
from prorsa.policy import make_policy
from prorsa.policy.rl import OBS_FEATURES, TARGETS, resolve_model_dir
from prorsa.policy.rl_actions import Target
from prorsa.policy.rl_opening import OPENING_FEATURES, arm_rows, choose_arm, opening_arms
from prorsa.runtime.sim.rl_domain import DomainConfig, EpisodeConfig
from prorsa.runtime.sim.rl_opening import (
    OpeningConfig,
    draw_episodes,
    fit_opening,
    opening_payoffs,
    score,
)
from tests.policy_helpers import observation, spec

# Two 4-GPU DP4 slots of an MoE model on math-tool: ~0.1 s per simulated run.
TINY = DomainConfig(
    families=("qwen3-30b-a3b-h200-dp4",),
    scenarios=("math-tool", "search"),
    modes=("sync",),
    loads_per_gpu=(4,),
    max_slots=2,
)


def test_arms_are_colocation_and_every_split():
    arms = opening_arms()
    assert [t for _, t in arms] == [t for t in TARGETS if t.mode != "hold"]
    rows = arm_rows(np.zeros(len(OBS_FEATURES)), 8)
    assert rows.shape == (len(arms), len(OPENING_FEATURES))
    shares = [t.prefill_slots(8) / 8 if t.mode == "split" else 0.0 for _, t in arms]
    np.testing.assert_allclose(rows[:, -2], shares)
    np.testing.assert_array_equal(rows[:, -1], [t.mode == "split" for _, t in arms])


def test_one_episode_payoffs_are_measured_against_colocation():
    episode = EpisodeConfig("qwen3-30b-a3b-h200-dp4", 2, "math-tool", "sync", 4, seed=3)
    row = opening_payoffs(episode)
    assert len(row["features"]) == len(OBS_FEATURES)
    payoffs = row["payoffs"]
    assert len(payoffs) == len(opening_arms())
    colocated = [p for p, (_, t) in zip(payoffs, opening_arms(), strict=True) if t.mode != "split"]
    assert colocated == [0.0]
    # On two slots every split is one prefill slot: one simulated run, one payoff.
    splits = [p for p, (_, t) in zip(payoffs, opening_arms(), strict=True) if t.mode == "split"]
    assert len(set(splits)) == 1 and math.isfinite(splits[0])
    # math-tool's long decodes: the split is slower than colocation here (docs/results.md).
    assert splits[0] < 0


def _synthetic_booster(always: bool = False):
    """Payoff +0.2 for a quarter split when feature 0 is high (or ``always``), else -0.2."""
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for _ in range(300):
        features = rng.random(len(OBS_FEATURES))
        rows = arm_rows(features, 8)
        for row, (_, target) in zip(rows, opening_arms(), strict=True):
            good = target == Target("split", 0.25) and (always or features[0] > 0.5)
            ys.append(0.0 if target.mode == "colocated" else (0.2 if good else -0.2))
            xs.append(row)
    return lgbm.train(
        np.asarray(xs),
        np.asarray(ys),
        objective="regression",
        seed=0,
        n_estimators=60,
        learning_rate=0.2,
        num_leaves=7,
        min_child_samples=5,
    )


def test_the_opening_picks_the_split_of_highest_predicted_payoff():
    booster = _synthetic_booster()
    arms = opening_arms()
    high, low = np.full(len(OBS_FEATURES), 0.5), np.full(len(OBS_FEATURES), 0.5)
    high[0], low[0] = 0.9, 0.1
    assert arms[choose_arm(booster, high, 8)][1] == Target("split", 0.25)
    assert arms[choose_arm(booster, low, 8)][1].mode == "colocated"
    # The margin: a predicted 22% gain does not clear a 50% bar.
    assert arms[choose_arm(booster, high, 8, margin=0.5)][1].mode == "colocated"

    def payoffs(good: bool) -> list[float]:
        return [
            0.0 if t.mode == "colocated" else (0.2 if good and t == Target("split", 0.25) else -0.2)
            for _, t in arms
        ]

    rows = [
        {"features": list(high), "payoffs": payoffs(True), "episode": {"num_slots": 8}},
        {"features": list(low), "payoffs": payoffs(False), "episode": {"num_slots": 8}},
    ]

    report = score(booster, rows, margin=0.0)
    assert report["within_2pct_of_best"] == 1.0
    assert report["picked_speedup_geomean"] == pytest.approx(math.exp(0.1))


@pytest.fixture()
def model_dir(tmp_path):
    """A copy of the shipped agent (the opening is added beside it)."""
    out = tmp_path / "rl"
    shutil.copytree(resolve_model_dir("rl-ppo"), out)
    (out / "opening.txt").unlink(missing_ok=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("opening", None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _install(model_dir, booster) -> None:
    """Save ``booster`` as the opening, with the manifest entry that vouches for it."""
    booster.save_model(str(model_dir / "opening.txt"))
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["opening"] = {
        "features": list(OPENING_FEATURES),
        "sha256": file_sha256(model_dir / "opening.txt"),
    }
    (model_dir / "manifest.json").write_text(json.dumps(manifest))


def test_the_policy_opens_with_the_bandit_then_asks_the_agent(model_dir):
    _install(model_dir, _synthetic_booster(always=True))
    policy = make_policy("rl", model=str(model_dir))
    policy.reset(spec(8))
    first = policy.decide(observation(0.0, ["colocated"] * 8, decoding=0), None)
    assert first.gpus["prefill"] == 2, first.reason  # the quarter split
    assert policy.initial_target_ == Target("split", 0.25)
    # Without the opening the agent's own first action applies (the shipped one colocates).
    plain = make_policy("rl", model=str(model_dir), opening=False)
    plain.reset(spec(8))
    first = plain.decide(observation(0.0, ["colocated"] * 8, decoding=0), None)
    assert first.gpus.get("prefill", 0) == 0


def test_an_opening_trained_on_other_features_is_refused(model_dir):
    _install(model_dir, _synthetic_booster())
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["opening"]["features"] = ["old"]
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="opening trained on other features"):
        make_policy("rl", model=str(model_dir)).reset(spec(8))
    with pytest.raises(ConfigError, match="opening_margin"):
        make_policy("rl", opening_margin=-0.1).reset(spec(8))


def test_fit_opening_end_to_end(model_dir, tmp_path):
    config = OpeningConfig(episodes=12, seed=1, held_out=0.25, workers=1)
    data = tmp_path / "episodes.jsonl"
    result = fit_opening(model_dir, config, TINY, data)
    assert result["episodes"] == 3 and result["train_episodes"] == 9
    assert result["margin"] == 0.02 and result["quantile"] == 0.25
    assert result["features"] == list(OPENING_FEATURES)
    assert 0.0 <= result["within_2pct_of_best"] <= 1.0
    assert (model_dir / "opening.txt").exists()
    # Written through a temporary file, yet readable like any other model file.
    assert (model_dir / "opening.txt").stat().st_mode & 0o044 == 0o044
    assert json.loads((model_dir / "manifest.json").read_text())["opening"]["episodes_total"] == 12
    # The payoffs streamed to the data file; a re-run reads them instead of simulating.
    assert len(data.read_text().splitlines()) == 12
    again = fit_opening(model_dir, config, TINY, data)
    assert again["picked_speedup_geomean"] == result["picked_speedup_geomean"]
    policy = make_policy("rl", model=str(model_dir))
    policy.reset(spec(2))
    assert policy.opening_ is not None  # the fitted opening, vouched for by the manifest
    assert sum(policy.decide(observation(0.0, ["colocated"] * 2, decoding=0), None).gpus.values())
    # Refitting with the same data and seed gives the same model file.
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["opening"]["sha256"] == again["sha256"] == result["sha256"]


def test_opening_config_and_draws_are_checked():
    with pytest.raises(ConfigError, match="episodes"):
        OpeningConfig(episodes=3).validate()
    with pytest.raises(ConfigError, match="held_out"):
        OpeningConfig(held_out=1.0).validate()
    assert draw_episodes(TINY, 5, seed=2) == draw_episodes(TINY, 5, seed=2)


def test_cli_trains_the_opening_and_refuses_bad_options(model_dir, tmp_path):
    from typer.testing import CliRunner

    from prorsa.cli.main import app

    runner = CliRunner()
    bad = runner.invoke(app, ["rl", "opening", "--model", str(model_dir), "--episodes", "3"])
    assert bad.exit_code != 0 and "episodes must be >= 10" in bad.output
    args = ["rl", "opening", "--model", str(model_dir), "--episodes", "10", "--workers", "1"]
    args += ["--families", "qwen3-30b-a3b-h200-dp4", "--family-weights", "", "--json"]
    ok = runner.invoke(app, [*args, "--data", str(tmp_path / "episodes.jsonl")])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output[ok.output.index("{") :])["episodes_total"] == 10
    assert (model_dir / "opening.txt").exists()


def test_a_model_without_an_opening_uses_the_agent(model_dir):
    policy = make_policy("rl", model=str(model_dir))
    policy.reset(spec(8))
    assert policy.opening_ is None
    assert policy.decide(observation(0.0, ["colocated"] * 8, decoding=0), None).gpus


def test_an_opening_the_manifest_does_not_vouch_for_is_refused(model_dir):
    # Left behind by an earlier fit (no manifest entry), or changed since (checksum).
    _synthetic_booster().save_model(str(model_dir / "opening.txt"))
    with pytest.raises(ConfigError, match="no 'opening' entry"):
        make_policy("rl", model=str(model_dir)).reset(spec(8))
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["opening"] = {"features": list(OPENING_FEATURES), "sha256": "0" * 64}
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="checksum"):
        make_policy("rl", model=str(model_dir)).reset(spec(8))


def test_training_a_new_agent_removes_an_old_opening(model_dir, tmp_path):
    """`prorsa rl train` replaces the manifest that vouched for the opening."""
    from prorsa.runtime.sim.rl_train import TrainConfig, train_ppo

    (model_dir / "opening.txt").write_text("old")
    config = TrainConfig(
        timesteps=128,
        workers=1,
        curriculum=((0.0, 2),),
        domain=TINY,
        n_steps=64,
        batch_size=64,
        eval_every=10**9,
        eval_episodes=1,
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    train_ppo(model_dir, config)
    assert not (model_dir / "opening.txt").exists()
    make_policy("rl", model=str(model_dir)).reset(spec(2))
