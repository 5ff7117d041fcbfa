"""``LayoutTerms``: the measured cost terms of one engine layout, as stored in JSON.

Everything here is sampled from the H200 tables at fit time (``layout_fit.py``) and kept
as curves over token counts; ``LayoutCost`` (``layout_cost.py``) turns the curves into
per-token arrays and evaluates steps. All times are seconds summed over the model's
layers; token counts are per DP rank unless a name says otherwise.

Curves (``grid`` x-values, one list of seconds per curve):

* ``dense_s`` over ``token_grid``: one rank's non-expert GEMMs (QKV, O, router, dense MLP)
  at ``m`` = tokens, plus its ``tp``-way all-reduces replayed in a CUDA graph;
* ``allreduce_eager_extra_s`` over ``token_grid``: what those all-reduces cost more when
  called eagerly (piecewise or eager steps);
* ``lm_head_s`` over ``token_grid``: the vocab projection for that many sampled rows;
* ``moe_s[distribution]`` over ``moe_grid``: one GPU's fused-MoE layers when the MoE sees
  that many tokens (the gathered tokens of all ranks);
* ``gather_s`` over ``moe_grid``: all-gather + reduce-scatter of that many tokens' hidden
  states between the DP ranks (all-gather mode);
* ``a2a_decode_s`` / ``a2a_prefill_s`` over ``token_grid``: DeepEP low-latency / normal
  dispatch + combine at that many tokens per rank (all-to-all mode).

Decode attention of a rank with ``B`` sequences holding ``S`` KV tokens:
``attn_decode_fixed_s[B] + attn_decode_per_ctx_token_s[B] * S``, both curves over
``attn_decode_batch_grid`` (linear in ``S`` at a fixed batch; the per-token cost falls as
batches grow because larger batches fill the GPU better).

Scalars: prefill attention ``attn_prefill_per_chunk_s
+ attn_prefill_s_per_token2 * n * (p + n/2)`` per chunk; what a step costs more when it
runs without full CUDA graphs ``graph_loss_s``; per-step CPU scheduling ``sched_cpu_s``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from prorsa.errors import ConfigError
from prorsa.runtime.sim.cost.layout import Layout
from prorsa.runtime.sim.cost.moe_tables import DISTRIBUTIONS

_CURVES_ON_TOKEN_GRID = (
    "dense_s",
    "allreduce_eager_extra_s",
    "lm_head_s",
    "a2a_decode_s",
    "a2a_prefill_s",
)
_SCALARS = (
    "attn_prefill_per_chunk_s",
    "attn_prefill_s_per_token2",
    "graph_loss_s",
    "sched_cpu_s",
)


@dataclass(frozen=True)
class LayoutTerms:
    """Fitted terms of one (model, hardware, layout); see the module docstring."""

    name: str
    model: str
    hardware: str
    layout: str
    num_layers: int
    hidden_size: int
    kv_bytes_per_token: int
    kv_capacity_tokens_per_rank: int
    max_batch_per_rank: int
    max_step_tokens_per_rank: int
    max_capture_tokens: int
    token_grid: list
    dense_s: list
    allreduce_eager_extra_s: list
    lm_head_s: list
    attn_decode_batch_grid: list
    attn_decode_fixed_s: list
    attn_decode_per_ctx_token_s: list
    attn_prefill_per_chunk_s: float
    attn_prefill_s_per_token2: float
    graph_loss_s: float
    sched_cpu_s: float
    moe_grid: list = field(default_factory=list)
    moe_s: dict = field(default_factory=dict)
    gather_s: list = field(default_factory=list)
    a2a_decode_s: list = field(default_factory=list)
    a2a_prefill_s: list = field(default_factory=list)
    source: str = "aiconfigurator"
    provenance: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f"layout terms '{self.name}'"
        layout = Layout.parse(self.layout)  # raises on a bad name
        grid = self.token_grid
        _check_grid(grid, where, "token_grid")
        for curve in _CURVES_ON_TOKEN_GRID:
            values = getattr(self, curve)
            if values:
                _check_curve(values, len(grid), where, curve)
        for attr in _SCALARS:
            value = getattr(self, attr)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}: field '{attr}' must be a finite number >= 0")
        _check_grid(self.attn_decode_batch_grid, where, "attn_decode_batch_grid")
        for curve in ("attn_decode_fixed_s", "attn_decode_per_ctx_token_s"):
            _check_curve(getattr(self, curve), len(self.attn_decode_batch_grid), where, curve)
        if self.moe_s:
            _check_grid(self.moe_grid, where, "moe_grid")
            unknown = sorted(set(self.moe_s) - set(DISTRIBUTIONS))
            if unknown:
                raise ConfigError(f"{where}: field 'moe_s' has unknown distribution {unknown[0]!r}")
            for dist, values in self.moe_s.items():
                _check_curve(values, len(self.moe_grid), where, f"moe_s[{dist}]")
        if self.gather_s:
            _check_curve(self.gather_s, len(self.moe_grid), where, "gather_s")
        if layout.dp > 1 and layout.moe_comm == "allgather" and not self.gather_s:
            raise ConfigError(f"{where}: a DP layout in all-gather mode needs 'gather_s'")
        if layout.moe_comm == "alltoall" and not (self.a2a_decode_s and self.a2a_prefill_s):
            raise ConfigError(f"{where}: an all-to-all layout needs 'a2a_decode_s'/'a2a_prefill_s'")
        for attr in (
            "num_layers",
            "hidden_size",
            "kv_bytes_per_token",
            "kv_capacity_tokens_per_rank",
            "max_batch_per_rank",
            "max_step_tokens_per_rank",
            "max_capture_tokens",
        ):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{where}: field '{attr}' must be an integer >= 1 (got {value!r})"
                )

    @property
    def parsed_layout(self) -> Layout:
        return Layout.parse(self.layout)

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LayoutTerms:
        if not isinstance(d, dict):
            raise ConfigError(f"layout terms must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"layout terms '{d.get('name', '?')}': unknown field '{unknown[0]}'")
        for f in fields(cls):
            required = f.default is MISSING and f.default_factory is MISSING
            if required and f.name not in d:
                raise ConfigError(f"layout terms '{d.get('name', '?')}': missing field '{f.name}'")
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        """Write JSON: one line per curve, six significant digits per number."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_rounded(self.to_dict()), indent=1, sort_keys=True)
        path.write_text(_NUMBER_LIST.sub(lambda m: re.sub(r"\s+", " ", m.group(0)), text) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LayoutTerms:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data)


_NUMBER_LIST = re.compile(r"\[[-0-9.e+,\s]*\]")


def _rounded(value):
    """Floats to six significant digits (far below the tables' own noise)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _check_grid(grid, where: str, label: str) -> None:
    if not isinstance(grid, list) or len(grid) < 2:
        raise ConfigError(f"{where}: field '{label}' must be a list of at least 2 token counts")
    if any(not isinstance(x, int) or x < 1 for x in grid) or any(
        b <= a for a, b in itertools.pairwise(grid)
    ):
        raise ConfigError(f"{where}: field '{label}' must be strictly increasing integers >= 1")


def _check_curve(values, n: int, where: str, label: str) -> None:
    if not isinstance(values, list) or len(values) != n:
        raise ConfigError(f"{where}: field '{label}' must be a list of {n} seconds")
    for i, v in enumerate(values):
        if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{where}: field '{label}' entry {i} must be a finite number >= 0")
