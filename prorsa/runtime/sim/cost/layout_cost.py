"""``LayoutCost``: step times of one engine with ``dp`` lock-stepped attention ranks.

The object the simulator evaluates on its hot path: plain floats and per-token arrays
built once from ``LayoutTerms``. Units: seconds; token counts per DP rank.

A step of the engine (all ranks advance together; MoE layers exchange tokens):

* each rank ``i`` runs ``tokens_i = batch_i + prefill_i`` tokens through its attention
  and non-expert GEMMs; its device time is
  ``dense(m_i) + lm_head(rows_i) + attn_decode(batch_i, ctx_i) + attn_prefill(chunk_i)``;
* the MoE layers see ``T`` tokens: all ranks' tokens after the all-gather (``sum``, or
  ``dp * max`` when ranks are padded), priced from the measured fused-MoE table for the
  chosen routing distribution, plus the all-gather/reduce-scatter or DeepEP traffic;
* the step lasts as long as the slowest rank: ``device = max_i(rank_i) + moe(T) + comm``;
* CUDA graphs: a pure-decode step replays full graphs (device time only). A step in which
  any rank prefills runs without them on *every* rank (vLLM takes the minimum graph mode
  over DP ranks; SGLang runs extend batches without graphs) and pays ``graph_loss_s``
  (per-layer host overhead, ``host_costs``); when no graph runs at all (a rank over
  ``max_capture_tokens``) its tensor-parallel all-reduces are also eager;
* padding: under vLLM, while any graph mode is on, every rank is padded to the largest
  rank's token count (``coordinate_batch_across_dp``); eager steps are not padded;
* every step adds ``sched_cpu_s`` of CPU scheduling unless scheduling is asynchronous.

Semantics (``semantics=``):

* ``"vllm"`` (default): a rank's step mixes its decodes with prefill chunks (chunked
  prefill); graph mode and padding follow ``vllm/v1/worker/dp_utils.py``.
* ``"sglang"``: a rank with a prefill runs it alone (its decodes wait a step; the
  simulator must not advance them, see ``mixes_prefill_with_decode``); a step with any
  prefill runs without graphs and without padding; pure decode is padded as in vLLM.

Decode-only steps are linear in the slowest rank's context sum for fixed batches
(``decode_epoch_terms``), so a batch's step times form an arithmetic series.
"""

from __future__ import annotations

from array import array

import numpy as np

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost.layout_terms import LayoutTerms
from prorsa.runtime.sim.cost.moe_tables import DISTRIBUTIONS

SEMANTICS = ("vllm", "sglang")
DEFAULT_SEMANTICS = "vllm"
DEFAULT_ROUTING = "balanced"


class _Curve:
    """A sampled curve expanded to one value per integer token count (0 -> 0 s)."""

    __slots__ = ("last", "slope", "values")

    def __init__(self, grid: list, seconds: list, upto: int) -> None:
        xs = np.arange(upto + 1, dtype=float)
        gx = np.concatenate([[0.0], np.asarray(grid, dtype=float)])
        gy = np.concatenate([[0.0], np.asarray(seconds, dtype=float)])
        self.values = array("d", np.interp(xs, gx, gy))
        self.last = upto
        # past the expanded range: along the slope of the last measured segment
        self.slope = max(float((gy[-1] - gy[-2]) / (gx[-1] - gx[-2])), 0.0)
        if upto > gx[-1]:
            tail = xs > gx[-1]
            extended = gy[-1] + self.slope * (xs[tail] - gx[-1])
            for i, v in zip(np.flatnonzero(tail), extended, strict=True):
                self.values[i] = float(v)

    def __call__(self, tokens) -> float:
        i = int(tokens)
        if i <= self.last:
            return self.values[i]
        return self.values[self.last] + self.slope * (tokens - self.last)


class _Zero:
    __slots__ = ()

    def __call__(self, tokens) -> float:
        return 0.0


