"""A learned allocation policy: a PPO agent (stable-baselines3) that picks a target mode or
split every few seconds from a scale-free view of the cluster.

The observation (:mod:`prorsa.policy.rl_features`) and the action set with its safety
rule (:mod:`prorsa.policy.rl_actions`) live in the policy layer, so the training
environment (``prorsa.runtime.sim.gym_env``) and the deployed policy share them exactly:
both are :class:`TargetPolicy` subclasses and differ only in who picks the action.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from abc import abstractmethod
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.io import file_sha256
from prorsa.policy.base import POLICIES, ClusterSpec, SplitPolicy
from prorsa.policy.rl_actions import (
    COLOCATED,
    DECISION_INTERVAL_S,
    HOLD,
    TARGETS,
    SwitchGuard,
    Target,
)
from prorsa.policy.rl_features import OBS_FEATURES, observation_vector
from prorsa.policy.rl_opening import (
    DEFAULT_OPENING_MARGIN,
    OPENING_FEATURES,
    choose_arm,
    opening_arms,
)
from prorsa.policy.types import SWITCHING, Allocation, ClusterObservation, Forecast

__all__ = [
    "OBS_FEATURES",
    "TARGETS",
    "ExternalPolicy",
    "RLPolicy",
    "TargetPolicy",
    "resolve_model_dir",
]


class TargetPolicy(SplitPolicy):
    """Holds a target (colocated or a split) and revisits it every ``decision_interval_s``.

    The first decision (before any work arrives) sets the initial layout, which costs no
    switch. Later, at each decision point the agent is asked only when a change would pass
    the safety rule (a :class:`SwitchGuard`, and no slot still switching); otherwise the
    target holds without asking. Subclasses implement :meth:`choose` (an index into
    :data:`TARGETS`).

    Args:
        decision_interval_s: seconds between the agent's decisions (ticks in between
            hold the target).
        min_hold_s: seconds a target is kept before the next change.
        max_changes_per_min: average rate of target changes allowed.
    """

    def __init__(
        self,
        decision_interval_s: float = DECISION_INTERVAL_S,
        min_hold_s: float = SwitchGuard.min_hold_s,
        max_changes_per_min: float = SwitchGuard.max_changes_per_min,
    ) -> None:
        self.decision_interval_s = decision_interval_s
        self.min_hold_s = min_hold_s
        self.max_changes_per_min = max_changes_per_min

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        if self.decision_interval_s <= 0:
            raise ConfigError(f"{type(self).__name__}: decision_interval_s must be > 0")
        if self.resizing_ and getattr(self, "started_", False):
            return  # a lost engine keeps the target (a fraction) and the guard's timers
        self.guard_ = SwitchGuard(self.min_hold_s, self.max_changes_per_min)
        self.target_: Target = COLOCATED
        self.initial_target_: Target = COLOCATED
        self.started_ = False
        self.next_decision_s_ = 0.0
        # Slot-seconds spent switching, summed over the ticks this policy saw.
        self.switching_slot_s_ = 0.0
        self._last_tick_s: float | None = None

    @abstractmethod
    def choose(self, obs: ClusterObservation) -> int:
        """Index into :data:`TARGETS` for this decision."""

    def features(self, obs: ClusterObservation) -> np.ndarray:
        """The agent's observation of ``obs`` (including the safety rule's state)."""
        if not self.started_:
            return observation_vector(obs, self.cluster_, min_hold_s=self.min_hold_s)
        return observation_vector(
            obs,
            self.cluster_,
            since_change_s=self.guard_.since_change_s(obs.time_s),
            min_hold_s=self.min_hold_s,
        )

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        now = obs.time_s
        self._account_switching(obs)
        name = type(self).__name__
        if not self.started_:
            # The initial layout is applied before any work arrives: free to choose.
            target = TARGETS[self.choose(obs)]
            self.target_ = self.initial_target_ = COLOCATED if target is HOLD else target
            self.started_ = True
            self.guard_.reset(now)
            self.next_decision_s_ = now + self.decision_interval_s
            return self._allocation(self.target_, f"{name}: start {self.target_.label}")
        if now < self.next_decision_s_ - 1e-9:
            return self._allocation(self.target_, f"{name}: hold {self.target_.label}")
        while self.next_decision_s_ <= now + 1e-9:
            self.next_decision_s_ += self.decision_interval_s
        # The agent is only asked when the safety rule would let a change through.
        if not self.may_change(obs):
            return self._allocation(self.target_, f"{name}: guard holds {self.target_.label}")
        target = TARGETS[self.choose(obs)]
        if target is HOLD or self._same(target, self.target_):
            return self._allocation(self.target_, f"{name}: hold {self.target_.label}")
        self.guard_.record(now)
        self.target_ = target
        return self._allocation(target, f"{name}: change to {target.label}")

    @property
    def target_changes(self) -> int:
        """Target changes after the initial layout."""
        return self.guard_.changes

    def may_change(self, obs: ClusterObservation, at_s: float | None = None) -> bool:
        """True when a target change at ``at_s`` (default: the observation's time) would
        pass the safety rule: no slot is switching and the guard allows it."""
        switching = any(s.role == SWITCHING for s in obs.slots)
        return not switching and self.guard_.allows(obs.time_s if at_s is None else at_s)

    def _same(self, a: Target, b: Target) -> bool:
        if a.mode != b.mode:
            return False
        return a.mode != "split" or a.prefill_slots(self.cluster_.num_slots) == b.prefill_slots(
            self.cluster_.num_slots
        )

    def _allocation(self, target: Target, reason: str) -> Allocation:
        if target.mode == "colocated":
            return self.colocate(reason)
        return self.split(target.prefill_slots(self.cluster_.num_slots), reason)

    def _account_switching(self, obs: ClusterObservation) -> None:
        if self._last_tick_s is not None:
            switching = sum(1 for s in obs.slots if s.role == SWITCHING)
            self.switching_slot_s_ += switching * max(obs.time_s - self._last_tick_s, 0.0)
        self._last_tick_s = obs.time_s


class ExternalPolicy(TargetPolicy):
    """Applies the action its caller set (the Gymnasium environment's agent).

    ``action`` is consumed by the next decision; ticks without a new action hold.
    """

    def __init__(
        self,
        decision_interval_s: float = DECISION_INTERVAL_S,
        min_hold_s: float = SwitchGuard.min_hold_s,
        max_changes_per_min: float = SwitchGuard.max_changes_per_min,
    ) -> None:
        super().__init__(decision_interval_s, min_hold_s, max_changes_per_min)
        self.action: int | None = None

    def choose(self, obs: ClusterObservation) -> int:
        action, self.action = self.action, None
        return TARGETS.index(HOLD) if action is None else int(action)


@POLICIES.register("rl")
class RLPolicy(TargetPolicy):
    """A PPO agent trained in the simulator (`prorsa rl train`) that picks a target mode or
    split every ``decision_interval_s`` (see :class:`TargetPolicy` for the safety rule).

    Args:
        model: directory holding ``model.zip`` and ``manifest.json`` (relative names are
            looked up under the repository's ``models/``).
        decision_interval_s / min_hold_s / max_changes_per_min: as in :class:`TargetPolicy`.
        read_workload: read the run's expected shape when the observation has one (False
            hides it, as if unknown: an ablation).
        opening: open with the model's contextual-bandit opening (``opening.txt`` beside
            the agent, :mod:`prorsa.policy.rl_opening`) when it has one; False: the PPO
            agent's own first action.
        opening_margin: the opening leaves colocation only for a split predicted more
            than this much faster (0.02: 2%).
    """

    def __init__(
        self,
        model: str = "rl-ppo",
        decision_interval_s: float = DECISION_INTERVAL_S,
        min_hold_s: float = SwitchGuard.min_hold_s,
        max_changes_per_min: float = SwitchGuard.max_changes_per_min,
        read_workload: bool = True,
        opening: bool = True,
        opening_margin: float = DEFAULT_OPENING_MARGIN,
    ) -> None:
        super().__init__(decision_interval_s, min_hold_s, max_changes_per_min)
        self.model = model
        self.read_workload = read_workload
        self.opening = opening
        self.opening_margin = opening_margin

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        if self.opening_margin < 0:
            raise ConfigError("rl: opening_margin must be >= 0")
        path = resolve_model_dir(self.model)
        self.agent_ = load_agent(path)
        self.opening_ = load_opening(path) if self.opening else None

    def choose(self, obs: ClusterObservation) -> int:
        if not self.read_workload:
            obs = dataclasses.replace(obs, workload=None)
        features = self.features(obs)
        if not self.started_ and self.opening_ is not None:
            arm = choose_arm(self.opening_, features, self.cluster_.num_slots, self.opening_margin)
            return opening_arms()[arm][0]
        action, _ = self.agent_.predict(features, deterministic=True)
        return int(action)

    @classmethod
    def search_space(cls, trial) -> dict:
        # Not min_hold_s: the agent's "since change" feature is scaled by it, so a tuned
        # value would show the agent a scale it was never trained on.
        return {"decision_interval_s": trial.suggest_float("decision_interval_s", 5.0, 60.0)}


def resolve_model_dir(name: str) -> Path:
    """``name`` as given when it exists or is absolute, else ``models/<name>``."""
    path = Path(name)
    if path.is_absolute() or path.exists():
        return path
    return Path(__file__).resolve().parents[2] / "models" / name


def check_manifest(path: Path) -> dict:
    """The model's manifest, after checking it was trained on today's features and actions."""
    manifest_path = path / "manifest.json"
    if not (path / "model.zip").exists() or not manifest_path.exists():
        raise ConfigError(
            f"no trained RL policy at {path}",
            hint="train one with `prorsa rl train --out models/rl-ppo`",
        )
    manifest = json.loads(manifest_path.read_text())
    if tuple(manifest.get("features", ())) != OBS_FEATURES:
        raise ConfigError(
            f"{manifest_path}: trained on other features {manifest.get('features')}",
            hint="retrain with `prorsa rl train`",
        )
    if tuple(manifest.get("actions", ())) != tuple(t.label for t in TARGETS):
        raise ConfigError(
            f"{manifest_path}: trained with other actions {manifest.get('actions')}",
            hint="retrain with `prorsa rl train`",
        )
    return manifest


def load_agent(path: Path):
    """The PPO agent saved in ``path`` (loaded once per file version)."""
    check_manifest(path)
    zip_path = path / "model.zip"
    return _load_agent(str(zip_path), zip_path.stat().st_mtime_ns)


#: The opening model's file, beside ``model.zip`` (optional).
OPENING_FILE = "opening.txt"


def load_opening(path: Path):
    """The opening regressor saved in ``path`` (a LightGBM booster), or None without one.

    The manifest's ``opening`` entry vouches for the file: its features and its SHA-256
    (so an ``opening.txt`` left behind by an older fit, or changed since, is not used).

    Raises:
        ConfigError: the file has no manifest entry, another checksum, or was trained on
            other features.
    """
    file = path / OPENING_FILE
    if not file.exists():
        return None
    entry = check_manifest(path).get("opening")
    hint = "fit it again with `prorsa rl opening`"
    if not isinstance(entry, dict):
        raise ConfigError(f"{file}: no 'opening' entry in {path / 'manifest.json'}", hint=hint)
    if tuple(entry.get("features", ())) != OPENING_FEATURES:
        raise ConfigError(f"{path / 'manifest.json'}: opening trained on other features", hint=hint)
    digest = file_sha256(file)
    if entry.get("sha256") != digest:
        raise ConfigError(
            f"{file}: checksum {digest[:12]} is not the manifest's "
            f"({str(entry.get('sha256'))[:12]})",
            hint=hint,
        )
    return _load_opening(str(file), digest)


@functools.lru_cache(maxsize=4)
def _load_opening(file: str, sha256: str):
    import lightgbm as lgb

    return lgb.Booster(model_file=file)


@functools.lru_cache(maxsize=4)
def _load_agent(zip_path: str, mtime_ns: int):
    from stable_baselines3 import PPO

    return PPO.load(zip_path, device="cpu")
