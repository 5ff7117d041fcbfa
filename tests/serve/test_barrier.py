"""The dispatch barrier's leg accounting and how it ends the legs of a lost engine."""

from __future__ import annotations

import asyncio

import pytest

from prorsa.runtime.ray.barrier import BarrierClient, DispatchBarrier
from prorsa.runtime.ray.client import EngineUnavailable


class _Silent:
    """An engine client whose calls never answer."""

    engine_id = 4

    async def generate(self, *args, **kwargs):
        await asyncio.Event().wait()


def test_legs_are_counted_until_they_return_and_a_dropped_engine_ends_them():
    async def go():
        barrier = DispatchBarrier()
        client = BarrierClient(_Silent(), barrier)
        legs = [asyncio.ensure_future(client.generate("r", [1], 1)) for _ in range(3)]
        await asyncio.sleep(0.01)
        counted = barrier.legs_past([3, 4])
        dropped = barrier.drop_engine(4, "stuck")
        outcomes = await asyncio.gather(*legs, return_exceptions=True)
        return counted, dropped, outcomes, barrier.legs_past([4]), barrier.dropped

    counted, dropped, outcomes, after, left = asyncio.run(go())
    assert counted == {4: 3} and dropped == 3 and after == {} and left == {}
    for outcome in outcomes:
        assert isinstance(outcome, EngineUnavailable) and outcome.engine_id == 4
        assert "left service: stuck" in str(outcome)


def test_a_leg_cancelled_by_its_caller_as_well_stays_cancelled():
    async def go():
        barrier = DispatchBarrier()
        leg = asyncio.ensure_future(BarrierClient(_Silent(), barrier).generate("r", [1], 1))
        await asyncio.sleep(0.01)
        leg.cancel()  # the turn's own caller gave up
        barrier.drop_engine(4, "stuck")
        with pytest.raises(asyncio.CancelledError):
            await leg

    asyncio.run(go())


def test_a_leg_held_at_the_barrier_for_an_engine_that_left_never_enters_it():
    async def go():
        barrier = DispatchBarrier()
        barrier.close()
        leg = asyncio.ensure_future(BarrierClient(_Silent(), barrier).generate("r", [1], 1))
        await asyncio.sleep(0.01)
        waiting = (barrier.held, barrier.legs_past([4]))
        barrier.drop_engine(4, "stuck")  # planned for engine 4, still at the barrier
        await asyncio.sleep(0.01)
        still = not leg.done()
        barrier.open()
        with pytest.raises(EngineUnavailable, match="left service: stuck"):
            await asyncio.wait_for(leg, 1)
        return waiting, still, barrier.legs_past([4])

    waiting, still, inside = asyncio.run(go())
    assert waiting == (1, {}) and still and inside == {}
