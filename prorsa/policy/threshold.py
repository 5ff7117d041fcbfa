"""Reactive autoscaling on queue length and KV use with hysteresis (the reference
autoscalers' approach: act on what is already queued, one slot at a time)."""

from __future__ import annotations

from prorsa.errors import ConfigError
from prorsa.policy.base import POLICIES, ClusterSpec, SplitPolicy
from prorsa.policy.demand import current_load
from prorsa.policy.types import Allocation, ClusterObservation, Forecast


@POLICIES.register("threshold")
class ThresholdPolicy(SplitPolicy):
    """Move one slot toward the side whose queue or memory crossed its threshold.

    Args:
        prefill_fraction: starting share of prefill slots.
        prefill_wait_high_s / prefill_wait_low_s: expected prefill queue wait (backlog over
            prefill throughput) above which prefill grows, below which it may shrink.
        kv_high: decode-side KV use above which decode grows.
        batch_high: decode sequences per decode GPU above which decode grows.
        cooldown_s: after a change, hold for this long (autoscalers' cooldown window: a
            queue needs time to react to new capacity, or the policy oscillates).
    """

    def __init__(
        self,
        prefill_fraction: float = 0.25,
        prefill_wait_high_s: float = 1.0,
        prefill_wait_low_s: float = 0.1,
        kv_high: float = 0.85,
        batch_high: float = 96.0,
        cooldown_s: float = 30.0,
    ) -> None:
        self.prefill_fraction = prefill_fraction
        self.prefill_wait_high_s = prefill_wait_high_s
        self.prefill_wait_low_s = prefill_wait_low_s
        self.kv_high = kv_high
        self.batch_high = batch_high
        self.cooldown_s = cooldown_s

    @classmethod
    def search_space(cls, trial) -> dict:
        high = trial.suggest_float("prefill_wait_high_s", 0.2, 5.0, log=True)
        return {
            "prefill_fraction": trial.suggest_float("prefill_fraction", 0.05, 0.5),
            "prefill_wait_high_s": high,
            "prefill_wait_low_s": high * trial.suggest_float("low_over_high", 0.05, 0.5),
            "kv_high": trial.suggest_float("kv_high", 0.6, 0.97),
            "batch_high": trial.suggest_float("batch_high", 16.0, 256.0, log=True),
            "cooldown_s": trial.suggest_float("cooldown_s", 0.0, 60.0),
        }

    @classmethod
    def search_defaults(cls) -> dict:
        defaults = super().search_defaults()
        low_over_high = defaults["prefill_wait_low_s"] / defaults["prefill_wait_high_s"]
        return {**defaults, "low_over_high": low_over_high}

    def reset(self, cluster: ClusterSpec, seed: int = 0) -> None:
        super().reset(cluster, seed)
        if not 0 <= self.prefill_wait_low_s < self.prefill_wait_high_s:
            raise ConfigError("threshold: need 0 <= prefill_wait_low_s < prefill_wait_high_s")
        if not 0 < self.kv_high <= 1:
            raise ConfigError("threshold: kv_high must be in (0, 1]")
        if self.cooldown_s < 0:
            raise ConfigError("threshold: cooldown_s must be >= 0")
        # A lost engine keeps the cooldown and the split (not back to prefill_fraction).
        self.last_change_s_ = self.kept_on_resize("last_change_s_", float("-inf"))
        self.started_ = self.kept_on_resize("started_", False)

    def decide(self, obs: ClusterObservation, forecast: Forecast | None) -> Allocation:
        spec = self.cluster_
        slots, size = spec.num_slots, spec.slot_gpus
        load = current_load(obs)
        # A lost decode engine can leave every slot prefilling: keep one to decode.
        prefill = min(load.prefill_slots, slots - 1)
        if not self.started_ or prefill == 0:
            self.started_ = True
            return self.split(self.initial_prefill_slots(), "threshold: initial split")
        per_slot = spec.prefill_tokens_per_s_per_gpu * size
        wait_s = load.prefill_backlog_tokens / max(prefill * per_slot, 1e-9)
        decode_views = [s for s in obs.slots if s.role == "decode"]
        kv_used = sum(s.kv_used_tokens for s in decode_views)
        kv_cap = sum(s.kv_capacity_tokens for s in decode_views) or 1
        kv_use = kv_used / kv_cap
        batch = load.decode_sequences / max(load.decode_slots * size, 1)
        decode_hot = kv_use > self.kv_high or batch > self.batch_high
        if obs.time_s - self.last_change_s_ < self.cooldown_s:
            return self.split(prefill, "threshold: cooling down")
        if wait_s > self.prefill_wait_high_s and not decode_hot and prefill < slots - 1:
            self.last_change_s_ = obs.time_s
            return self.split(prefill + 1, f"threshold: prefill wait {wait_s:.2f}s")
        if wait_s < self.prefill_wait_low_s and decode_hot and prefill > 1:
            self.last_change_s_ = obs.time_s
            return self.split(prefill - 1, f"threshold: decode kv {kv_use:.0%} batch {batch:.0f}")
        return self.split(prefill, "threshold: hold")
