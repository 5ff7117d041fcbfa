"""SlotView.of: the simulator's fast constructor builds the same frozen view."""

from __future__ import annotations

import dataclasses

import pytest

from prorsa.policy.types import SlotView

FIELDS = dict(
    slot_id=3, role="decode", target_role=None, gpus=2, engines=1, queued_prefill_tokens=7,
    running_sequences=4, kv_used_tokens=900, kv_capacity_tokens=4096, busy=True, since_s=1.5,
    cached_tokens=120, source_role=None, drained_s=None,
)  # fmt: skip


def test_of_equals_the_constructor_and_stays_frozen():
    view = SlotView.of(**FIELDS)
    assert view == SlotView(**FIELDS)
    assert hash(view) == hash(SlotView(**FIELDS))
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.role = "prefill"
    assert dataclasses.replace(view, running_sequences=0).running_sequences == 0
    # of() skips __init__: a __post_init__ added later would not run for the simulator
    assert not hasattr(SlotView, "__post_init__")


@pytest.mark.parametrize(
    "fields",
    [
        {k: v for k, v in FIELDS.items() if k != "drained_s"},  # one missing
        {**FIELDS, "extra": 1},  # one unknown
        dict(reversed(list(FIELDS.items()))),  # out of order
    ],
)
def test_of_refuses_anything_but_every_field_in_order(fields):
    with pytest.raises(TypeError, match="every field in order"):
        SlotView.of(**fields)
