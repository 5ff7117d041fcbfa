"""The models of the regime map and the layouts each may run (its layout family).

A family lists the layouts searched for colocation at its best layout and offered to the
planner and to best-static. Dense models run tensor parallel only; the MoE models add
data-parallel attention with expert parallelism (all-gather, and DeepEP all-to-all on one
8-GPU node). Layouts left out of a family are within a few percent of a kept one on every
role metric (``prorsa profile layouts``): ``tp2-ep2`` / ``tp4-ep4`` next to ``tp2`` /
``tp4``, DP without EP next to DP with EP, and the hybrid ``tp2-dp2-ep4`` / ``tp4-dp2-ep8``
of Qwen3-30B-A3B (never the best colocated layout in a scan of swe, search, math-tool,
mixed and tau2 at 4-64 trajectories per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from prorsa.errors import ConfigError


@dataclass(frozen=True)
class ModelFamily:
    """One model of the map, its layouts and its GPU budget."""

    name: str  # short name used in the map ("qwen3-30b-a3b")
    prefix: str  # layout-cost prefix ("h200-qwen3-30b-a3b")
    layouts: tuple[str, ...]  # the layout family
    gpus: int  # GPUs of every regime of this model
    baseline_layout: str  # colocation's "TP1 or the smallest TP that fits" reference
    moe: bool

    @property
    def profile(self) -> str:
        """A ``ClusterConfig.profile`` whose model prefix is this model's."""
        return f"{self.prefix}-{self.baseline_layout}"


FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily("qwen2.5-7b", "h200-qwen2.5-7b", ("tp1", "tp2", "tp4"), 16, "tp1", moe=False),
        ModelFamily(
            "qwen2.5-32b",
            "h200-qwen2.5-32b",
            ("tp1", "tp2", "tp4", "tp8"),
            16,
            "tp1",
            moe=False,
        ),
        ModelFamily(
            "qwen3-30b-a3b",
            "h200-qwen3-30b-a3b",
            ("tp1", "tp2", "tp4", "tp1-dp4-ep4", "tp1-dp8-ep8", "tp1-dp8-ep8-a2a"),
            32,
            "tp1",
            moe=True,
        ),
        ModelFamily(
            "qwen3-235b-a22b",
            "h200-qwen3-235b-a22b",
            ("tp4", "tp8", "tp2-dp2-ep4", "tp2-dp4-ep8", "tp1-dp8-ep8", "tp1-dp8-ep8-a2a"),
            32,
            "tp4",  # the smallest TP whose KV fits (235B needs 4 GPUs)
            moe=True,
        ),
    )
}


def get_family(name: str) -> ModelFamily:
    """The family called ``name`` (a key of :data:`FAMILIES`)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown model '{name}' for the regime map",
            hint=f"choose one of: {', '.join(FAMILIES)}",
        ) from None
