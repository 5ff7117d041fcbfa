"""Engine configuration: connector choice, environment, KV-transfer settings, pools."""

from __future__ import annotations

import pytest

from prorsa.errors import ConfigError
from prorsa.runtime.ray.cluster import _with_side_channel_ports
from prorsa.runtime.ray.config import (
    EngineConfig,
    engine_environment,
    kv_transfer_config,
    nixl_available,
)
from prorsa.runtime.ray.engine import side_channel_ports
from prorsa.runtime.ray.pools import Role, RolePools, parse_role
from tests.runtime.fakes import FakeEngine


def test_connector_choice_is_explicit():
    auto = EngineConfig(model="m", kv_storage_dir="/tmp/kv")
    assert auto.resolved_connector() == ("nixl" if nixl_available() else "example")
    assert EngineConfig(model="m", connector=None).resolved_connector() is None
    with pytest.raises(ConfigError, match="unknown connector"):
        EngineConfig(model="m", connector="carrier-pigeon").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_storage_dir"):
        EngineConfig(model="m", connector="example").validate()
    with pytest.raises(ConfigError, match="kv_wait_timeout_s"):
        EngineConfig(model="m", connector=None, kv_wait_timeout_s=-1).validate()


def test_kv_transfer_config_per_connector():
    nixl = kv_transfer_config(EngineConfig(model="m", connector="nixl"), "cpu")
    assert nixl == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }
    assert (
        kv_transfer_config(EngineConfig(model="m", connector="nixl"), "cuda")["kv_buffer_device"]
        == "cuda"
    )
    example = kv_transfer_config(
        EngineConfig(model="m", connector="example", kv_storage_dir="/kv"), "cpu"
    )
    assert example["kv_connector_extra_config"] == {"shared_storage_path": "/kv"}
    assert example["kv_load_failure_policy"] == "recompute"
    assert kv_transfer_config(EngineConfig(model="m", connector=None), "cpu") is None


def test_cpu_only_environment_stays_off_gpu():
    config = EngineConfig(model="m")
    cpu = engine_environment(config, 5601, on_cpu=True)
    gpu = engine_environment(config, 5601, on_cpu=False)
    assert (
        cpu["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        and cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    )
    assert not any(k.startswith("VLLM_CPU") or k == "OMP_NUM_THREADS" for k in gpu)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu
    assert gpu["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601" and gpu["HF_HUB_OFFLINE"] == "1"
    assert "help" not in EngineConfig.help() and EngineConfig.help()["connector"]


def test_pools_reject_inconsistent_setup():
    with pytest.raises(ConfigError, match="no role"):
        RolePools([FakeEngine(0)], {})
    with pytest.raises(ConfigError, match="used twice"):
        RolePools([FakeEngine(0), FakeEngine(0)], {0: "decode"})
    with pytest.raises(ConfigError, match="unknown role"):
        RolePools([FakeEngine(0)], {0: "switching"})
    assert parse_role("switching", serving=False) is Role.SWITCHING
    pools = RolePools([FakeEngine(0), FakeEngine(1)], {0: "prefill", 1: "decode"})
    pools.mark_dead(1)
    assert pools.counts() == {"prefill": 1, "decode": 0, "colocated": 0, "switching": 0, "dead": 1}


def test_side_channel_ports_are_distinct_free_and_below_the_ephemeral_range():
    import socket

    from prorsa.runtime.ray.engine import SIDE_CHANNEL_PORTS_FROM, _ephemeral_low

    ports = side_channel_ports(8)
    assert len(set(ports)) == 8
    assert all(SIDE_CHANNEL_PORTS_FROM <= p < _ephemeral_low() for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free


def test_fleet_gives_each_nixl_engine_its_own_side_channel_port():
    configs = [EngineConfig(model="m", connector="nixl") for _ in range(4)]
    configs.append(EngineConfig(model="m", connector="nixl", side_channel_port=20001))
    out = _with_side_channel_ports(configs)
    ports = [c.side_channel_port for c in out]
    assert ports[4] == 20001  # a chosen port is kept
    assert len(set(ports[:4])) == 4 and None not in ports
