"""What each parallel layout of a model offers each role, as plain numbers.

A :class:`LayoutOption` summarises one layout's cost model at the operating point the
:class:`~prorsa.policy.base.ClusterSpec` quotes (prefill chunks of 2,048 tokens; decode
ranks half full at 8k context): prefill and decode tokens per second per GPU, and the
GPU-seconds a prefill token costs a colocated engine of that layout (its decoding batch
waits while one rank prefills). The layout planner (:mod:`prorsa.policy.layout_plan`)
chooses each role's layout from these options; :mod:`prorsa.runtime.cluster.spec` quotes
the same numbers to policies, through the same helpers below.

Layouts are fixed for a run: a role's layout is chosen before the run starts and
switching slots between roles never re-lays out a role.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.errors import ConfigError
from prorsa.policy.layout_plan import LayoutOption, WorkloadShape

#: Prefill chunk and context at which throughput is quoted (as the ClusterSpec does).
THROUGHPUT_CHUNK_TOKENS = 2048
THROUGHPUT_CONTEXT_TOKENS = 8192


# ---- helpers shared with the ClusterSpec (spec.py) ------------------------------------
@dataclass(frozen=True)
class OperatingPoint:
    """Where a layout's decode is evaluated: sequences per GPU and context per sequence.

    ``batch_per_gpu=None`` is the ClusterSpec's quote: ranks half full (``max_batch / 2``)
    at the quoted context, shortened if KV runs out. With a batch per GPU (a workload's
    live decode sequences), a rank of ``tp`` GPUs holds ``batch_per_gpu * tp`` sequences
    (at most ``max_batch``, and no more than its KV holds at this context).
    """

    batch_per_gpu: float | None = None
    context_tokens: int = THROUGHPUT_CONTEXT_TOKENS


QUOTED = OperatingPoint()


def typical_decode(cost, point: OperatingPoint = QUOTED) -> tuple[int, int]:
    """(sequences per rank, context per sequence) of ``cost`` at ``point``."""
    if point.batch_per_gpu is None:
        batch = max(cost.max_batch // 2, 1)
        context = min(point.context_tokens, cost.kv_capacity_tokens // batch)
        return batch, max(context, 1)
    return decode_batch(
        cost.tp, cost.max_batch, cost.kv_capacity_tokens, point.batch_per_gpu, point.context_tokens
    )


def decode_batch(
    tp: int, max_batch: int, kv_tokens: int, per_gpu: float, context_tokens: float
) -> tuple[int, int]:
    """(sequences, context per sequence) an engine (or rank) of ``tp`` GPUs decodes with
    ``per_gpu`` sequences per GPU waiting, held to ``max_batch`` sequences and
    ``kv_tokens`` KV tokens; the rest wait."""
    context = max(min(int(context_tokens), kv_tokens), 1)
    batch = min(max(round(per_gpu * tp), 1), max_batch, max(kv_tokens // context, 1))
    return batch, context


def decode_tokens_per_s_per_gpu(cost, point: OperatingPoint = QUOTED) -> float:
    """Decode throughput per GPU of a layout cost at ``point``."""
    batch, context = typical_decode(cost, point)
    return cost.decode_tokens_per_s_per_gpu(batch, context)


def prefill_tokens_per_s_per_gpu(cost) -> float:
    """Prefill throughput per GPU of a layout cost at the quoted chunk."""
    return cost.prefill_tokens_per_s_per_gpu(min(THROUGHPUT_CHUNK_TOKENS, cost.max_step_tokens))


def _chunked_step_s(cost, point: OperatingPoint, prefilling_ranks: int) -> tuple[float, float, int]:
    """(decode step, step with ``prefilling_ranks`` ranks each prefilling a chunk, chunk
    tokens) of ``cost``'s ranks loaded as at ``point``."""
    batch, context = typical_decode(cost, point)
    ranks = cost.dp_ranks
    if not 1 <= prefilling_ranks <= ranks:
        raise ConfigError(f"prefilling_ranks must be in 1..{ranks}, got {prefilling_ranks}")
    chunk = min(THROUGHPUT_CHUNK_TOKENS, cost.max_step_tokens - batch)
    batches, ctxs = [batch] * ranks, [batch * context] * ranks
    decode_s = cost.decode_step_s(batches, ctxs)
    chunks = [chunk] * prefilling_ranks + [0] * (ranks - prefilling_ranks)
    return decode_s, cost.step_s(batches, ctxs, chunks, [0] * ranks), chunk


