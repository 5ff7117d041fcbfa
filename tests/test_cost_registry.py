"""Registry behaviour and a conformance check on every registered profile."""

from __future__ import annotations

import re

import pytest

from prorsa.errors import ConfigError
from prorsa.registry import Registry
from prorsa.runtime.sim.cost import (
    PROFILES,
    CostProfile,
    get_profile,
    list_profiles,
    register_profile,
    roofline_profile,
)
from prorsa.runtime.sim.cost.models import get_model

NAME = re.compile(
    r"^(a100|h100|h200)-(llama-3-8b|qwen2\.5-7b|qwen2\.5-32b|qwen3-30b-a3b|qwen3-235b-a22b)"
    r"-tp[1248]"
    r"(-roofline)?$"
)


def test_expected_names_are_registered():
    names = list_profiles()
    for name in (
        "h200-qwen2.5-7b-tp1",
        "h200-llama-3-8b-tp1",
        "h200-qwen2.5-32b-tp1",
        "h200-qwen2.5-7b-tp4",
        "h100-llama-3-8b-tp2-roofline",
        "h200-qwen3-30b-a3b-tp1-roofline",
        "h200-qwen3-30b-a3b-tp1",
        "h200-qwen3-235b-a22b-tp8",
        "a100-qwen2.5-32b-tp4-roofline",
    ):
        assert name in names
    # Plugins (e.g. the runtime's CPU profile) may add names of their own in this process;
    # every built-in GPU profile follows the naming scheme.
    gpu = [n for n in names if n.split("-")[0] in ("a100", "h100", "h200")]
    assert gpu and all(NAME.match(n) for n in gpu)
    # qwen2.5-7b has 28 heads: tp=8 is not a valid split
    assert "h200-qwen2.5-7b-tp8-roofline" not in names
    # 65 GB of weights leave no room for 32k tokens of KV on one 80 GB GPU
    assert "h100-qwen2.5-32b-tp1-roofline" not in names


@pytest.mark.parametrize("name", list_profiles())
def test_every_profile_is_sane(name):
    p = get_profile(name)
    assert p.name == name
    assert get_profile(name) is p  # cached
    assert p.kv_capacity_tokens >= 32768
    assert 0 < p.prefill_time_s(512) < p.prefill_time_s(2048) < p.prefill_time_s(8192)
    assert p.prefill_time_s(2048, 30000) > p.prefill_time_s(2048)
    assert 0 < p.decode_step_time_s(1, 2048) <= p.decode_step_time_s(64, 64 * 2048)
    assert p.decode_step_time_s(1, 1) >= p.decode_floor_s
    assert p.mixed_step_time_s(512, 0, 32, 32 * 2048) >= p.decode_step_time_s(32, 32 * 2048)
    assert p.provenance


def test_duplicate_name_is_an_error():
    registry: Registry = Registry("cost profile")
    registry.register("x", lambda: None)
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("x", lambda: None)
    with pytest.raises(ConfigError, match="already registered"):
        register_profile(get_profile("h200-qwen2.5-7b-tp1"))


def test_register_and_get_custom_profile():
    base = get_profile("h200-qwen2.5-7b-tp1").to_dict()
    custom = CostProfile.from_dict({**base, "name": "test-custom-profile"})
    assert register_profile(custom) == "test-custom-profile"
    try:
        assert get_profile("test-custom-profile") is custom
    finally:
        PROFILES._items.pop("test-custom-profile", None)


def test_unknown_profile_lists_choices():
    with pytest.raises(ConfigError, match="unknown cost profile") as info:
        get_profile("h300-gpt-5-tp1")
    assert "h200-qwen2.5-7b-tp1" in info.value.hint


def test_roofline_is_near_the_measured_tables():
    """The roofline's efficiency factors were set from the H200 tables; keep them close."""
    for model in ("llama-3-8b", "qwen2.5-7b", "qwen2.5-32b"):
        roof, measured = get_profile(f"h200-{model}-tp1-roofline"), get_profile(f"h200-{model}-tp1")
        for n in (2048, 8192):
            assert roof.prefill_time_s(n) == pytest.approx(measured.prefill_time_s(n), rel=0.25)
        for b in (1, 64, 128):
            assert roof.decode_step_time_s(b, b * 2048) == pytest.approx(
                measured.decode_step_time_s(b, b * 2048), rel=0.25
            )


def test_tensor_parallel_speeds_up_and_adds_capacity():
    one, four = (
        get_profile("h100-llama-3-8b-tp1-roofline"),
        get_profile("h100-llama-3-8b-tp4-roofline"),
    )
    assert four.prefill_time_s(8192) < one.prefill_time_s(8192) / 2
    assert four.kv_capacity_tokens > 4 * one.kv_capacity_tokens
    assert four.kv_bytes_per_token == one.kv_bytes_per_token // 4


def test_moe_roofline_reads_experts_by_batch():
    p = get_profile("h200-qwen3-30b-a3b-tp1-roofline")
    assert "128 experts, 8 active" in p.provenance["moe"]
    arch = get_model("qwen3-30b-a3b")
    assert arch.num_layers * arch.active_layer_params() < arch.total_params() / 5
    assert p.decode_step_time_s(128, 128 * 2048) > 3 * p.decode_step_time_s(1, 2048)


def test_invalid_tp_and_unknown_names():
    with pytest.raises(ConfigError, match="tp=3"):
        roofline_profile("llama-3-8b", "h100", 3)
    with pytest.raises(ConfigError, match="unknown hardware"):
        roofline_profile("llama-3-8b", "tpu", 1)
    with pytest.raises(ConfigError, match="does not fit"):
        roofline_profile("qwen2.5-32b", "a100", 1)
