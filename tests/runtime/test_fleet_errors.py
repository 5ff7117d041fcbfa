"""A fleet that cannot start says why at once, before any engine is built."""

from __future__ import annotations

import pytest

from prorsa.errors import ConfigError
from prorsa.runtime.ray.config import EngineConfig

pytestmark = [pytest.mark.ray]


def test_fleet_config_errors_are_clear(ray_session, tiny_model_dir):
    from prorsa.runtime.ray.cluster import EngineFleet, FleetSpec

    config = EngineConfig(model=str(tiny_model_dir), connector=None)
    with pytest.raises(ConfigError, match="need 20 CPU"):
        EngineFleet.start(FleetSpec(config, roles=["decode"] * 20))
    with pytest.raises(ConfigError, match="unknown role"):
        EngineFleet.start(FleetSpec(config, roles=["prefill", "cook"]))
    with pytest.raises(ConfigError, match="outside the fleet"):
        EngineFleet.start(FleetSpec(config, roles=["decode"], overrides={3: {"dtype": "x"}}))
    with pytest.raises(ConfigError, match="bad engine override"):
        EngineFleet.start(FleetSpec(config, roles=["decode"], overrides={0: {"colour": 1}}))
    missing = EngineConfig(model="/nonexistent/model", connector=None)
    with pytest.raises(ConfigError, match="does not exist"):
        EngineFleet.start(FleetSpec(missing, roles=["decode"]))
