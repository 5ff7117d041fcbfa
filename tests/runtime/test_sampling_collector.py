"""An engine's delta outputs folded into result fields: logprobs JSON can carry."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace as NS

from prorsa.runtime.ray.sampling import LOGPROB_FLOOR, OutputCollector


def _ranked(*entries: tuple[int, float, int]) -> dict[int, NS]:
    return {token: NS(logprob=lp, rank=rank) for token, lp, rank in entries}


def test_masked_tokens_logprobs_are_floored_like_vllms_server():
    out = NS(
        outputs=[
            NS(
                token_ids=[5, 7],
                logprobs=[
                    _ranked((5, -0.1, 1), (6, -math.inf, 2)),  # 6 masked by top-k
                    _ranked((7, -math.inf, 2), (8, -0.01, 1)),  # sampled at -inf
                ],
            )
        ],
        prompt_token_ids=[1, 2],
        prompt_logprobs=[None, _ranked((2, -math.inf, 3), (3, -0.2, 1))],
    )
    collector = OutputCollector(logprobs=2, prompt_logprobs=1)
    collector.add(out)
    fields = collector.fields()
    assert fields["output_logprobs"] == [-0.1, LOGPROB_FLOOR]
    assert fields["top_logprobs"] == [
        [(5, -0.1), (6, LOGPROB_FLOOR)],
        [(8, -0.01), (7, LOGPROB_FLOOR)],
    ]
    assert fields["prompt_logprobs"] == [None, LOGPROB_FLOOR]
    json.dumps(fields, allow_nan=False)  # strict JSON: no Infinity anywhere