def colocated_gpu_s_per_prefill_token(
    cost, point: OperatingPoint = QUOTED, prefilling_ranks: int = 1
) -> float:
    """GPU-seconds of a colocated engine one prefill token costs: the step of ranks
    loaded as at ``point`` with and without ``prefilling_ranks`` of them prefilling a
    chunk each, times the engine's GPUs, per prefilled token.

    With one rank prefilling, the others wait for it (lockstep MoE layers) and every rank
    loses its CUDA graph: a data-parallel engine pays several times the chunk's own work.
    With every rank prefilling in the same step that penalty is shared by all the chunks
    (Qwen3-235B-A22B tp1-dp8-ep8-a2a: 3.5x a prefill GPU's cost with one rank, 0.9x with
    all eight).
    """
    decode_s, mixed_s, chunk = _chunked_step_s(cost, point, prefilling_ranks)
    return (mixed_s - decode_s) * cost.gpus / (chunk * prefilling_ranks)


def colocated_packed_prefill_tokens_per_s_per_gpu(cost, point: OperatingPoint = QUOTED) -> float:
    """Prefill tokens/s per GPU a colocated engine carries when every rank prefills a
    chunk in every step (ranks loaded as at ``point``): the most its prefill can take."""
    _, mixed_s, chunk = _chunked_step_s(cost, point, cost.dp_ranks)
    return chunk * cost.dp_ranks / mixed_s / cost.gpus


# ---- the options of a model -----------------------------------------------------------
def layout_names(model_prefix: str) -> list[str]:
    """Layout names with fitted costs for ``model_prefix`` (``h200-qwen3-30b-a3b``),
    fewest GPUs first."""
    from prorsa.runtime.sim.cost.layout import Layout
    from prorsa.runtime.sim.cost.layout_registry import list_layout_costs

    head = f"{model_prefix}-"
    found = []
    for name in list_layout_costs():
        rest = name[len(head) :] if name.startswith(head) else ""
        if not rest.startswith("tp"):
            continue
        try:
            layout = Layout.parse(rest)
        except ConfigError:
            continue
        found.append(layout)
    found.sort(key=lambda lay: (lay.gpus, lay.tp, lay.dp, lay.ep, lay.moe_comm))
    return [lay.name for lay in found]


def layout_option(
    model_prefix: str,
    name: str,
    point: OperatingPoint = QUOTED,
    *,
    semantics: str = "vllm",
    routing: str = "balanced",
) -> LayoutOption:
    """The option of one layout, its cost model evaluated at ``point``."""
    from prorsa.runtime.sim.cost.layout_registry import get_layout_cost

    cost = get_layout_cost(f"{model_prefix}-{name}", semantics=semantics, routing=routing)
    return LayoutOption(
        name=name,
        gpus=int(cost.gpus),
        dp_ranks=int(cost.dp_ranks),
        prefill_tokens_per_s_per_gpu=float(prefill_tokens_per_s_per_gpu(cost)),
        decode_tokens_per_s_per_gpu=float(decode_tokens_per_s_per_gpu(cost, point)),
        colocated_gpu_s_per_prefill_token=float(colocated_gpu_s_per_prefill_token(cost, point)),
        kv_tokens_per_gpu=float(cost.kv_capacity_tokens * cost.dp_ranks / cost.gpus),
    )