class LayoutCost:
    """Evaluate steps of one engine layout (see the module docstring for the model)."""

    def __init__(
        self,
        terms: LayoutTerms,
        *,
        semantics: str = DEFAULT_SEMANTICS,
        routing: str = DEFAULT_ROUTING,
        async_scheduling: bool = False,
    ) -> None:
        if semantics not in SEMANTICS:
            raise ConfigError(
                f"unknown DP semantics '{semantics}'", hint=f"choose one of: {', '.join(SEMANTICS)}"
            )
        if routing not in DISTRIBUTIONS:
            raise ConfigError(
                f"unknown routing distribution '{routing}'",
                hint=f"choose one of: {', '.join(DISTRIBUTIONS)}",
            )
        self.terms = terms
        self.name = terms.name
        self.model = terms.model
        self.hardware = terms.hardware
        self.layout = terms.parsed_layout
        self.semantics = semantics
        self.routing = routing
        self.async_scheduling = bool(async_scheduling)
        #: lock-stepped attention ranks (1 for a plain TP engine)
        self.dp_ranks = self.layout.dp
        self.tp = self.layout.tp
        self.gpus = self.layout.gpus
        self.kv_capacity_tokens = terms.kv_capacity_tokens_per_rank  # per rank
        self.kv_bytes_per_token = terms.kv_bytes_per_token  # per GPU of a rank
        self.max_batch = terms.max_batch_per_rank
        self.max_step_tokens = terms.max_step_tokens_per_rank
        self.max_capture_tokens = terms.max_capture_tokens
        #: False under SGLang semantics: a rank that prefills does not decode that step
        self.mixes_prefill_with_decode = semantics == "vllm"
        self.sched_cpu_s = 0.0 if self.async_scheduling else terms.sched_cpu_s
        #: what a step costs more without full CUDA graphs (every rank, once per step)
        self.graph_loss_s = terms.graph_loss_s
        self.attn_prefill_per_chunk_s = terms.attn_prefill_per_chunk_s
        self.attn_prefill_s_per_token2 = terms.attn_prefill_s_per_token2

        upto = self.max_step_tokens
        grid = terms.token_grid
        self._dense = _Curve(grid, terms.dense_s, upto)
        self._ar_extra = _Curve(grid, terms.allreduce_eager_extra_s, upto)
        self._lm_head = _Curve(grid, terms.lm_head_s, upto)
        moe_upto = self.dp_ranks * upto
        if terms.moe_s:
            self._moe = _Curve(terms.moe_grid, terms.moe_s[routing], moe_upto)
        else:
            self._moe = _Zero()
        self._gather = (
            _Curve(terms.moe_grid, terms.gather_s, moe_upto) if terms.gather_s else _Zero()
        )
        self._alltoall = self.layout.moe_comm == "alltoall"
        self._a2a_decode = _Curve(grid, terms.a2a_decode_s, upto) if self._alltoall else _Zero()
        self._a2a_prefill = _Curve(grid, terms.a2a_prefill_s, upto) if self._alltoall else _Zero()
        # Decode attention per rank: fixed[b] + per_ctx[b] * S (interpolated between the
        # fitted batch sizes; held constant past the largest).
        attn_grid = terms.attn_decode_batch_grid
        self._attn_fixed = _Curve(attn_grid, terms.attn_decode_fixed_s, self.max_batch)
        self._attn_per_ctx = array(
            "d",
            np.interp(
                np.arange(self.max_batch + 1),
                attn_grid,
                terms.attn_decode_per_ctx_token_s,
            ),
        )
        # Decode-only step of ranks padded to b sequences, attention's context part aside.
        self._decode_base = array("d", [0.0] * (self.max_batch + 1))
        for b in range(1, self.max_batch + 1):
            self._decode_base[b] = self._decode_fixed_s(b)

    # ---- decode ----------------------------------------------------------------------
    def _moe_part_s(self, total_tokens: float, max_rank_tokens: float, prefill: bool) -> float:
        return self._moe(total_tokens) + self._exchange_s(total_tokens, max_rank_tokens, prefill)

    def _exchange_s(self, total_tokens: float, max_rank_tokens: float, prefill: bool) -> float:
        """Moving MoE tokens between DP ranks: all-gather + reduce-scatter, or DeepEP."""
        if self._alltoall:
            a2a = self._a2a_prefill if prefill else self._a2a_decode
            return a2a(max_rank_tokens)
        return self._gather(total_tokens)

    def _decode_fixed_s(self, b: int) -> float:
        """Everything in a full-graph decode step of ``b`` (padded) sequences per rank
        except the context-proportional attention term."""
        return (
            self._dense(b)
            + self._lm_head(b)
            + self._attn_fixed(b)
            + self._moe_part_s(self.dp_ranks * b, b, prefill=False)
            + self.sched_cpu_s
        )

    def decode_epoch_terms(self, batch_max: int) -> tuple[float, float]:
        """``(base_s, per_ctx_token_s)`` of a decode-only step of ranks holding at most
        ``batch_max`` sequences: ``step = base_s + per_ctx_token_s * ctx_sum_max`` with
        ``ctx_sum_max`` the largest per-rank context sum. Exact when the rank with the most
        sequences also holds the most context; an upper bound otherwise."""
        b = int(batch_max)
        if b <= 0:
            return 0.0, 0.0
        if b > self.max_batch:
            raise ValueError(f"batch_max {b} exceeds the layout's max_batch {self.max_batch}")
        return self._decode_base[b], self._attn_per_ctx[b]

    def decode_step_s(self, batch_per_rank, ctx_sum_per_rank) -> float:
        """One decode-only step: ``batch_per_rank[i]`` sequences holding
        ``ctx_sum_per_rank[i]`` KV tokens on rank ``i`` (scalars for one rank)."""
        batches = _per_rank(batch_per_rank, self.dp_ranks, "batch_per_rank")
        ctxs = _per_rank(ctx_sum_per_rank, self.dp_ranks, "ctx_sum_per_rank")
        b_max = max(batches)
        if b_max <= 0:
            return 0.0
        if b_max > self.max_batch:
            raise ValueError(f"a rank holds {b_max} sequences, over max_batch {self.max_batch}")
        b_max = int(b_max)
        fixed, per_ctx = self._attn_fixed, self._attn_per_ctx
        top = fixed(b_max)
        attn = max(
            fixed(b) - top + per_ctx[int(b)] * s if b > 0 else 0.0
            for b, s in zip(batches, ctxs, strict=True)
        )
        return self._decode_base[b_max] + attn

    def decode_run_s(
        self,
        batch_max: int,
        ctx_sum_max: float,
        steps: int,
        ctx_growth_per_step: float | None = None,
    ) -> float:
        """Total time of ``steps`` decode-only steps of fixed batches, in closed form.

        The slowest rank's context sum grows by ``ctx_growth_per_step`` a step (default
        ``batch_max``: one token per sequence of the fullest rank).
        """
        k = int(steps)
        if k <= 0 or batch_max <= 0:
            return 0.0
        base, per_ctx = self.decode_epoch_terms(batch_max)
        growth = float(batch_max if ctx_growth_per_step is None else ctx_growth_per_step)
        return k * base + per_ctx * (k * ctx_sum_max + growth * k * (k - 1) / 2)

    # ---- steps with prefill ----------------------------------------------------------
    def step_s(
        self,
        batch_per_rank,
        ctx_sum_per_rank,
        prefill_tokens_per_rank=0,
        prefill_prior_per_rank=0,
    ) -> float:
        """One step of the engine; ``prefill_tokens_per_rank[i]`` new tokens are prefilled
        on rank ``i`` over ``prefill_prior_per_rank[i]`` tokens already in its KV cache.

        Equals ``decode_step_s`` when no rank prefills. Under SGLang semantics a rank that
        prefills does not decode in the same step (its batch is left out).
        """
        return self._step(
            batch_per_rank, ctx_sum_per_rank, prefill_tokens_per_rank, prefill_prior_per_rank, None
        )

    def step_breakdown(
        self,
        batch_per_rank,
        ctx_sum_per_rank,
        prefill_tokens_per_rank=0,
        prefill_prior_per_rank=0,
    ) -> dict:
        """The parts of ``step_s`` (seconds) and how the step ran (graph mode, padding)."""
        parts: dict = {}
        parts["step_s"] = self._step(
            batch_per_rank, ctx_sum_per_rank, prefill_tokens_per_rank, prefill_prior_per_rank, parts
        )
        return parts

    def decode_attention_s(self, batch: int, ctx_sum: float) -> float:
        """Attention of one rank decoding ``batch`` sequences holding ``ctx_sum`` KV
        tokens, every layer."""
        return self._attn_fixed(batch) + self._attn_per_ctx[int(batch)] * ctx_sum

    def prefill_attention_s(self, tokens: float, prior_tokens: float = 0) -> float:
        """Attention of one rank prefilling a ``tokens`` chunk over ``prior_tokens`` already
        in its KV cache, every layer."""
        return self.attn_prefill_per_chunk_s + self.attn_prefill_s_per_token2 * tokens * (
            prior_tokens + tokens / 2
        )

    def prefill_chunk_s(self, tokens: int, prior_tokens: int = 0) -> float:
        """A step in which one rank prefills ``tokens`` over ``prior_tokens`` and every
        other rank is idle (it still runs the MoE layers in lock-step)."""
        pre = [0] * self.dp_ranks
        prior = [0] * self.dp_ranks
        pre[0], prior[0] = tokens, prior_tokens
        zeros = [0] * self.dp_ranks
        return self._step(zeros, zeros, pre, prior, None)

    def _step(self, batch_per_rank, ctx_sum_per_rank, prefill_per_rank, prior_per_rank, detail):
        dp = self.dp_ranks
        pre = _per_rank(prefill_per_rank, dp, "prefill_tokens_per_rank")
        if max(pre) <= 0:
            step = self.decode_step_s(batch_per_rank, ctx_sum_per_rank)
            if detail is not None:
                b_max = max(_per_rank(batch_per_rank, dp, "batch_per_rank"))
                detail.update(
                    mode="full",
                    padded=True,
                    moe_tokens=dp * b_max,
                    moe_s=self._moe(dp * b_max),
                    exchange_s=self._exchange_s(dp * b_max, b_max, prefill=False),
                    device_s=step - self.sched_cpu_s if step else 0.0,
                    graph_loss_s=0.0,
                    sched_cpu_s=self.sched_cpu_s if step else 0.0,
                )
            return step
        batches = _per_rank(batch_per_rank, dp, "batch_per_rank")
        ctxs = _per_rank(ctx_sum_per_rank, dp, "ctx_sum_per_rank")
        prior = _per_rank(prior_per_rank, dp, "prefill_prior_per_rank")
        sglang = self.semantics == "sglang"
        if sglang:
            batches = [0 if n > 0 else b for b, n in zip(batches, pre, strict=True)]
            ctxs = [0 if n > 0 else s for s, n in zip(ctxs, pre, strict=True)]
        tokens = [b + n for b, n in zip(batches, pre, strict=True)]
        t_max = max(tokens)
        if t_max <= 0:
            return 0.0
        if t_max > self.max_step_tokens:
            raise ValueError(
                f"a rank runs {t_max} tokens in one step, over max_step_tokens "
                f"{self.max_step_tokens}"
            )
        # no graphs at all past the captured sizes (vLLM) or in SGLang's extend steps
        mode = "eager" if sglang or t_max > self.max_capture_tokens else "piecewise"
        pad = mode != "eager"
        rank_max = 0.0
        for b, s, n, p, t in zip(batches, ctxs, pre, prior, tokens, strict=True):
            m = t_max if pad else t
            rank = self._dense(m) + self._lm_head(b + (1 if n > 0 else 0))
            if mode == "eager":
                rank += self._ar_extra(m)
            if b > 0:
                rank += self.decode_attention_s(b, s)
            if n > 0:
                rank += self.prefill_attention_s(n, p)
            rank_max = max(rank_max, rank)
        total = dp * t_max if pad else sum(tokens)
        moe = self._moe_part_s(total, t_max, prefill=True)
        device = rank_max + moe
        step = device + self.graph_loss_s + self.sched_cpu_s
        if detail is not None:
            detail.update(
                mode=mode,
                padded=pad,
                moe_tokens=total,
                moe_s=self._moe(total),
                exchange_s=self._exchange_s(total, t_max, prefill=True),
                slowest_rank_s=rank_max,
                moe_and_comm_s=moe,
                device_s=device,
                graph_loss_s=self.graph_loss_s,
                sched_cpu_s=self.sched_cpu_s,
            )
        return step

    # ---- what policies need ----------------------------------------------------------
    def prefill_tokens_per_s_per_gpu(
        self, chunk_tokens: int | None = None, prior_tokens: int = 0
    ) -> float:
        """Prefill throughput per GPU with every rank prefilling ``chunk_tokens`` (default
        the step budget) over ``prior_tokens`` of cached context each step."""
        n = self.max_step_tokens if chunk_tokens is None else int(chunk_tokens)
        dp = self.dp_ranks
        step = self._step([0] * dp, [0] * dp, [n] * dp, [prior_tokens] * dp, None)
        return dp * n / step / self.gpus

    def decode_tokens_per_s_per_gpu(self, batch_per_rank: int, context_tokens: int) -> float:
        """Decode throughput per GPU with ``batch_per_rank`` sequences of
        ``context_tokens`` each on every rank (pure decode, full graphs)."""
        dp = self.dp_ranks
        b = int(batch_per_rank)
        if b * context_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"{b} x {context_tokens} KV tokens per rank exceed the rank's KV capacity "
                f"({self.kv_capacity_tokens:,} tokens at {self.layout.name})"
            )
        step = self.decode_step_s([b] * dp, [b * context_tokens] * dp)
        return dp * b / step / self.gpus

    def __repr__(self) -> str:
        return (
            f"LayoutCost({self.name!r}, semantics={self.semantics!r}, routing={self.routing!r}, "
            f"async_scheduling={self.async_scheduling})"
        )


def _per_rank(value, dp: int, label: str) -> list:
    """A scalar (for one rank, or 0 for all) or a sequence of ``dp`` non-negative numbers."""
    if isinstance(value, int | float | np.integer | np.floating):
        if value < 0:
            raise ValueError(f"{label} must be >= 0 (got {value})")
        if dp == 1 or value == 0:
            return [value] * dp
        raise ValueError(f"{label}: give one value per rank ({dp} ranks), not a scalar")
    values = list(value)
    if len(values) != dp:
        raise ValueError(f"{label}: expected {dp} values (one per rank), got {len(values)}")
    if min(values) < 0:
        raise ValueError(f"{label} must be >= 0 (got {min(values)})")
    return values
