"""Parallel layouts of one engine: tensor parallel x data-parallel attention x expert parallel.

An engine on ``tp * dp`` GPUs runs ``dp`` attention ranks (each ``tp``-way tensor
parallel, each with its own batch, scheduler and KV cache) that step in lock-step because
their MoE layers exchange tokens. The MoE layers are either expert parallel over all the
engine's GPUs (``ep == tp * dp``, each GPU holding ``num_experts / ep`` whole experts) or
tensor parallel over them (``ep == 1``), as vLLM does with and without
``--enable-expert-parallel``. Dense models only use ``dp == ep == 1``: a dense DP rank
never waits for another, so two of them are two engines, not one.

``moe_comm`` says how MoE tokens move between DP ranks: ``allgather`` (every GPU gathers
every rank's tokens, computes its experts' share, reduce-scatters the result; vLLM's
default ``allgather_reducescatter`` backend) or ``alltoall`` (DeepEP dispatch/combine,
tokens go only where their experts live).

Names: ``tp4``, ``tp2-ep2``, ``tp1-dp8-ep8``, ``tp1-dp8-ep8-a2a`` (all-to-all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost.hardware import HardwareSpec
from prorsa.runtime.sim.cost.models import BYTES_BF16, ModelArch
from prorsa.runtime.sim.cost.roofline import (
    GPU_MEMORY_UTILIZATION,
    MIN_KV_TOKENS,
    activation_reserve_bytes,
)

MOE_COMMS = ("allgather", "alltoall")
NODE_GPUS = 8  # the communication tables are measured inside one 8-GPU NVLink node
DEEPEP_GPUS = 8  # DeepEP rows: one node of 8 ranks
_NAME = re.compile(r"^tp(\d+)(?:-dp(\d+))?(?:-ep(\d+))?(-a2a)?$")


@dataclass(frozen=True)
class Layout:
    """How one engine splits a model over its GPUs."""

    tp: int = 1
    dp: int = 1
    ep: int = 1
    moe_comm: str = "allgather"

    def __post_init__(self) -> None:
        for attr in ("tp", "dp", "ep"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"layout: field '{attr}' must be an integer >= 1 (got {value!r})")
        if self.moe_comm not in MOE_COMMS:
            raise ConfigError(
                f"layout: field 'moe_comm' must be one of {', '.join(MOE_COMMS)} "
                f"(got {self.moe_comm!r})"
            )
        if self.ep not in (1, self.gpus):
            raise ConfigError(
                f"layout {self.name}: ep must be 1 (MoE tensor parallel) or tp*dp = {self.gpus}",
            )
        if self.moe_comm == "alltoall" and (self.dp == 1 or self.ep == 1):
            raise ConfigError(
                f"layout {self.name}: all-to-all moves tokens between DP ranks' experts; "
                "it needs dp > 1 and ep = tp*dp"
            )

    @property
    def gpus(self) -> int:
        """GPUs one engine of this layout occupies."""
        return self.tp * self.dp

    @property
    def moe_tp(self) -> int:
        """Tensor-parallel degree of the MoE layers (1 under expert parallelism)."""
        return 1 if self.ep > 1 else self.gpus

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.dp > 1:
            parts.append(f"dp{self.dp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        name = "-".join(parts)
        return name + "-a2a" if self.moe_comm == "alltoall" else name

    @classmethod
    def parse(cls, name: str) -> Layout:
        """``"tp1-dp8-ep8"`` -> ``Layout(tp=1, dp=8, ep=8)``."""
        match = _NAME.match(name)
        if not match:
            raise ConfigError(
                f"layout '{name}' is not a layout name",
                hint="tp<N>[-dp<N>][-ep<N>][-a2a], e.g. tp4, tp2-ep2, tp1-dp8-ep8",
            )
        tp, dp, ep, a2a = match.groups()
        return cls(
            tp=int(tp),
            dp=int(dp or 1),
            ep=int(ep or 1),
            moe_comm="alltoall" if a2a else "allgather",
        )

    def __str__(self) -> str:
        return self.name


# ---- memory ---------------------------------------------------------------------------
def weight_bytes_per_gpu(arch: ModelArch, layout: Layout) -> int:
    """Weights one GPU of the engine holds (bf16).

    Attention, norms' neighbours and the vocab-parallel embedding/lm_head are split
    ``tp`` ways inside each DP rank (every rank holds a full copy); experts are split
    ``ep`` ways (whole experts) or ``moe_tp`` ways (each expert sliced); the router is
    replicated.
    """
    tp = layout.tp
    per_layer = arch.attention_params_per_layer(tp) + arch.dense_mlp_params_per_layer(tp)
    if arch.is_moe:
        router = arch.num_experts * arch.hidden_size
        if layout.ep > 1:
            experts = -(-arch.num_experts // layout.ep) * arch.expert_params(1)
        else:
            experts = arch.num_experts * arch.expert_params(layout.moe_tp)
        per_layer += router + experts
    return BYTES_BF16 * (arch.num_layers * per_layer + arch.embedding_params(tp))


def kv_capacity_tokens_per_rank(
    arch: ModelArch,
    layout: Layout,
    hw: HardwareSpec,
    max_step_tokens: int = 8192,
    max_batch: int = 256,
) -> int:
    """KV tokens one DP rank holds: (HBM*0.9 - weights - activations) / KV bytes per token.

    The same memory model as the TP profiles (``roofline.kv_capacity_tokens``), with the
    layout's weights per GPU; the KV of a rank is split over its ``tp`` GPUs.
    """
    free = (
        hw.hbm_bytes * GPU_MEMORY_UTILIZATION
        - weight_bytes_per_gpu(arch, layout)
        - activation_reserve_bytes(arch, layout.tp, max_step_tokens, max_batch)
    )
    return int(free // arch.kv_bytes_per_token(layout.tp))


def check_layout(arch: ModelArch, layout: Layout) -> None:
    """Raise a ConfigError naming why ``layout`` cannot run ``arch`` (tables aside)."""
    if layout.gpus > NODE_GPUS:
        raise ConfigError(
            f"layout {layout.name} spans {layout.gpus} GPUs",
            hint=f"the communication tables cover one {NODE_GPUS}-GPU node; "
            "no inter-node measurements exist",
        )
    if not arch.is_moe and (layout.dp > 1 or layout.ep > 1):
        raise ConfigError(
            f"layout {layout.name}: '{arch.name}' is dense; data-parallel attention and "
            "expert parallelism only apply to MoE models",
            hint="a dense DP rank never waits for another: run dp engines of tp GPUs",
        )
    arch.check_tp(layout.tp)
    if arch.is_moe and layout.ep > 1 and arch.num_experts % layout.ep:
        raise ConfigError(f"layout {layout.name}: {arch.num_experts} experts do not split ep ways")
    if arch.is_moe and layout.ep == 1 and arch.moe_intermediate_size % layout.moe_tp:
        raise ConfigError(
            f"layout {layout.name}: expert width {arch.moe_intermediate_size} does not split "
            f"{layout.moe_tp} ways"
        )
    if layout.moe_comm == "alltoall" and (layout.gpus != DEEPEP_GPUS or layout.tp != 1):
        raise ConfigError(
            f"layout {layout.name}: the DeepEP tables are measured on {DEEPEP_GPUS} ranks, "
            "one attention rank per GPU",
            hint="use all-to-all only with tp=1, dp=8",
        )


def layout_fits(arch: ModelArch, layout: Layout, hw: HardwareSpec) -> bool:
    """Valid for the model and room for at least ``MIN_KV_TOKENS`` of KV per rank."""
    try:
        check_layout(arch, layout)
    except ConfigError:
        return False
    return kv_capacity_tokens_per_rank(arch, layout, hw) >= MIN_KV_TOKENS


def candidate_layouts(arch: ModelArch) -> list[Layout]:
    """Every layout of one node worth considering for ``arch`` (before table coverage).

    Dense: TP 1/2/4/8. MoE: TP x DP with tp*dp <= 8, MoE tensor or expert parallel,
    and all-to-all for DP8 with one GPU per rank (what the DeepEP tables measure).
    """
    degrees = (1, 2, 4, 8)
    if not arch.is_moe:
        return [Layout(tp=t) for t in degrees]
    out = []
    for tp in degrees:
        for dp in degrees:
            if tp * dp > NODE_GPUS:
                continue
            out.append(Layout(tp=tp, dp=dp, ep=1))
            if tp * dp > 1:
                out.append(Layout(tp=tp, dp=dp, ep=tp * dp))
            if dp == DEEPEP_GPUS:
                out.append(Layout(tp=tp, dp=dp, ep=tp * dp, moe_comm="alltoall"))
    return out
