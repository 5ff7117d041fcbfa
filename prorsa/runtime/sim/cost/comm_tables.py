"""Measured H200 communication tables (AIConfigurator) and how they are read.

Four parquet files in ``shared/data/profiles/aiconfigurator-h200-vllm-0.19``:

* vLLM custom all-reduce (vLLM 0.19), bf16, 2/4/8 GPUs, ``message_size`` in elements,
  once replayed inside a CUDA graph (``vllm_graph``) and once called eagerly from Python
  (``vllm_eager``, back to back, so host-bound for small messages: ~21 us a call against
  ~4.5 us of device time in a graph).
* NCCL 2.29.2 ``all_gather``, ``reduce_scatter``, ``alltoall``, ``all_reduce`` (nccl-tests,
  out-of-place time), ``message_size`` = the whole buffer in half-precision elements.
* DeepEP dispatch/combine on one 8-GPU node under SGLang 0.5.12: low-latency mode (decode,
  up to 1,024 tokens per rank) and normal mode (prefill; we read the 24-SM rows, DeepEP's
  default SM budget), ``num_token`` per rank, times in microseconds.

Lookups interpolate log-log in message size between measured points, hold the smallest
measurement below the grid (latency floor) and extrapolate in proportion to size past the
largest (bandwidth bound). Every lookup returns seconds.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.io import file_sha256
from prorsa.runtime.sim.cost.kernel_tables import TABLE_DIR_NAME, default_table_dir

ALLREDUCE_FILE = "custom_allreduce_vllm_0.19.0_perf.parquet"
NCCL_FILE = "nccl_2.29.2_perf.parquet"
DEEPEP_LL_FILE = "deepep_ll_sglang_0.5.12_perf.parquet"
DEEPEP_NORMAL_FILE = "deepep_normal_sglang_0.5.12_perf.parquet"
NCCL_OPS = ("all_gather", "reduce_scatter", "alltoall", "all_reduce")
DEEPEP_NORMAL_SMS = 24  # DeepEP's default SM budget for normal-mode kernels
UPSTREAM = (
    "ai-dynamo/aiconfigurator, aic-core/src/aiconfigurator_core/systems/data/h200_sxm/comm/"
    "{vllm/0.19.0, nccl/2.29.2, sglang/0.5.12} (Apache-2.0)"
)
_MS, _US = 1e-3, 1e-6


def _size_lookup(sizes: np.ndarray, seconds: np.ndarray, size: float) -> float:
    """Log-log interpolation in message size; floor below, proportional above."""
    if size <= 0:
        return 0.0
    if size <= sizes[0]:
        return float(seconds[0])
    if size >= sizes[-1]:
        return float(seconds[-1] * size / sizes[-1])
    return float(np.exp(np.interp(math.log(size), np.log(sizes), np.log(seconds))))


def _token_lookup(tokens: np.ndarray, seconds: np.ndarray, n: float) -> float:
    """Linear in tokens per rank; the smallest measurement below, proportional above."""
    if n <= 0:
        return 0.0
    if n >= tokens[-1]:
        return float(seconds[-1] * n / tokens[-1])
    return float(np.interp(n, tokens, seconds))


def _gpu_key(num_gpus: int, available: list[int], what: str) -> int:
    """The measured GPU count to use: the exact one, else the next larger (conservative)."""
    larger = [g for g in available if g >= num_gpus]
    if not larger:
        raise ConfigError(
            f"no {what} measurement for {num_gpus} GPUs",
            hint=f"the tables cover {', '.join(map(str, available))} GPUs (one node)",
        )
    return larger[0]


class CommTables:
    """The communication tables indexed for lookups."""

    def __init__(self, data_dir: str | Path) -> None:
        import pandas as pd  # only needed when (re)fitting

        self.data_dir = Path(data_dir)
        names = (ALLREDUCE_FILE, NCCL_FILE, DEEPEP_LL_FILE, DEEPEP_NORMAL_FILE)
        paths = {name: self.data_dir / name for name in names}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise ConfigError(
                f"communication table missing: {missing[0]}",
                hint="pass --data pointing at shared/data/profiles/" + TABLE_DIR_NAME,
            )
        self.files = {name: {"sha256": file_sha256(p)} for name, p in paths.items()}

        ar = pd.read_parquet(paths[ALLREDUCE_FILE])
        self._allreduce = {}
        for (gpus, backend), part in ar.groupby(["num_gpus", "backend"]):
            mean = part.groupby("message_size").latency.mean()
            self._allreduce[(int(gpus), str(backend))] = (
                mean.index.to_numpy(dtype=float),
                mean.to_numpy() * _MS,
            )
        self.files[ALLREDUCE_FILE]["rows_used"] = len(ar)

        nccl = pd.read_parquet(paths[NCCL_FILE])
        nccl = nccl[nccl.nccl_dtype == "half"]
        self._nccl = {}
        for (op, gpus), part in nccl.groupby(["op_name", "num_gpus"]):
            mean = part.groupby("message_size").latency.mean()
            self._nccl[(str(op), int(gpus))] = (
                mean.index.to_numpy(dtype=float),
                mean.to_numpy() * _MS,
            )
        self.files[NCCL_FILE]["rows_used"] = len(nccl)

        ll = pd.read_parquet(paths[DEEPEP_LL_FILE])
        self._ll = {}
        for key, part in ll.groupby(["hidden_size", "num_topk", "num_experts"]):
            part = part.sort_values("num_token")
            self._ll[tuple(int(k) for k in key)] = (
                part.num_token.to_numpy(dtype=float),
                part.dispatch_avg_t_us.to_numpy() * _US,
                part.combine_avg_t_us.to_numpy() * _US,
            )
        self.files[DEEPEP_LL_FILE]["rows_used"] = len(ll)

        normal = pd.read_parquet(paths[DEEPEP_NORMAL_FILE])
        normal = normal[
            (normal.dispatch_sms == DEEPEP_NORMAL_SMS) & (normal.combine_sms == DEEPEP_NORMAL_SMS)
        ]
        self._normal = {}
        for key, part in normal.groupby(["hidden_size", "num_topk", "num_experts"]):
            mean = part.groupby("num_token")[["dispatch_transmit_us", "combine_transmit_us"]].mean()
            self._normal[tuple(int(k) for k in key)] = (
                mean.index.to_numpy(dtype=float),
                mean.dispatch_transmit_us.to_numpy() * _US,
                mean.combine_transmit_us.to_numpy() * _US,
            )
        self.files[DEEPEP_NORMAL_FILE]["rows_used"] = len(normal)

    # ---- all-reduce ------------------------------------------------------------------
    def allreduce_s(self, elements: float, num_gpus: int, *, graph: bool = True) -> float:
        """vLLM custom all-reduce of ``elements`` bf16 values across ``num_gpus`` GPUs.

        ``graph=True``: replayed inside a CUDA graph (device time); ``False``: called
        eagerly from Python (host dispatch included). 0 for one GPU.
        """
        if num_gpus <= 1 or elements <= 0:
            return 0.0
        backend = "vllm_graph" if graph else "vllm_eager"
        gpus = _gpu_key(num_gpus, sorted({g for g, _ in self._allreduce}), "all-reduce")
        sizes, seconds = self._allreduce[(gpus, backend)]
        return _size_lookup(sizes, seconds, elements)

    def allreduce_eager_overhead_s(self, num_gpus: int = 2) -> float:
        """Eager minus graph time of the smallest all-reduce: the host cost of one op
        dispatched from Python instead of replayed from a graph."""
        gpus = _gpu_key(max(num_gpus, 2), sorted({g for g, _ in self._allreduce}), "all-reduce")
        return float(
            self._allreduce[(gpus, "vllm_eager")][1][0]
            - self._allreduce[(gpus, "vllm_graph")][1][0]
        )

    # ---- NCCL ------------------------------------------------------------------------
    def nccl_s(self, op: str, elements: float, num_gpus: int) -> float:
        """NCCL collective ``op`` over a ``elements``-element (half) buffer on ``num_gpus``."""
        if op not in NCCL_OPS:
            raise ConfigError(f"unknown NCCL op '{op}'", hint=f"choose one of: {NCCL_OPS}")
        if num_gpus <= 1 or elements <= 0:
            return 0.0
        gpus = _gpu_key(num_gpus, sorted({g for o, g in self._nccl if o == op}), f"NCCL {op}")
        sizes, seconds = self._nccl[(op, gpus)]
        return _size_lookup(sizes, seconds, elements)

    # ---- DeepEP ----------------------------------------------------------------------
    def _deepep(self, table: dict, mode: str, hidden: int, topk: int, experts: int):
        key = (hidden, topk, experts)
        if key not in table:
            raise ConfigError(
                f"no DeepEP {mode} rows for hidden {hidden}, top-{topk} of {experts} experts",
                hint="measured shapes: " + ", ".join(f"{k}" for k in sorted(table)),
            )
        return table[key]

    def deepep_low_latency_s(
        self, tokens_per_rank: float, hidden: int, topk: int, experts: int
    ) -> tuple[float, float]:
        """(dispatch, combine) seconds of DeepEP low-latency mode (decode) per layer."""
        tokens, dispatch, combine = self._deepep(self._ll, "low-latency", hidden, topk, experts)
        return (
            _token_lookup(tokens, dispatch, tokens_per_rank),
            _token_lookup(tokens, combine, tokens_per_rank),
        )

    def deepep_normal_s(
        self, tokens_per_rank: float, hidden: int, topk: int, experts: int
    ) -> tuple[float, float]:
        """(dispatch, combine) seconds of DeepEP normal mode (prefill), 24 SMs, per layer."""
        tokens, dispatch, combine = self._deepep(self._normal, "normal", hidden, topk, experts)
        return (
            _token_lookup(tokens, dispatch, tokens_per_rank),
            _token_lookup(tokens, combine, tokens_per_rank),
        )

    def describe(self) -> dict:
        """Provenance: where the tables came from and which rows were used."""
        return {
            "data_dir_name": TABLE_DIR_NAME,
            "upstream": UPSTREAM,
            "files": self.files,
            "device": "NVIDIA H200 SXM, one 8-GPU NVLink node",
        }


@lru_cache(maxsize=4)
def load_comm_tables(data_dir: str | None = None) -> CommTables:
    """Load (once per directory) the communication tables; default ``default_table_dir()``."""
    return CommTables(Path(data_dir) if data_dir else default_table_dir())
