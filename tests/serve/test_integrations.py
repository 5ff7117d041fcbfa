"""The trainer settings prorsa hands out: the keys each trainer's config really has."""

from __future__ import annotations

import importlib.util
import tomllib

import pytest

from prorsa.errors import ConfigError
from prorsa.integrations.areal import areal_environment, areal_server_addr
from prorsa.integrations.prime_rl import prime_rl_client_config, prime_rl_toml
from prorsa.integrations.skyrl import skyrl_cli_overrides, skyrl_overrides
from prorsa.integrations.verl import verl_sampling

# Field names of prime-rl's ClientConfig and SkyRL's InferenceEngineConfig that prorsa sets
# (from prime_rl/configs/shared.py and skyrl/train/config/config.py).
PRIME_RL_CLIENT_FIELDS = {
    "base_url", "admin_base_url", "api_key_var", "extra_headers_from_state", "skip_model_check",
}  # fmt: skip
SKYRL_ENGINE_FIELDS = {
    "run_engines_locally", "external_proxy_url", "served_model_name", "enable_prefix_caching",
}  # fmt: skip


def test_skyrl_overrides_use_skyrl_keys():
    overrides = skyrl_overrides("http://h:8000/v1/", "tiny")
    assert {k.rsplit(".", 1)[1] for k in overrides} == SKYRL_ENGINE_FIELDS
    assert overrides["generator.inference_engine.external_proxy_url"] == "http://h:8000"
    assert "generator.inference_engine.run_engines_locally=false" in skyrl_cli_overrides(
        "http://h:8000", "tiny"
    )


def test_prime_rl_toml_parses_to_the_client_config():
    parsed = tomllib.loads(prime_rl_toml("http://h:8000", "tiny"))
    client = parsed["orchestrator"]["model"]["client"]
    assert set(client) == PRIME_RL_CLIENT_FIELDS
    assert client == prime_rl_client_config("http://h:8000")
    assert client["base_url"] == "http://h:8000/v1" and client["admin_base_url"] == [
        "http://h:8000"
    ]
    assert client["extra_headers_from_state"] == {"X-Session-ID": "trajectory_id"}
    assert parsed["orchestrator"]["model"]["name"] == "tiny"


def test_areal_address():
    assert areal_server_addr("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert areal_environment("127.0.0.1:9") == {"AREAL_LLM_SERVER_ADDRS": "127.0.0.1:9"}
    with pytest.raises(ValueError, match="host and a port"):
        areal_server_addr("http://nohost")


def test_verl_sampling_translation():
    verl = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0,
            "logprobs": True}  # fmt: skip
    assert verl_sampling(verl, 64) == {
        "temperature": 1.0, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0,
        "max_tokens": 64, "logprobs": 0,
    }  # fmt: skip
    assert "logprobs" not in verl_sampling({**verl, "logprobs": False}, 8)
    assert verl_sampling({"max_new_tokens": 5}, 64)["max_tokens"] == 5
    # Within what the context has left, as verl's servers clamp it (and at least 1).
    assert verl_sampling({"max_tokens": 50}, 64, room=20)["max_tokens"] == 20
    assert verl_sampling({}, 64, room=0)["max_tokens"] == 1
    assert verl_sampling({}, -3)["max_tokens"] == 1  # verl's budget spent, no context limit
    with pytest.raises(ConfigError, match="beam_width"):
        verl_sampling({"beam_width": 4}, 8)


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed")
def test_verl_manager_needs_verl():
    import prorsa.integrations.verl as module

    with pytest.raises(ModuleNotFoundError, match="verl"):
        module.ProrsaAgentLoopManager  # noqa: B018 - built on attribute access


def test_trainer_configs_example_prints_every_trainer(capsys):
    from examples.trainer_configs import main

    text = main(["--url", "http://h:8000", "--model", "tiny"])
    for needle in ("external_proxy_url=http://h:8000", 'base_url = "http://h:8000/v1"',
                   "AREAL_LLM_SERVER_ADDRS=h:8000", "custom.prorsa_url=http://h:8000",
                   "verl.ProrsaAgentLoopManagerTQ \\"):  # fmt: skip
        assert needle in text


def test_a_worker_extension_reaches_every_engine_and_a_missing_one_is_named(tmp_path):
    from prorsa.serve.config import ServeConfig
    from prorsa.serve.startup import engine_config_for
    from tests.serve.helpers import model_folder

    model = str(model_folder(tmp_path))
    config = ServeConfig(model=model, worker_extension_cls="json.JSONDecoder")
    config.validate()
    engine = engine_config_for(config, on_cpu=True)
    assert engine.engine_kwargs == {"worker_extension_cls": "json.JSONDecoder"}
    assert engine_config_for(ServeConfig(model=model), on_cpu=True).engine_kwargs == {}
    missing = ServeConfig(model=model, worker_extension_cls="skyrl_missing.WorkerWrap")
    with pytest.raises(ConfigError, match="skyrl_missing"):
        missing.validate()
