"""``lightgbm-trajectory``: bottom-up demand from per-trajectory LightGBM models.

When a turn arrives, five small models look at the trajectory (its turn, context, own
history, task, and how its GRPO siblings are doing) and predict:

* ``output`` — the turn's output tokens (log-normal: LightGBM mean of the log, spread
  from out-of-fold residuals per task);
* ``continues`` — the probability that another turn follows;
* ``instant`` and ``tool`` — the tool time after this turn: instant (< 0.05 s) with the
  first model's probability, else log-normal in ``T + 0.05 s``;
* ``next`` — the next turn's new tokens (log-normal of ``1 + N``).

Every tick these are conditioned on elapsed decode and tool time and summed into the four
targets in closed form (:mod:`prorsa.forecast.bottomup`): the remaining decode tokens of a
running decode, the remaining tool time and the next prefill size are what the issue asks
the models for, expressed as distributions. A calibration stage (``calibrate=True``) then
maps the bottom-up sums plus the aggregate features to the targets with LightGBM (mean,
p50, p90); it is trained on out-of-fold bottom-up sums (folds by source of trajectories,
:mod:`prorsa.forecast.sources`) so it learns how far to trust them, and it supplies
what the sum cannot see (trajectories not yet started).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pandas as pd

from prorsa.errors import InputError
from prorsa.forecast import bottomup, lgbm
from prorsa.forecast.aggregate import (
    CONFORMAL_FRACTION,
    LOSSES,
    POINT_CHOICES,
    conformal_rows,
    conformal_shift,
    fit_target_models,
    ordered_median,
    pick_point,
    read_conformal,
    read_points,
    skip_target,
    subsample,
)
from prorsa.forecast.base import Forecaster, Point, Quantiles, denormalise, normalise, register
from prorsa.forecast.bottomup import (
    TOOL_SHIFT_S,
    Live,
    bottom_up,
    decode_waits,
    shared_bottom_up,
)
from prorsa.forecast.compiled_trees import MIN_ROWS
from prorsa.forecast.dataset import TURN_START_RATE, ForecastDataset
from prorsa.forecast.features import PER_GPU_FEATURES, aggregate_feature_names
from prorsa.forecast.model_folder import MANIFEST, model_file, state_field
from prorsa.forecast.sources import Fold, source_folds
from prorsa.forecast.threads import forecast_threads, scoring_pool
from prorsa.forecast.tracker import EVENT_FEATURES, START_RATE_VERSION
from prorsa.forecast.types import DEFAULT_HORIZONS, QUANTILES, TARGETS

logger = logging.getLogger(__name__)

#: name -> (label column, transform to model space, objective, rows it trains on)
TURN_MODELS = {
    "output": ("output_tokens", lambda y: np.log(np.maximum(y, 1.0)), "regression", "all"),
    "continues": ("continues", lambda y: y, "binary", "all"),
    "instant": ("tool_s", lambda y: (y < TOOL_SHIFT_S).astype(float), "binary", "cont"),
    "tool": ("tool_s", lambda y: np.log(np.maximum(y, 0.0) + TOOL_SHIFT_S), "regression", "slow"),
    "next": ("next_new_tokens", lambda y: np.log1p(np.maximum(y, 0.0)), "regression", "cont"),
}
_SLOT_ARRAYS = tuple(f"mu_{name}" for name in TURN_MODELS)
BOTTOM_UP_FEATURES = ("bu_prefill", "bu_decode", "bu_sequences", "bu_kv")
# The calibration sees few aggregate features: with many, its trees chase the noise of a
# few thousand ticks instead of correcting the bottom-up sum.
# What was observed over the same horizon just before the tick, per target: lets the
# calibration fall back on recent demand where the bottom-up sum is off. Prefill's is split
# in two: later turns' prompts (what live trajectories keep asking for, one per target like
# the others) and first turns' (new trajectories). A sync step queues every first prompt
# at its launch; in one lag, that burst reads as steady demand and the trees forecast it
# again (a 30B tau2 step: 1.8M tokens forecast for the next 30 s where 0.55M came).
_LAG_PREFIXES = ("lag_prefill_rate_", "lag_decode_rate_", "lag_decodes_", "lag_kv_tokens_")
_FIRST_PREFILL_PREFIX = "lag_first_prefill_rate_"
LAG_FEATURES = ("lag_later_prefill", "lag_decode", "lag_sequences", "lag_kv", "lag_first_prefill")
#: What the calibration may correct, per target (``prefill_offset`` and ``decode_offset``,
#: see the class doc).
OFFSETS = ("bottom-up", "recent", "blend")
CALIBRATION_FEATURES = (
    "live",
    "queued",
    "decoding",
    "in_tool",
    "start_rate_5",
    "end_rate_5",
    "cohort_done",
    "cohort_age_s",
    "decode_rate_per_seq",
    "ttft_s",
    *PER_GPU_FEATURES,
)


@register("lightgbm-trajectory")
class LightGBMTrajectoryForecaster(Forecaster):
    """Bottom-up forecaster from per-trajectory models (see the module doc).

    Args:
        n_estimators / learning_rate / num_leaves / min_child_samples: per-turn models.
        calibrate: add the calibration stage (mean, p50, p90); False gives the raw
            bottom-up expectation as the point forecast and no quantiles.
        folds: folds (by source of trajectories) for the out-of-fold predictions the
            calibration trains on.
        calibration_estimators: trees of each calibration model.
        max_rows: rows kept per model (seeded sample).
        decode_offset: what the calibration trees correct for the three decode targets:
            ``"bottom-up"`` (the bottom-up sum, as for prefill), ``"recent"`` (what was
            observed over the same horizon just before the tick) or ``"blend"`` (a
            weighted sum of the two, the weight per target and horizon fitted by least
            squares on the training ticks). Decode demand is a slowly moving stock, which
            recent demand predicts well at short horizons; trees correct a good offset
            more easily than they learn it.
        prefill_offset: the same choice for prefill. Its recent demand is the later
            turns' prompts over the horizon before the tick (first prompts arrive in
            bursts at a sync launch, :data:`LAG_FEATURES`). ``"blend"`` transferred
            better to the validation cells than the bottom-up sum alone (prefill WAPE at
            5 s 0.274 against 0.307, docs/results.md, "Forecasting"), so the shipped
            model blends.
        queue_wait: a queued turn also waits for the turns queued before it (its place in
            the queue over the rate turns leave it, :func:`~prorsa.forecast.bottomup.
            decode_waits`); off, it waits the recent queue-to-decode time less what it has
            waited. On makes the raw bottom-up sum far closer to demand on held-out runs,
            but the calibration trained on it transferred worse (docs/results.md,
            "Forecasting"); the shipped model has it on, with its point chosen on
            validation cells (:mod:`~prorsa.forecast.validation_fit`).
    """

    provides_quantiles = True

    def __init__(
        self,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        seed: int = 0,
        n_estimators: int = 80,
        learning_rate: float = 0.08,
        num_leaves: int = 15,
        min_child_samples: int = 20,
        calibrate: bool = True,
        folds: int = 2,
        calibration_estimators: int = 150,
        max_rows: int = 200_000,
        decode_offset: str = "bottom-up",
        queue_wait: bool = False,
        prefill_offset: str = "bottom-up",
    ) -> None:
        super().__init__(horizons, seed)
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.num_leaves = num_leaves
        self.min_child_samples = min_child_samples
        self.calibrate = calibrate
        self.folds = folds
        self.calibration_estimators = calibration_estimators
        self.max_rows = max_rows
        self.prefill_offset = prefill_offset
        self.decode_offset = decode_offset
        for name, value in self._offset_options().items():
            if value not in OFFSETS:
                from prorsa.errors import ConfigError

                raise ConfigError(f"unknown {name} {value!r}", hint=f"one of {OFFSETS}")
        self.queue_wait = queue_wait

    def _offset_options(self) -> dict[str, str]:
        """The two offset parameters by name: prefill's, then the decode targets'."""
        return {"prefill_offset": self.prefill_offset, "decode_offset": self.decode_offset}

    # ------------------------------------------------------------------- fit
    def _train(
        self,
        x,
        y,
        objective,
        *,
        alpha=None,
        names=None,
        calibration=False,
        init_score=None,
        valid=None,
        n_estimators=None,
    ):
        # Calibration fits a few noisy targets per tick: slower learning, bigger leaves.
        return lgbm.train(
            x,
            y,
            objective=objective,
            alpha=alpha,
            seed=self.seed,
            n_estimators=n_estimators
            or (self.calibration_estimators if calibration else self.n_estimators),
            learning_rate=self.learning_rate / 2 if calibration else self.learning_rate,
            num_leaves=self.num_leaves,
            min_child_samples=self.min_child_samples * (5 if calibration else 1),
            categorical=None if calibration else [0],
            feature_names=names or list(EVENT_FEATURES),
            init_score=init_score,
            valid=valid,
        )

    def _fit(self, data: ForecastDataset | None) -> None:
        turns = data.turns.reset_index(drop=True)
        if turns.empty:
            from prorsa.errors import InputError

            raise InputError("dataset has no turn rows: lightgbm-trajectory needs trajectories")
        made_with = data.meta.get("turn_start_rate_version", 1)
        if self.queue_wait and self.calibrate and made_with != START_RATE_VERSION:
            from prorsa.errors import InputError

            raise InputError(
                f"the dataset's turn_start_rate was counted by version {made_with}, this "
                f"one counts by version {START_RATE_VERSION}: queue_wait would calibrate "
                "on rates it never sees live",
                field="turn_start_rate",
                hint="rebuild it (`prorsa forecast dataset`)",
            )
        x = turns[list(EVENT_FEATURES)].to_numpy(float)
        task = np.nan_to_num(turns["task"].to_numpy(float), nan=len(self.tasks_)).astype(int)
        run_of_row = turns["run_id"].to_numpy()
        # Folds by source of trajectories: a replayed trace or scenario sample is in one
        # fold only, and each fold stops adding trees on other sources than it predicts.
        plan = source_folds(run_of_row, self.folds, self.seed)
        if not plan:
            why = "folds < 2" if self.folds < 2 else "one source of trajectories"
            logger.warning("%s: calibration trains on in-sample predictions", why)
            everything = frozenset(run_of_row.tolist())
            plan = [Fold(fit=everything, stop=frozenset(), test=everything)]
        role = {
            name: [np.isin(run_of_row, list(getattr(f, name))) for f in plan]
            for name in ("fit", "stop", "test")
        }
        oof = np.full((len(turns), len(TURN_MODELS)), np.nan)
        self.boosters_: dict[str, object] = {}
        self.spread_: dict[str, list[float]] = {}
        self.default_: dict[str, float] = {}
        n_tasks = len(self.tasks_) + 1
        for j, (name, (col, transform, objective, rows)) in enumerate(TURN_MODELS.items()):
            label = turns[col].to_numpy(float)
            mask = np.isfinite(label)
            if rows in ("cont", "slow"):
                mask &= turns["continues"].to_numpy(float) == 1.0
            if rows == "slow":  # the log-normal part of the tool mixture
                mask &= turns["tool_s"].to_numpy(float) >= TOOL_SHIFT_S
            idx = np.flatnonzero(mask)
            idx = idx[subsample(len(idx), self.max_rows, self.seed)]
            y = transform(label[idx])
            if len(idx) < 2 or (objective == "binary" and len(np.unique(y)) < 2):
                # Too little to learn from: a constant model (still saved and loaded).
                const = float(np.mean(y)) if len(y) else (1.0 if objective == "binary" else 0.0)
                self.default_[name] = const
                oof[:, j] = const
                self.spread_[name] = [1.0] * n_tasks
                continue
            # Out-of-fold predictions, each fold's trees stopped on sources it does not
            # predict: the final model gets as many trees as helped there (fewer trees:
            # cheaper every tick).
            best = []
            for k in range(len(plan)):
                test = np.flatnonzero(role["test"][k])
                train = idx[role["fit"][k][idx]]
                check = idx[role["stop"][k][idx]]
                if len(train) < 2:  # too few rows to fit on: stop on none, fit on both
                    train, check = np.union1d(train, check), check[:0]
                if len(train) < 2:  # still too few: the fold's turns get the mean
                    oof[test, j] = float(np.mean(y))
                    continue
                valid = None
                if len(check) >= 20:
                    valid = (x[check], transform(label[check]))
                model = self._train(x[train], transform(label[train]), objective, valid=valid)
                if valid is not None:
                    best.append(max(int(model.best_iteration), 1))
                oof[test, j] = lgbm.predict(model, x[test])
            trees = max(10, round(float(np.mean(best)))) if best else self.n_estimators
            self.boosters_[name] = self._train(x[idx], y, objective, n_estimators=trees)
            self.default_[name] = float(np.mean(y))
            if objective == "regression":
                self.spread_[name] = _spread_by_task(y - oof[idx, j], task[idx], n_tasks)
        if self.calibrate:
            self._fit_calibration(data, turns, oof)

    def _fit_calibration(self, data: ForecastDataset, turns: pd.DataFrame, oof: np.ndarray) -> None:
        snaps = data.snapshots
        if snaps.empty:
            from prorsa.errors import InputError

            raise InputError("dataset has no trajectory snapshots to calibrate on")
        key = ["run_id", "trajectory_id", "turn"]
        preds = pd.DataFrame(oof, columns=list(_SLOT_ARRAYS))
        preds[key] = turns[key].astype({"turn": np.int64, "trajectory_id": str})
        preds["task_code"] = turns["task"].to_numpy()
        snaps = snaps.astype({"turn": np.int64, "trajectory_id": str})
        joined = snaps.merge(preds, on=key, how="left")
        ticks = data.ticks
        tick_key = ticks[["run_id", "time"]].reset_index().rename(columns={"index": "tick"})
        joined = joined.merge(tick_key, on=["run_id", "time"], how="inner")
        rate = ticks["decode_rate_per_seq"].to_numpy(float)[joined["tick"].to_numpy()]
        tick = joined["tick"].to_numpy()
        ttft = ticks["ttft_s"].to_numpy(float)[tick]
        live = self._live(
            {c: joined[c].to_numpy() for c in joined.columns},
            {n: joined[n].to_numpy(float) for n in _SLOT_ARRAYS},
            np.nan_to_num(joined["task_code"].to_numpy(float), nan=len(self.tasks_)).astype(int),
            rate,
            ttft,
            ticks[TURN_START_RATE].to_numpy(float)[tick],
            tick,
        )
        contrib = bottom_up(live, np.asarray(self.horizons_))
        ticks_used, inverse = np.unique(joined["tick"].to_numpy(), return_inverse=True)
        sums = np.zeros((len(ticks_used), len(TARGETS), len(self.horizons_)))
        np.add.at(sums, inverse, contrib)
        sub = ticks.iloc[ticks_used]
        scale = sub["scale"].to_numpy(float)
        self.calibration_features_ = [f for f in CALIBRATION_FEATURES if f in data.feature_names]
        self._cal_index = None
        feats = sub[data.feature_names].to_numpy(float)
        xs = self._calibration_rows(feats, sums, scale, self.horizons_)
        y = self._targets_matrix(sub, self.horizons_)
        keep = subsample(len(xs), self.max_rows, self.seed)
        names = [*self.calibration_features_, *BOTTOM_UP_FEATURES, *LAG_FEATURES, "horizon_s"]
        ys = np.stack([y[:, i, :].T.reshape(-1) for i in range(len(TARGETS))], axis=1)
        runs = np.tile(sub["run_id"].to_numpy(), len(self.horizons_))
        x_kept, y_kept = xs[keep], ys[keep]
        # Fitted, like the quantile models, without the runs the conformal shifts are
        # measured on: those must be new to everything the quantiles are built from.
        fit = ~conformal_rows(runs[keep], CONFORMAL_FRACTION, self.seed)
        self.offset_weights_ = self._fit_offset_weights(x_kept[fit], y_kept[fit])

        def train(xk, yk, objective, alpha, init):
            return self._train(
                xk, yk, objective, alpha=alpha, names=names, calibration=True, init_score=init
            )

        # The trees correct an offset (the bottom-up sum, or for decode what
        # ``decode_offset`` names), rather than replace it.
        boosters, self.conformal_, self.points_ = fit_target_models(
            x_kept,
            y_kept,
            runs[keep],
            x_kept[:, -1],
            self.horizons_,
            train,
            self.seed,
            init=self._offsets(x_kept),
            prefix="cal:",
        )
        self.boosters_.update(boosters)

    def _fit_offset_weights(self, xs: np.ndarray, ys: np.ndarray) -> dict[str, list[float]]:
        """Per target and horizon, the weight of the bottom-up sum in the offset (the rest
        on recent demand): 1 (``"bottom-up"``), 0 (``"recent"``) or, for ``"blend"``, the
        least-squares weight on the training rows, clipped to [0, 1]; prefill by
        ``prefill_offset``, the decode targets by ``decode_offset``."""
        modes = [self.prefill_offset] + [self.decode_offset] * (len(TARGETS) - 1)
        if all(mode == "bottom-up" for mode in modes):
            return {}  # the bottom-up sum everywhere
        n_feats = len(self.calibration_features_)
        weights = {t: [1.0] * len(self.horizons_) for t in TARGETS}
        for i, (target, mode) in enumerate(zip(TARGETS, modes, strict=True)):
            for j, h in enumerate(self.horizons_):
                if mode != "blend":
                    weights[target][j] = 1.0 if mode == "bottom-up" else 0.0
                    continue
                rows = np.isclose(xs[:, -1], h) & np.isfinite(ys[:, i])
                recent = xs[rows, n_feats + len(TARGETS) + i]
                gap = xs[rows, n_feats + i] - recent
                denom = float(gap @ gap)
                w = float((ys[rows, i] - recent) @ gap) / denom if denom > 0 else 1.0
                weights[target][j] = float(np.clip(w, 0.0, 1.0))
        return weights

    def _offsets(self, x: np.ndarray) -> np.ndarray:
        """The offset each target's calibration trees correct, per calibration row
        [rows, targets]: ``w`` x bottom-up sum + (1 - ``w``) x recent demand over the
        same horizon (same units: per live trajectory, per second for sums)."""
        n_feats = len(self.calibration_features_)
        bottom_up_sum = x[:, n_feats : n_feats + len(TARGETS)]
        recent = x[:, n_feats + len(TARGETS) : n_feats + 2 * len(TARGETS)]
        weights = getattr(self, "offset_weights_", None)
        if not weights:
            return bottom_up_sum
        table = np.array([weights[t] for t in TARGETS]).T  # [horizons, targets]
        index = {h: j for j, h in enumerate(self.horizons_)}
        seen, inverse = np.unique(x[:, -1], return_inverse=True)
        w = table[[index[h] for h in seen]][inverse]
        # Weights of exactly 1 or 0 take one side as it is (the other may be NaN).
        blend = w * bottom_up_sum + (1.0 - w) * recent
        return np.where(w == 1.0, bottom_up_sum, np.where(w == 0.0, recent, blend))

    def _calibration_rows(
        self, feats: np.ndarray, sums: np.ndarray, scale: np.ndarray, horizons: Sequence[float]
    ) -> np.ndarray:
        """Calibration inputs, horizon-major: [ticks x horizons, chosen aggregate features +
        bottom-up sums + the observed lags at the same horizon (:data:`LAG_FEATURES`) + horizon].

        ``feats`` are full aggregate-feature rows; ``sums`` [ticks, targets, horizons].
        """
        index, lags = self._calibration_index()
        base = feats[:, index]
        blocks = []
        for j, h in enumerate(horizons):
            bu = np.column_stack(
                [normalise(sums[:, i, j], t, h, scale) for i, t in enumerate(TARGETS)]
            )
            lag = feats[:, lags[h]]
            lag[:, 0] -= lag[:, -1]  # all prompts less first turns': later turns'
            blocks.append(np.column_stack([base, bu, lag, np.full(len(base), h)]))
        return np.vstack(blocks)

    # --------------------------------------------------------------- online
    def _reset_stream(self) -> None:
        for name in _SLOT_ARRAYS:
            self.tracker_.add_slot_array(name)
        # The horizons the model itself last forecast, and at which tick: the next tick
        # sums the bottom-up terms for them during its update only if the tick before
        # read them (not while the drift check falls back, nor for callers that forecast
        # less often than they update).
        self._horizons_read: tuple[int, tuple[float, ...]] | None = None
        self._sums_at: tuple[tuple[float, ...], np.ndarray] | None = None

    def _update(self) -> None:
        self._sums_at = None
        slots = self.tracker_.take_pending()
        if not len(slots):
            return
        x = self.tracker_.frozen[slots]
        read = self._horizons_read
        if (
            read is not None
            and read[0] == self._ticks - 1
            and len(x) >= MIN_ROWS
            and forecast_threads() >= 2
            and bottomup.use_kernel()  # the overlap runs the row kernel's parts; numpy's is whole
        ):
            self._score_beside_bottom_up(slots, x, read[1])
        else:
            self._store_scores(slots, self._score_turns(x))

    def _score_turns(self, x: np.ndarray, threads: int | None = None) -> list:
        """The five per-turn models' scores of the frozen turn rows ``x``."""
        return [
            lgbm.predict_online(self.boosters_[name], x, threads)
            if name in self.boosters_
            else self.default_[name]
            for name in TURN_MODELS
        ]

    def _store_scores(self, slots: np.ndarray, scores: list) -> None:
        for arr, values in zip(_SLOT_ARRAYS, scores, strict=True):
            self.tracker_.slot_array(arr)[slots] = values

    def _score_beside_bottom_up(
        self, slots: np.ndarray, x: np.ndarray, horizons: tuple[float, ...]
    ) -> None:
        """Score the new turns on a worker thread while this one sums the bottom-up terms
        of every other live trajectory (their scores are already in place), then add the
        new turns' terms: the two halves of a tick's forecast overlap on two cores. The
        rows of every live trajectory are built once, before the scores are known
        (:class:`~prorsa.forecast.bottomup_kernel.SharedRows`); each half is shared work:
        the worker joins the first once its scoring is done, and the second as it starts.

        The sums are the ones :meth:`bottom_up_now` computes at those horizons, bit for
        bit: every row's terms are computed alone and summed in the same order.
        """
        pool = scoring_pool()
        shared = []  # the first half, once built: the worker helps with it after scoring

        def score_then_help() -> list:
            scores = self._score_turns(x, max(forecast_threads() - 1, 1))
            for work in list(shared):
                work.run()
            return scores

        job = pool.submit(score_then_help)
        tr = self.tracker_
        is_new = np.zeros(len(tr.alive), bool)
        is_new[slots] = True
        waiting = is_new[tr.snapshot["slot"]]
        try:
            work = self._bottom_up_work(horizons)
            others = work.part(np.flatnonzero(~waiting))
            shared.append(others)
            others.run()
        finally:
            wait([job])  # on an error here, the worker finishes first; its own is dropped
        self._store_scores(slots, job.result())
        rows = np.flatnonzero(waiting)
        mus = {n: tr.slot_array(n)[tr.snapshot["slot"][rows]] for n in _SLOT_ARRAYS}
        work.set_rows(rows, self._scored(mus))
        new = work.part(rows)
        helper = pool.submit(new.run)
        try:
            new.run()
        finally:
            wait([helper])
        helper.result()
        sums = work.out.sum(axis=0)
        sums.setflags(write=False)  # handed out by bottom_up_now, maybe more than once
        self._sums_at = (horizons, sums)

    def _scored(self, mus: dict) -> dict[str, np.ndarray]:
        """The bottom-up inputs the per-turn models' scores ``mus`` give (unscored turns,
        NaN, take the model's default)."""

        def mu(name: str, model: str) -> np.ndarray:
            values = np.asarray(mus[name], float)
            return np.where(np.isnan(values), self.default_[model], values)

        return {
            "mu_out": mu("mu_output", "output"),
            "q_cont": np.clip(mu("mu_continues", "continues"), 0.0, 1.0),
            "p_instant": np.clip(mu("mu_instant", "instant"), 0.0, 1.0),
            "mu_tool": mu("mu_tool", "tool"),
            "mu_next": mu("mu_next", "next"),
        }

    def _live(
        self, snap: dict, mus: dict, task: np.ndarray, rate, ttft, start_rate, tick=None
    ) -> Live:
        def spread(model: str) -> np.ndarray:
            table = np.asarray(self.spread_.get(model, [1.0]), float)
            return table[np.minimum(task, len(table) - 1)]

        n = len(snap["state"])
        return Live(
            state=np.asarray(snap["state"]),
            open=np.asarray(snap["open"], bool),
            ctx=np.asarray(snap["ctx"], float),
            wait=decode_waits(
                snap["state"],
                snap["open"],
                snap["since_queued"],
                ttft,
                start_rate if self.queue_wait else np.nan,  # NaN: no queue term
                tick,
            ),
            decoded=np.asarray(snap["decoded"], float),
            tool_elapsed=np.asarray(snap["tool_elapsed"], float),
            out_last=np.asarray(snap["out_last"], float),
            sd_out=spread("output"),
            sd_tool=spread("tool"),
            sd_next=spread("next"),
            rate=np.broadcast_to(np.asarray(rate, float), (n,)),
            ttft=np.broadcast_to(np.asarray(ttft, float), (n,)),
            **self._scored(mus),
        )

    def bottom_up_now(self, horizons: Sequence[float]) -> np.ndarray:
        """Raw bottom-up expectation [targets, horizons] at the last tick."""
        key = tuple(float(h) for h in horizons)
        if self._sums_at is not None and self._sums_at[0] == key:
            return self._sums_at[1]  # summed during the tick's update
        work = self._bottom_up_work(key)
        work.run()
        return work.out.sum(axis=0)

    def _bottom_up_work(self, horizons: Sequence[float]):
        """Every live trajectory's bottom-up terms at the last tick as work threads can
        share (``run()``, then ``out``: [rows, targets, horizons])."""
        tr = self.tracker_
        snap = tr.snapshot
        slots = snap["slot"]
        mus = {n: tr.slot_array(n)[slots] for n in _SLOT_ARRAYS}
        live = self._live(
            snap, mus, snap["task"].astype(int), tr.decode_rate, tr.ttft_s, tr.turn_start_rate
        )
        return shared_bottom_up(live, np.asarray(horizons, float))

    def _calibration_index(self) -> tuple[np.ndarray, dict[float, np.ndarray]]:
        """Columns of the aggregate features the calibration reads (and lags per horizon)."""
        if getattr(self, "_cal_index", None) is None:
            names = aggregate_feature_names(self.lags_, self.tasks_)
            index = np.array([names.index(f) for f in self.calibration_features_], dtype=int)
            lags = {
                h: np.array(
                    [names.index(f"{p}{h:g}") for p in (*_LAG_PREFIXES, _FIRST_PREFILL_PREFIX)],
                    dtype=int,
                )
                for h in self.horizons_
            }
            self._cal_index = (index, lags)
        return self._cal_index

    def point_choices(self) -> tuple[str, ...]:
        return POINT_CHOICES if self.calibrate else ()

    def quantile_shifts(self) -> dict | None:
        return super().quantile_shifts() if self.calibrate else None

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        self._horizons_read = (self._ticks, tuple(float(h) for h in horizons))
        sums = self.bottom_up_now(horizons)
        if not self.calibrate:
            return {t: sums[i] for i, t in enumerate(TARGETS)}, {}
        scale = self.live_scale()
        x = self._calibration_rows(self.current_features()[None, :], sums[None], scale, horizons)
        point: Point = {}
        quantiles: Quantiles = {q: {} for q in QUANTILES}
        offset = self._offsets(x)

        def tokens(values: np.ndarray, target: str) -> np.ndarray:
            return denormalise(values, target, horizons, scale)

        for i, target in enumerate(TARGETS):
            if not self._reads(target):
                skip_target(point, quantiles, target, len(horizons))
                continue
            for suffix, _, alpha in LOSSES:
                raw = lgbm.predict(self.boosters_[f"cal:{target}:{suffix}"], x) + offset[:, i]
                raw = raw + conformal_shift(
                    self.conformal_, alpha, target, self.horizons_, horizons
                )
                if alpha is None:
                    point[target] = tokens(raw, target)
                else:
                    quantiles[alpha][target] = tokens(raw, target)
            candidates = {
                "mean": point[target],
                "median": ordered_median({q: quantiles[q][target] for q in QUANTILES}),
                "offset": tokens(offset[:, i], target),
                "bottom-up": sums[i],
            }
            self._candidates[target] = candidates
            point[target] = pick_point(self.points_, target, self.horizons_, horizons, candidates)
        return point, quantiles

    # ------------------------------------------------------------- save/load
    def _get_state(self, path: Path) -> dict:
        return {
            "boosters": lgbm.save_boosters(self.boosters_, path / "boosters.json.gz"),
            "spread": self.spread_,
            "default": self.default_,
            "calibration_features": getattr(self, "calibration_features_", []),
            "conformal": getattr(self, "conformal_", {}),
            "point": getattr(self, "points_", {}),
            "offset_weights": getattr(self, "offset_weights_", {}),
        }

    def _set_state(self, state: dict, path: Path) -> None:
        file = model_file(
            path, state_field(state, "boosters", str, source=path), field="state.boosters"
        )
        spread = state_field(state, "spread", dict, source=path)
        default = state_field(state, "default", dict, source=path)
        features = state.get("calibration_features", [])
        source = str(path / MANIFEST)
        if not isinstance(features, list) or not all(f in CALIBRATION_FEATURES for f in features):
            raise InputError(
                f"unknown calibration features {features!r}",
                source=source,
                field="state.calibration_features",
            )
        missing = [name for name in TURN_MODELS if name not in default]
        if missing:
            raise InputError("missing", source=source, field=f"state.default.{missing[0]}")
        for table, label in ((spread, "spread"), (default, "default")):
            for key, value in table.items():
                values = value if label == "spread" else [value]
                if not isinstance(values, list) or not all(_finite(v) for v in values):
                    raise InputError(
                        f"must be finite numbers, got {value!r}",
                        source=source,
                        field=f"state.{label}.{key}",
                    )
        required = [f"cal:{t}:{suffix}" for t in TARGETS for suffix, _, _ in LOSSES]
        self.boosters_ = lgbm.load_boosters(file, tuple(required) if self.calibrate else ())
        self.spread_ = {k: [float(x) for x in v] for k, v in spread.items()}
        self.default_ = {k: float(v) for k, v in default.items()}
        self.calibration_features_ = list(features)
        self.conformal_ = read_conformal(state, path, len(self.horizons_))
        self.points_ = read_points(state, source, len(self.horizons_), self.point_choices())
        self.offset_weights_ = _offset_weights(state, source, len(self.horizons_))
        moved = [f"{n} {m!r}" for n, m in self._offset_options().items() if m != "bottom-up"]
        if not self.offset_weights_ and moved:
            raise InputError(
                f"{' and '.join(moved)}: the model needs the fitted offset weights",
                source=source,
                field="state.offset_weights",
            )
        self._cal_index = None
        turn_width = len(EVENT_FEATURES)
        cal_width = (
            len(self.calibration_features_) + len(BOTTOM_UP_FEATURES) + len(LAG_FEATURES) + 1
        )
        for key, booster in self.boosters_.items():
            width = cal_width if key.startswith("cal:") else turn_width
            lgbm.check_width(booster, width, source=str(file))


