"""``oracle``: the upper bound every forecaster and policy is measured against.

It reads the future, so it works on simulations only:

* **from telemetry** (``attach(table)``, what backtests do): the forecast at tick ``t`` is
  the target computed from the run's own future events — exact by construction. Telemetry
  whose schema metadata lacks ``prorsa.source=simulator`` is refused.
* **inside a running simulation** (``attach_truth(port)``, what the provider adapter
  does): the future events do not exist yet, so it reads the ground-truth specs of the
  live trajectories from a :class:`~prorsa.workload.truth.GroundTruth` port
  (``port.spec(trajectory_id)``): each turn's exact output tokens, the exact tool time
  and the next turn's exact new tokens, and whether another turn follows. These
  go through the same closed forms as ``lightgbm-trajectory`` with near-zero spread. What
  it does *not* know: decode speed and queueing ahead (it uses the recent per-sequence
  decode rate and time to first token, like everyone), tokens already decoded in a running
  decode (estimated from elapsed time, like everyone), and trajectories not yet started.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import ConfigError, InputError
from prorsa.forecast.base import Forecaster, Point, Quantiles, register
from prorsa.forecast.bottomup import TOOL_SHIFT_S, Live, bottom_up, decode_waits
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.targets import event_frame, run_targets
from prorsa.forecast.tracker import IN_TOOL, rows_of
from prorsa.forecast.types import DEFAULT_HORIZONS, TARGETS, target_column
from prorsa.workload.truth import GroundTruth

SIMULATOR = "simulator"
_EXACT = 1e-3  # log-space spread of a value known exactly


def require_simulated(telemetry: pa.Table | pd.DataFrame, *, what: str = "telemetry") -> None:
    """Raise InputError unless ``telemetry`` is marked ``prorsa.source=simulator``."""
    if isinstance(telemetry, pa.Table):
        source = (telemetry.schema.metadata or {}).get(b"prorsa.source", b"").decode()
    else:
        source = str(telemetry.attrs.get("prorsa.source", ""))
    if source != SIMULATOR:
        raise InputError(
            f"the oracle reads the future and accepts simulator {what} only; this one has "
            f"prorsa.source={source or '(missing)'}",
            field="prorsa.source",
            hint="use telemetry written by `prorsa simulate` (schema metadata "
            "prorsa.source=simulator)",
        )


@register("oracle")
class OracleForecaster(Forecaster):
    """Reads the future of a simulation (see the module doc for what it knows)."""

    requires_data = False
    needs_future = True

    def __init__(self, horizons: Sequence[float] = DEFAULT_HORIZONS, seed: int = 0) -> None:
        super().__init__(horizons, seed)

    def _fit(self, data: ForecastDataset | None) -> None:
        if data is not None:
            bad = {r: s for r, s in data.sources.items() if s != SIMULATOR}
            if bad:
                run, source = next(iter(bad.items()))
                raise InputError(
                    f"the oracle fits on simulated runs only; run '{run}' has source '{source}'",
                    field="prorsa.source",
                )
        self._set_state({}, None)

    def _set_state(self, state: dict, path) -> None:
        self._future: dict[str, pd.DataFrame] = {}
        self._truth = None

    # -------------------------------------------------------------- attach
    def attach(self, telemetry: pa.Table | pd.DataFrame) -> OracleForecaster:
        """Show the oracle a simulated run's full telemetry (checked for its source)."""
        self._check_fitted()
        require_simulated(telemetry)
        events = event_frame(telemetry)
        self._future = {str(r): run for r, run in events.groupby("run_id", sort=False)}
        self._truth = None
        return self

    def attach_truth(self, truth: GroundTruth) -> OracleForecaster:
        """Read the live trajectories' specs from a running simulation's ground-truth port."""
        self._check_fitted()
        if not callable(getattr(truth, "spec", None)):
            raise ConfigError("the oracle needs a ground-truth port with a spec(trajectory_id)")
        self._truth = truth
        return self

    def _reset_stream(self) -> None:
        self._run_id: str | None = None

    def update(self, rows, time_s: float) -> OracleForecaster:
        rows = list(rows_of(rows))
        if rows and self._run_id is None:
            self._run_id = str(rows[0][1])
        return super().update(rows, time_s)

    # -------------------------------------------------------------- predict
    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        if self._truth is not None:
            return self._predict_live(horizons), {}
        if not self._future:
            raise ConfigError(
                "the oracle has not been shown the future",
                hint="call attach(simulator_telemetry) or use it through the provider "
                "adapter inside a simulation",
            )
        run_id = self._run_id if self._run_id in self._future else None
        if run_id is None:
            if len(self._future) != 1:
                raise ConfigError(f"the oracle does not know run '{self._run_id}'")
            run_id = next(iter(self._future))
        cols = run_targets(self._future[run_id], np.array([self.tracker_.time_s]), horizons)
        return {t: np.array([cols[target_column(t, h)][0] for h in horizons]) for t in TARGETS}, {}

    def _predict_live(self, horizons: tuple[float, ...]) -> Point:
        tr = self.tracker_
        snap = tr.snapshot
        ids = tr.ids[snap["slot"]]
        n = len(ids)
        out_tokens = np.ones(n)
        cont = np.zeros(n)
        tool = np.zeros(n)
        nxt = np.zeros(n)
        truth = self._truth
        in_tool = snap["state"] == IN_TOOL
        for i, (tid, turn) in enumerate(zip(ids, snap["turn"], strict=True)):
            spec = truth.spec(tid)
            if spec is None:
                continue
            out_tokens[i] = spec.output_tokens[turn]
            tool[i] = spec.tool_latency_s[turn]
            if turn + 1 < spec.num_turns:
                cont[i] = 1.0
                nxt[i] = spec.new_tokens[turn + 1]
                if in_tool[i]:
                    # In a tool the closed forms need the *next* turn's output.
                    out_tokens[i] = spec.output_tokens[turn + 1]
        exact = np.full(n, _EXACT)
        rate = np.full(n, tr.decode_rate)
        view = Live(
            state=snap["state"],
            open=snap["open"],
            ctx=snap["ctx"],
            wait=decode_waits(
                snap["state"], snap["open"], snap["since_queued"], tr.ttft_s, tr.turn_start_rate
            ),
            decoded=np.minimum(snap["decoded"], out_tokens - 1),
            tool_elapsed=snap["tool_elapsed"],
            out_last=snap["out_last"],
            mu_out=np.log(out_tokens),
            sd_out=exact,
            q_cont=cont,
            p_instant=(tool < TOOL_SHIFT_S).astype(float),
            mu_tool=np.log(tool + TOOL_SHIFT_S),
            sd_tool=exact,
            mu_next=np.log1p(nxt),
            sd_next=exact,
            rate=rate,
            ttft=np.full(n, tr.ttft_s),
        )
        sums = bottom_up(view, np.asarray(horizons, float)).sum(axis=0)
        return {t: sums[i] for i, t in enumerate(TARGETS)}
