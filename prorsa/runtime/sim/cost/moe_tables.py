"""The measured H200 fused-MoE table (AIConfigurator, vLLM 0.19) and how it is read.

``moe_vllm_0.19.0_moe_perf.parquet``: one fused-MoE layer (``fused_experts``: gate/up GEMM,
activation, down GEMM, top-k reduction) on one GPU, latency in milliseconds, by
``num_tokens``, ``hidden_size``, ``inter_size``, ``topk``, ``num_experts``,
``moe_tp_size``, ``moe_ep_size``, ``moe_dtype`` and routing ``distribution``.

What a row means (read from AIConfigurator's ``collector/vllm/collect_moe.py``): the GPU
holds ``num_experts / moe_ep_size`` experts, each ``inter_size / moe_tp_size`` wide, and
receives ``num_tokens`` hidden states routed over *all* experts; only the pairs that land
on its experts are computed. So ``num_tokens`` is the token count the MoE layer of one GPU
sees: every DP rank's tokens after an all-gather, or the global batch in all-to-all mode.
``balanced`` spreads pairs evenly; ``power_law_*`` draws per-expert loads from a power law
and moves the heaviest expert-parallel block onto the measured GPU, so those rows are the
*slowest* GPU of the group — the one a lock-stepped step waits for.

Lookup: linear in tokens between the measured counts (1 .. 16,384); past the largest,
extrapolated along the slope of the last two points (compute bound). 0 tokens cost 0.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.io import file_sha256
from prorsa.runtime.sim.cost.kernel_tables import TABLE_DIR_NAME, default_table_dir

MOE_FILE = "moe_vllm_0.19.0_moe_perf.parquet"
DISTRIBUTIONS = ("balanced", "power_law_1.01", "power_law_1.2")
UPSTREAM = (
    "ai-dynamo/aiconfigurator, aic-core/src/aiconfigurator_core/systems/data/h200_sxm/moe/"
    "vllm/0.19.0/moe_perf.parquet (Apache-2.0)"
)
_MS = 1e-3


class MoETable:
    """Fused-MoE latencies indexed by shape and parallel split; lookups return seconds."""

    def __init__(self, data_dir: str | Path) -> None:
        import pandas as pd

        self.data_dir = Path(data_dir)
        path = self.data_dir / MOE_FILE
        if not path.is_file():
            raise ConfigError(
                f"MoE kernel table missing: {path}",
                hint="pass --data pointing at shared/data/profiles/" + TABLE_DIR_NAME,
            )
        self.files = {MOE_FILE: {"sha256": file_sha256(path)}}
        df = pd.read_parquet(path)
        keys = [
            "hidden_size",
            "inter_size",
            "topk",
            "num_experts",
            "moe_tp_size",
            "moe_ep_size",
            "moe_dtype",
            "distribution",
        ]
        self._series: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for key, part in df.groupby(keys):
            # vLLM 0.19.0 and 0.19.1 rows are duplicates of one shape: average them
            mean = part.groupby("num_tokens").latency.mean()
            self._series[tuple(key)] = (mean.index.to_numpy(dtype=float), mean.to_numpy() * _MS)
        self.files[MOE_FILE]["rows_used"] = len(df)

    def splits(self, hidden: int, inter: int, topk: int, experts: int, dtype: str = "bfloat16"):
        """The measured ``(moe_tp, moe_ep)`` pairs for one model shape."""
        return sorted(
            {
                (k[4], k[5])
                for k in self._series
                if k[:4] == (hidden, inter, topk, experts) and k[6] == dtype
            }
        )

    def moe_s(
        self,
        tokens: float,
        *,
        hidden: int,
        inter: int,
        topk: int,
        experts: int,
        moe_tp: int = 1,
        moe_ep: int = 1,
        distribution: str = "balanced",
        dtype: str = "bfloat16",
    ) -> float:
        """One MoE layer on one GPU that sees ``tokens`` tokens (seconds)."""
        if distribution not in DISTRIBUTIONS:
            raise ConfigError(
                f"unknown routing distribution '{distribution}'",
                hint=f"choose one of: {', '.join(DISTRIBUTIONS)}",
            )
        if tokens <= 0:
            return 0.0
        key = (hidden, inter, topk, experts, moe_tp, moe_ep, dtype, distribution)
        if key not in self._series:
            raise ConfigError(
                f"no MoE table rows for hidden {hidden}, inter {inter}, top-{topk} of "
                f"{experts} experts at moe_tp={moe_tp}, moe_ep={moe_ep} ({dtype})",
                hint="measured (moe_tp, moe_ep): "
                + ", ".join(map(str, self.splits(hidden, inter, topk, experts, dtype))),
            )
        counts, seconds = self._series[key]
        if tokens <= counts[-1]:
            return float(np.interp(tokens, counts, seconds))
        slope = (seconds[-1] - seconds[-2]) / (counts[-1] - counts[-2])
        return float(seconds[-1] + max(slope, 0.0) * (tokens - counts[-1]))

    def describe(self) -> dict:
        return {
            "data_dir_name": TABLE_DIR_NAME,
            "upstream": UPSTREAM,
            "files": self.files,
            "device": "NVIDIA H200 SXM, vLLM 0.19 fused_experts (Triton), one GPU",
        }


@lru_cache(maxsize=4)
def load_moe_table(data_dir: str | None = None) -> MoETable:
    """Load (once per directory) the MoE table; default ``default_table_dir()``."""
    return MoETable(Path(data_dir) if data_dir else default_table_dir())
