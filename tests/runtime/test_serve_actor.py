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
        # A trainer that pushes weights itself wraps its calls in the service's window.
        opened = ray.get(actor.begin_weight_update.remote(), timeout=30)
        pushed = ray.get(actor.collective_rpc.remote("update_weights"), timeout=30)
        pushed_sync = ray.get(actor.finish_weight_update.remote(5), timeout=30)
        ended = ray.get(actor.end_session.remote("s"))
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    assert set(status["roles"].values()) == {"colocated"}
    assert first.output_token_ids == tokens_for([5, 6, 7], 3, 0) and first.weight_version == 0
    assert sync["version"] == 1 and second.weight_version == 1 and second.turn == 1
    assert second.output_token_ids == tokens_for([5, 6, 7], 3, 1) and ended
    assert opened["from_version"] == 1 and len(pushed) == 2 and pushed_sync["version"] == 5


def test_resume_reaches_a_paused_service_actor_whose_request_slots_are_all_held(
    ray_session, tmp_path
):
    """Turns waiting at a paused service's gate hold the actor's request slots; pause and
    resume take theirs from the control group, so the trainer's resume still arrives."""
    ray = ray_session
    fleet = FakeFleet([WeightedFakeEngine(i) for i in range(2)], ["colocated"] * 2)
    config = ServeConfig(model=str(model_folder(tmp_path)), engines=2, policy="colocate")
    actor = rollout_service_actor(config, fleet=fleet, max_concurrency=3)
    try:
        ray.get(actor.start.remote(), timeout=120)
        ray.get(actor.pause.remote("keep"), timeout=10)
        turns = [actor.generate.remote(f"s{i}", [5, 6, i], {"max_tokens": 2}) for i in range(3)]
        held, _ = ray.wait(turns, timeout=1)
        ray.get(actor.resume.remote(), timeout=10)
        results = ray.get(turns, timeout=30)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
    assert held == []  # all three waited at the gate
    assert [r.output_token_ids for r in results] == [tokens_for([5, 6, i], 2, 0) for i in range(3)]
