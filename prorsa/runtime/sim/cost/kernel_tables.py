"""The measured H200 kernel tables (AIConfigurator, vLLM 0.19) and how they are read.

Three parquet files, latencies in milliseconds, one NVIDIA H200 SXM, bf16:

* GEMM by ``(m, n, k)``: a full grid (74 m x 22 n x 22 k values; only n = k = 65536 is
  missing). ``m`` is interpolated linearly between measured values. Off-grid ``n``/``k``
  are scaled from the nearest measured shape at or below them by ``n*k / (n0*k0)``
  (work and weight bytes both grow with ``n*k``). Linear interpolation in ``n``/``k``
  was also tried; it reproduces the published sums slightly worse (9 % vs 8 % worst case).
* context (prefill) attention by heads, KV heads, sequence length and batch; batch 1
  is used (one sequence). Interpolated in sqrt(latency) along the sequence (latency grows
  ~ s^2), linearly across head counts, quadratically past 16k tokens.
* generation (decode) attention by heads, KV heads, batch and ``step`` (context = step
  + 1, as AIConfigurator reads it). Linear in batch and context; past the measured
  batch-x-context frontier, proportional to batch (decode attention is a KV-read stream).

Rows: ``head_dim`` as asked, ``window_size == 0``, ``kv_cache_dtype == bfloat16``; the
vLLM 0.19.0 and 0.19.1 duplicates are averaged. The GQA context-attention rows
(``num_key_value_heads < num_heads``) run faster than the bf16 tensor-core peak allows
for their query-head count (32 q / 8 kv heads at 16k tokens: 0.85 ms against a 2.2 ms
compute bound), so every attention lookup is floored: prefill at its causal FLOPs run at
what FlashAttention-3 (vLLM's prefill kernel on Hopper) reaches at that sequence length
(``FA3_TFLOPS_H100``, 43-63 % of peak), decode at its KV bytes read at 4.8 TB/s.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.io import file_sha256
from prorsa.runtime.sim.cost.hardware import get_hardware

GEMM_FILE = "gemm_vllm_0.19.0_gemm_perf.parquet"
CONTEXT_FILE = "attention_vllm_0.19.0_context_attention_perf.parquet"
GENERATION_FILE = "attention_vllm_0.19.0_generation_attention_perf.parquet"
TABLE_DIR_NAME = "aiconfigurator-h200-vllm-0.19"
# FlashAttention-3 forward, bf16, head dim 128, on H100 SXM (989.4 dense TFLOP/s, the same
# tensor cores and clocks as H200): TFLOP/s by sequence length, batch x seqlen = 16k
# tokens, 16 heads (pytorch/benchmark PR #2391, flash_v3 column). The FA3 paper (Shah et
# al. 2024) gives the same range (up to 740 TFLOP/s, 75 %) and FA2 at 35 % of peak; our
# H200 calibration (benchmarks/gpu_calibration.py) measured PyTorch's FA2-class kernel
# on these models' prefill shapes at 333 TFLOP/s (34 %), which matches the paper's FA2.
FA3_SEQLEN = (512, 1024, 2048, 4096, 8192, 16384)
FA3_TFLOPS_H100 = (430.3, 517.1, 565.5, 590.2, 614.2, 620.7)
H100_BF16_DENSE_FLOPS = 989.4e12


def causal_attention_flops(heads: int, head_dim: int, tokens: float) -> float:
    """FLOPs of causal prefill attention over ``tokens``, one layer: 2 (FMA) x 2 (QK^T and
    PV) x heads x head_dim x tokens^2 / 2."""
    return 2 * heads * head_dim * tokens**2


def attention_prefill_efficiency(tokens: float) -> float:
    """Fraction of the bf16 tensor-core peak FlashAttention-3 reaches on a ``tokens``-long
    prefill (flat beyond the measured lengths)."""
    tflops = float(np.interp(tokens, FA3_SEQLEN, FA3_TFLOPS_H100))
    return tflops * 1e12 / H100_BF16_DENSE_FLOPS


UPSTREAM = (
    "ai-dynamo/aiconfigurator, aic-core/src/aiconfigurator_core/systems/data/h200_sxm/"
    "{gemm,attention}/vllm/0.19.0/ (Apache-2.0)"
)
_MS = 1e-3


def repo_root() -> Path:
    """The checkout this package lives in (``prorsa/runtime/sim/cost`` is 4 levels down)."""
    return Path(__file__).resolve().parents[4]


def default_table_dir() -> Path:
    """``../shared/data/profiles/aiconfigurator-h200-vllm-0.19`` beside the checkout."""
    return repo_root().parent / "shared" / "data" / "profiles" / TABLE_DIR_NAME


class KernelTables:
    """The three tables indexed for interpolation; every lookup returns seconds."""

    def __init__(self, data_dir: str | Path) -> None:
        import pandas as pd  # heavy-ish; only needed when refitting

        self.data_dir = Path(data_dir)
        paths = {name: self.data_dir / name for name in (GEMM_FILE, CONTEXT_FILE, GENERATION_FILE)}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            raise ConfigError(
                f"kernel table missing: {missing[0]}",
                hint="pass --data pointing at shared/data/profiles/" + TABLE_DIR_NAME,
            )
        self.files = {name: {"sha256": file_sha256(p)} for name, p in paths.items()}
        self.hardware = get_hardware("h200")

        gemm = pd.read_parquet(paths[GEMM_FILE])
        gemm = gemm[gemm.gemm_dtype == "bfloat16"]
        self.files[GEMM_FILE]["rows_used"] = len(gemm)
        self._ms = np.sort(gemm.m.unique()).astype(float)
        self._ns = np.sort(gemm.n.unique())
        self._ks = np.sort(gemm.k.unique())
        cube = np.full((len(self._ms), len(self._ns), len(self._ks)), np.nan)
        mean = gemm.groupby(["m", "n", "k"]).latency.mean()
        mi = np.searchsorted(self._ms, mean.index.get_level_values(0))
        ni = np.searchsorted(self._ns, mean.index.get_level_values(1))
        ki = np.searchsorted(self._ks, mean.index.get_level_values(2))
        cube[mi, ni, ki] = mean.to_numpy()
        self._gemm = cube

        self._ctx_series, self._ctx_groups = self._index_context(
            pd.read_parquet(paths[CONTEXT_FILE])
        )
        self._gen_columns, self._gen_groups = self._index_generation(
            pd.read_parquet(paths[GENERATION_FILE])
        )

    def _usable(self, df, name: str):
        df = df[(df.window_size == 0) & (df.kv_cache_dtype == "bfloat16")]
        self.files[name]["rows_used"] = len(df)
        return df

    def _index_context(self, df):
        df = self._usable(df, CONTEXT_FILE)
        df = df[df.batch_size == 1]  # one sequence per prefill
        series, groups = {}, {}
        for (hd, n, kv), part in df.groupby(["head_dim", "num_heads", "num_key_value_heads"]):
            by_len = part.groupby("isl").latency.mean()
            series[(hd, n, kv)] = (by_len.index.to_numpy(dtype=float), by_len.to_numpy())
            groups.setdefault((hd, 0 if n == kv else kv), []).append(n)
        return series, {key: sorted(v) for key, v in groups.items()}

    def _index_generation(self, df):
        df = self._usable(df, GENERATION_FILE)
        columns, groups = {}, {}
        for (hd, n, kv), part in df.groupby(["head_dim", "num_heads", "num_key_value_heads"]):
            mean = part.groupby(["step", "batch_size"]).latency.mean()
            per_ctx = {}
            for step, rows in mean.groupby(level=0):
                b = rows.index.get_level_values(1).to_numpy(dtype=float)
                per_ctx[float(step + 1)] = (b, rows.to_numpy())
            contexts = np.array(sorted(per_ctx))
            columns[(hd, n, kv)] = (contexts, [per_ctx[c] for c in contexts])
            groups.setdefault((hd, kv), []).append(n)
        return columns, {key: sorted(v) for key, v in groups.items()}

    # ---- GEMM -------------------------------------------------------------------------
    def gemm_s(self, m: float, n: int, k: int) -> float:
        """Latency of one bf16 ``(m x k) @ (k x n)`` GEMM."""
        if m <= 0:
            return 0.0
        i_n = max(int(np.searchsorted(self._ns, n, side="right")) - 1, 0)
        i_k = max(int(np.searchsorted(self._ks, k, side="right")) - 1, 0)
        col = self._gemm[:, i_n, i_k]
        while np.isnan(col).any() and i_k > 0:  # only n = k = 65536 is unmeasured
            i_k -= 1
            col = self._gemm[:, i_n, i_k]
        if m <= self._ms[-1]:
            lat = float(np.interp(m, self._ms, col))
        else:
            lat = float(col[-1]) * m / self._ms[-1]
        scale = (n * k) / (float(self._ns[i_n]) * float(self._ks[i_k]))
        return lat * scale * _MS

    # ---- attention ------------------------------------------------------------------
    @staticmethod
    def _neighbours(group: list[int] | None, heads: int, what: str) -> list[tuple[int, float]]:
        """The measured head counts around ``heads`` with linear weights (clamped)."""
        if not group:
            raise ConfigError(
                f"no {what} attention rows for this head layout",
                hint="the kernel tables cover KV heads 1, 2, 4, 8 and MHA, head_dim 64/128",
            )
        h = min(max(heads, group[0]), group[-1])
        i = int(np.searchsorted(group, h))
        if group[i] == h:
            return [(group[i], 1.0)]
        lo, hi = group[i - 1], group[i]
        w = (h - lo) / (hi - lo)
        return [(lo, 1 - w), (hi, w)]

    def context_attention_s(
        self, heads: int, kv_heads: int, tokens: float, head_dim: int = 128
    ) -> float:
        """Prefill attention of one ``tokens``-long sequence (no cached prefix), one layer:
        the table's value, floored at the causal FLOPs run at FlashAttention-3's rate."""
        if tokens <= 0:
            return 0.0
        # at the rate FA3 reaches (the table's long rows imply several times the peak)
        rate = self.hardware.bf16_dense_flops * attention_prefill_efficiency(tokens)
        compute_bound = causal_attention_flops(heads, head_dim, tokens) / rate
        return max(self.context_attention_table_s(heads, kv_heads, tokens, head_dim), compute_bound)

    def context_attention_table_s(
        self, heads: int, kv_heads: int, tokens: float, head_dim: int = 128
    ) -> float:
        """The context-attention table (interpolated), one layer, floored only at the
        causal FLOPs run at the tensor-core peak (how the published sums read it)."""
        if tokens <= 0:
            return 0.0
        mha = heads == kv_heads
        group = self._ctx_groups.get((head_dim, 0 if mha else kv_heads))
        total = 0.0
        for h, w in self._neighbours(group, heads, "context"):
            s_grid, lat = self._ctx_series[(head_dim, h, h if mha else kv_heads)]
            if tokens > s_grid[-1]:
                value = lat[-1] * (tokens / s_grid[-1]) ** 2
            else:
                value = float(np.interp(tokens, s_grid, np.sqrt(lat))) ** 2
            total += w * value
        peak_bound = (
            causal_attention_flops(heads, head_dim, tokens) / self.hardware.bf16_dense_flops
        )
        return max(total * _MS, peak_bound)

    def generation_attention_s(
        self, heads: int, kv_heads: int, batch: float, context: float, head_dim: int = 128
    ) -> float:
        """Decode attention of ``batch`` sequences of ``context`` tokens each, one layer."""
        if batch <= 0:
            return 0.0
        group = self._gen_groups.get((head_dim, kv_heads))
        total = 0.0
        for h, w in self._neighbours(group, heads, "generation"):
            contexts, rows = self._gen_columns[(head_dim, h, kv_heads)]
            total += w * _decode_lookup(contexts, rows, batch, max(context, 1.0))
        kv_bytes = batch * context * 2 * kv_heads * head_dim * 2
        return max(total * _MS, kv_bytes / self.hardware.hbm_bandwidth_bytes_per_s)

    def describe(self) -> dict:
        """Provenance: where the tables came from and which rows were used."""
        return {
            "data_dir_name": TABLE_DIR_NAME,
            "upstream": UPSTREAM,
            "files": self.files,
            "device": "NVIDIA H200 SXM, vLLM 0.19, bf16 GEMMs and bf16 KV cache",
        }


def _decode_lookup(contexts: np.ndarray, rows: list, batch: float, context: float) -> float:
    """Linear in batch and context; past the measured batch (the tables stop near
    batch x context = 256k tokens), proportional to batch: decode attention streams each
    sequence's KV independently. Past the longest context, proportional to context."""

    def at_batch(i: int) -> float:
        b, lat = rows[i]
        if batch > b[-1]:
            return float(lat[-1] * batch / b[-1])
        return float(np.interp(batch, b, lat))

    if context >= contexts[-1]:
        return at_batch(len(contexts) - 1) * context / contexts[-1]
    if context <= contexts[0]:
        return at_batch(0)
    i = int(np.searchsorted(contexts, context))
    w = (context - contexts[i - 1]) / (contexts[i] - contexts[i - 1])
    return (1 - w) * at_batch(i - 1) + w * at_batch(i)


@lru_cache(maxsize=4)
def load_kernel_tables(data_dir: str | None = None) -> KernelTables:
    """Load (once per directory) the kernel tables; default ``default_table_dir()``."""
    return KernelTables(Path(data_dir) if data_dir else default_table_dir())