def _offset_weights(state: dict, source: str, horizons: int) -> dict[str, list[float]]:
    """``state.offset_weights``, checked (absent in models saved before it existed: those
    correct the bottom-up sum everywhere, which an empty table means)."""
    table = state.get("offset_weights", {})
    if not isinstance(table, dict):
        raise InputError("must be an object", source=source, field="state.offset_weights")
    missing = [t for t in TARGETS if table and t not in table]
    if missing:
        raise InputError("missing", source=source, field=f"state.offset_weights.{missing[0]}")
    for target, weights in table.items():
        ok = (
            target in TARGETS
            and isinstance(weights, list)
            and len(weights) == horizons
            and all(_finite(w) and 0.0 <= w <= 1.0 for w in weights)
        )
        if not ok:
            raise InputError(
                f"must be {horizons} weights in [0, 1] per target, got {weights!r}",
                source=source,
                field=f"state.offset_weights.{target}",
            )
    return {t: [float(w) for w in ws] for t, ws in table.items()}


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def _spread_by_task(residual: np.ndarray, task: np.ndarray, n_tasks: int) -> list[float]:
    """Residual standard deviation per task code (global where a task has < 30 rows)."""
    ok = np.isfinite(residual)
    overall = float(np.std(residual[ok])) if ok.sum() > 1 else 1.0
    out = []
    for code in range(n_tasks):
        sel = ok & (task == code)
        out.append(float(np.std(residual[sel])) if sel.sum() >= 30 else overall)
    return [max(v, 0.05) for v in out]