def layout_options(
    model_prefix: str,
    names: list[str] | None = None,
    point: OperatingPoint = QUOTED,
    *,
    max_gpus: int | None = None,
    semantics: str = "vllm",
    routing: str = "balanced",
) -> list[LayoutOption]:
    """Options of ``model_prefix``'s layouts (all with fitted costs, or ``names``) at
    ``point``, those of at most ``max_gpus`` GPUs, fewest GPUs first."""
    available = layout_names(model_prefix)
    if not available:
        raise ConfigError(
            f"no layout costs for model '{model_prefix}'",
            hint="see `prorsa profile layouts`; give the profile's model prefix, "
            "e.g. h200-qwen3-30b-a3b",
        )
    chosen = available if names is None else list(names)
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise ConfigError(
            f"model '{model_prefix}' has no layout cost for {', '.join(unknown)}",
            hint=f"available: {', '.join(available)}",
        )
    options = [
        layout_option(model_prefix, n, point, semantics=semantics, routing=routing) for n in chosen
    ]
    if max_gpus is not None:
        options = [o for o in options if o.gpus <= max_gpus]
    return options


# ---- a workload's operating point ------------------------------------------------------
def _prefill_tokens_per_s_per_rank(cost) -> float:
    return prefill_tokens_per_s_per_gpu(cost) * cost.gpus / cost.dp_ranks


def operating_point(
    cost, shape: WorkloadShape, load_per_gpu: float, *, iterations: int = 40
) -> OperatingPoint:
    """Decode sequences per GPU a layout carries when every GPU hosts ``load_per_gpu``
    trajectories of ``shape``, solved self-consistently (Little's law).

    A trajectory lives ``tool_s + prefill_tokens / r + decode_tokens * step_s(b) /
    (1 - prefill_share_of_gpu)``: tools, its prefills at one rank's prefill rate ``r``,
    and its decode steps, which colocated prefills stretch. It decodes for the
    ``decode_tokens * step_s`` part of that life, so ``b = load * decode part / life``.
    A slower layout holds more sequences at once (larger, more efficient batches); the
    fixed point balances the two. Damped iteration; converges in a few dozen steps.
    """
    if load_per_gpu <= 0:
        raise ConfigError(f"load_per_gpu must be > 0, got {load_per_gpu}")
    dp = cost.dp_ranks
    context = max(min(int(shape.decode_context_tokens), cost.kv_capacity_tokens), 1)
    cap = min(cost.max_batch, max(cost.kv_capacity_tokens // context, 1))
    rate = _prefill_tokens_per_s_per_rank(cost)
    batch = load_per_gpu / 2
    for _ in range(iterations):
        per_rank = int(min(max(round(batch * cost.tp), 1), cap))
        step = cost.decode_step_s([per_rank] * dp, [per_rank * context] * dp)
        point = OperatingPoint(batch_per_gpu=per_rank / cost.tp, context_tokens=context)
        prefill_gpu_s = shape.prefill_tokens * colocated_gpu_s_per_prefill_token(cost, point)
        decode_s = shape.decode_tokens * step
        life = shape.tool_s + shape.prefill_tokens / rate + decode_s
        stall = min(load_per_gpu * prefill_gpu_s / life, 0.9)
        life += decode_s * stall / (1 - stall)
        target = load_per_gpu * decode_s / (1 - stall) / life
        batch = 0.5 * batch + 0.5 * target
    # Beyond what the ranks hold (batch or KV), trajectories wait: the batch is capped.
    batch = min(max(batch, 1.0 / cost.tp), cap / cost.tp)
    return OperatingPoint(batch_per_gpu=batch, context_tokens=context)


def workload_layout_options(
    model_prefix: str,
    shape: WorkloadShape,
    load_per_gpu: float,
    names: list[str] | None = None,
    *,
    max_gpus: int | None = None,
    semantics: str = "vllm",
    routing: str = "balanced",
) -> list[LayoutOption]:
    """Options of ``model_prefix``'s layouts, each at its own operating point for this
    workload and load (:func:`operating_point`)."""
    from prorsa.runtime.sim.cost.layout_registry import get_layout_cost

    options = []
    for option in layout_options(
        model_prefix, names, max_gpus=max_gpus, semantics=semantics, routing=routing
    ):
        name = f"{model_prefix}-{option.name}"
        cost = get_layout_cost(name, semantics=semantics, routing=routing)
        point = operating_point(cost, shape, load_per_gpu)
        options.append(
            layout_option(model_prefix, option.name, point, semantics=semantics, routing=routing)
        )
    return options
