"""The fallback KV connector (ExampleConnector through a shared folder) hands off too."""

from __future__ import annotations

import asyncio

import pytest

from prorsa.runtime.ray.router import PDRouter, RouterConfig, TurnRequest
from tests.runtime.fleets import start_tiny_fleet

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fleet(ray_session, tiny_model_dir, tmp_path_factory):
    # Engine 2 has no connector: its greedy output is the reference.
    fleet = start_tiny_fleet(
        tiny_model_dir,
        tmp_path_factory.mktemp("kv-store"),
        ["prefill", "decode", "colocated"],
        max_num_seqs=4,
        connector="example",
        overrides={2: {"connector": None}},
    )
    yield fleet
    fleet.shutdown()


def test_example_connector_handoff_matches_colocated(fleet):
    assert [fleet.health[i]["connector"] for i in range(3)] == ["example", "example", None]
    router = PDRouter(fleet.pools(), RouterConfig(route_timeout_s=60))
    prompts = [[(5 + 7 * i + j) % 500 + 3 for i in range(n)] for j, n in enumerate((20, 300))]

    async def run():
        out = []
        for i, prompt in enumerate(prompts):
            ref = await router.generate(TurnRequest(f"c{i}", prompt, 16, mode="colocated"))
            pd = await router.generate(TurnRequest(f"d{i}", prompt, 16, mode="disaggregated"))
            out.append((ref, pd))
        return out

    results = asyncio.run(run())
    for ref, pd in results:
        assert pd.path == "disaggregated"
        assert pd.output_token_ids == ref.output_token_ids
    # The 300-token prompt's two full blocks came from the shared folder, not a prefill.
    assert results[1][1].num_cached_tokens >= 256
