"""The rollout service as a Ray actor (over fake engines that live inside the actor)."""

from __future__ import annotations

import pytest

from prorsa.serve import ServeConfig, rollout_service_actor
from tests.serve.fakes import FakeFleet, WeightedFakeEngine, tokens_for
from tests.serve.helpers import model_folder, weights_folder

pytestmark = [pytest.mark.ray]


def test_service_actor_generates_and_updates_weights(ray_session, tmp_path):
    ray = ray_session
    fleet = FakeFleet([WeightedFakeEngine(i) for i in range(2)], ["colocated"] * 2)
    config = ServeConfig(model=str(model_folder(tmp_path)), engines=2, policy="colocate")
    actor = rollout_service_actor(config, fleet=fleet)
    try:
        status = ray.get(actor.start.remote(), timeout=120)
        first = ray.get(actor.generate.remote("s", [5, 6, 7], {"max_tokens": 3}))
        sync = ray.get(actor.update_weights_from_path.remote(str(weights_folder(tmp_path, "w"))))
        second = ray.get(actor.generate.remote("s", [5, 6, 7], {"max_tokens": 3}))
        ended = ray.get(actor.end_session.remote("s"))
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    assert set(status["roles"].values()) == {"colocated"}
    assert first.output_token_ids == tokens_for([5, 6, 7], 3, 0) and first.weight_version == 0
    assert sync["version"] == 1 and second.weight_version == 1 and second.turn == 1
    assert second.output_token_ids == tokens_for([5, 6, 7], 3, 1) and ended
