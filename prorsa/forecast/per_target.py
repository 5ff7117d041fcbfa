"""``per-target``: each demand target from the member forecaster that forecasts it best.

The learned forecasters are good at different targets. Scored on the shipping recipe's
validation cells at 5 s (WAPE, models/*/manifest.json), lightgbm-aggregate forecasts
prefill tokens (0.270 against lightgbm-trajectory's 0.274) and decode sequences (0.078
against 0.079) best, lightgbm-trajectory decode tokens (0.098 against 0.127) and decode
KV tokens (0.104 against 0.107); on replayed real traces aggregate's prefill transfers
better still (benchmarks/results/forecast.json). A composite takes each target from one
member, chosen by :func:`choose_members` on validation scores, never on held-out runs.

The members read one :class:`~prorsa.forecast.tracker.LifecycleTracker` that the
composite feeds once per tick (a tick's events are ingested once, not once per member),
and the composite alone checks drift: where its live features leave the training range,
every target falls back to the baseline together. A saved composite is a model folder
holding each member's own model folder, each pinned by its manifest's SHA-256.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prorsa.errors import ConfigError, InputError
from prorsa.forecast.base import (
    FORECASTERS,
    Forecaster,
    Point,
    Quantiles,
    load_forecaster,
    register,
)
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.model_folder import MANIFEST
from prorsa.forecast.types import DEFAULT_HORIZONS, TARGETS

#: The shipped models' choice on the validation cells (the module docstring's scores).
DEFAULT_MEMBERS: dict[str, str] = {
    "prefill_tokens": "lightgbm-aggregate",
    "decode_tokens": "lightgbm-trajectory",
    "decode_sequences": "lightgbm-aggregate",
    "decode_kv_tokens": "lightgbm-trajectory",
}
#: The manifest metric :func:`choose_members` ranks by (``{target}`` filled in).
VALIDATION_METRIC = "validation_wape_{target}_h5"


@register("per-target")
class PerTargetForecaster(Forecaster):
    """Each target forecast by one member forecaster.

    Args:
        members: target -> registered forecaster name, every target of ``TARGETS`` once
            (default :data:`DEFAULT_MEMBERS`); a name may serve several targets and runs
            once.
        member_params: forecaster name -> its other constructor parameters (horizons and
            seed are the composite's).
    """

    provides_quantiles = True

    def __init__(
        self,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        seed: int = 0,
        members: Mapping[str, str] | None = None,
        member_params: Mapping[str, Mapping] | None = None,
    ) -> None:
        super().__init__(horizons, seed)
        self.members = members
        self.member_params = member_params

    # ------------------------------------------------------------------ fit
    def member_of(self) -> dict[str, str]:
        """Target -> member name, checked (:data:`DEFAULT_MEMBERS` when not given)."""
        members = dict(DEFAULT_MEMBERS if self.members is None else self.members)
        unknown = sorted(set(members) - set(TARGETS))
        missing = [t for t in TARGETS if t not in members]
        if unknown or missing:
            raise ConfigError(
                f"per-target members must name one forecaster for each of {list(TARGETS)}; "
                + (f"unknown target(s) {unknown}" if unknown else f"missing {missing}")
            )
        for target, name in members.items():
            if name not in FORECASTERS or name == self.name:
                raise ConfigError(
                    f"per-target member for {target} must be a registered forecaster other "
                    f"than '{self.name}', got {name!r}",
                    hint=f"registered: {', '.join(FORECASTERS.names())}",
                )
            if FORECASTERS.get(name).needs_future:
                raise ConfigError(f"'{name}' must be shown the future; it cannot be a member")
        params = dict(self.member_params or {})
        stray = sorted(set(params) - set(members.values()))
        if stray:
            raise ConfigError(f"member_params names forecaster(s) {stray} that serve no target")
        return members

    def _fit(self, data: ForecastDataset | None) -> None:
        params = dict(self.member_params or {})
        self.member_names_ = self.member_of()  # checked once, read every tick
        self.members_ = {
            name: FORECASTERS.get(name)(
                horizons=self.horizons, seed=self.seed, **dict(params.get(name, {}))
            ).fit(data)
            for name in dict.fromkeys(self.member_names_.values())
        }
        for member in self.members_.values():
            member.set_drift_check(False)  # the composite checks once, for every target

    @classmethod
    def from_members(cls, by_target: Mapping[str, Forecaster]) -> PerTargetForecaster:
        """A fitted composite of already fitted members (``target -> forecaster``).

        The members must share their horizons, look-back windows and task vocabulary
        (they read one tracker); the drift range is the narrowest of theirs per feature.
        """
        members = {t: m.name for t, m in by_target.items()}
        by_name: dict[str, Forecaster] = {}
        for model in by_target.values():
            model._check_fitted()
            if by_name.setdefault(model.name, model) is not model:
                raise ConfigError(f"two different '{model.name}' models given as members")
        params = {
            name: {k: v for k, v in m.get_params().items() if k not in ("horizons", "seed")}
            for name, m in by_name.items()
        }
        first = next(iter(by_name.values()))
        out = cls(horizons=first.horizons_, seed=first.seed, members=members, member_params=params)
        out.member_names_ = out.member_of()
        for model in by_name.values():
            for attr in ("horizons_", "lags_", "tasks_"):
                if tuple(getattr(model, attr)) != tuple(getattr(first, attr)):
                    raise ConfigError(
                        f"members '{first.name}' and '{model.name}' differ in {attr.rstrip('_')} "
                        f"({list(getattr(first, attr))} vs {list(getattr(model, attr))}); "
                        "a composite's members read one tracker"
                    )
        out.horizons_, out.lags_, out.tasks_ = first.horizons_, first.lags_, first.tasks_
        out.tick_s_ = first.tick_s_
        hashes = {m.data_hash_ for m in by_name.values()}
        out.data_hash_ = hashes.pop() if len(hashes) == 1 else None
        out.feature_ranges_ = _narrowest([m.feature_ranges_ for m in by_name.values()])
        out.metrics_ = {
            key: value
            for target, name in members.items()
            for key, value in by_name[name].metrics_.items()
            if f"_{target}_h" in key  # validation_wape_<target>_h5 and the like
        }
        out.members_ = by_name
        for member in by_name.values():
            member.set_drift_check(False)
        out.fitted_ = True
        out.reset()
        return out

    # --------------------------------------------------------------- stream
    def _reset_stream(self) -> None:
        for member in self.members_.values():
            member._start_stream(self.tracker_)

    def _update(self) -> None:
        # The tracker already holds this tick; each member does its own per-tick work
        # (before the base class clears the turns frozen this tick).
        for member in self.members_.values():
            member._ticks = self._ticks
            member._update()

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        self._member_raw: Quantiles = {}
        # The members read the same tracker at the same tick: the aggregate features are
        # computed once (~0.6 ms at 10,000 live trajectories each time).
        features = self.current_features()
        for member in self.members_.values():
            member._features_at = ((member.tracker_, member._ticks), features)
        served: dict[str, set[str]] = {}
        for target, name in self.member_names_.items():
            served.setdefault(name, set()).add(target)
        by_name = {}
        for name, member in self.members_.items():
            # Only for this call: a member given to from_members is the caller's object.
            member.targets_read = frozenset(served[name])
            try:
                by_name[name] = member.predict(horizons)
            finally:
                member.targets_read = None
        point: Point = {}
        levels = set.intersection(*(set(f.quantiles) for f in by_name.values()))
        quantiles: Quantiles = {q: {} for q in sorted(levels)}
        for target, name in self.member_names_.items():
            point[target] = by_name[name].point[target]
            for q in quantiles:
                quantiles[q][target] = by_name[name].quantiles[q][target]
            candidates = self.members_[name].point_candidates().get(target)
            if candidates:
                self._candidates[target] = candidates
            raw = self.members_[name].raw_quantiles()
            for q in levels & set(raw):
                self._member_raw.setdefault(q, {})[target] = raw[q][target]
        return point, quantiles

    def raw_quantiles(self) -> Quantiles:
        # The members' own, before their floor at 0 and ordering (what a recalibration
        # moves); the composite's merged quantiles are already both.
        return getattr(self, "_member_raw", {})

    # ------------------------------------------------------------ save/load
    def _get_state(self, path: Path) -> dict:
        for name, member in self.members_.items():
            member.save(path / name)
        return {"member_folders": list(self.members_)}

    def _set_state(self, state: dict, path: Path) -> None:
        self.member_names_ = self.member_of()
        wanted = list(dict.fromkeys(self.member_names_.values()))
        folders = state.get("member_folders")
        if folders != wanted:
            raise InputError(
                f"must list the member folders {wanted}, got {folders!r}",
                source=str(path / MANIFEST),
                field="state.member_folders",
            )
        self.members_ = {}
        for name in wanted:
            member = load_forecaster(path / name)
            if member.name != name:
                raise InputError(
                    f"holds a '{member.name}' model, not '{name}'", source=str(path / name)
                )
            for attr in ("horizons_", "lags_", "tasks_"):
                if tuple(getattr(member, attr)) != tuple(getattr(self, attr)):
                    raise InputError(
                        f"its {attr.rstrip('_')} differ from the composite's",
                        source=str(path / name / MANIFEST),
                        field=f"fitted.{attr.rstrip('_')}",
                    )
            self.members_[name] = member.set_drift_check(False)


def choose_members(
    candidates: Sequence[Forecaster], metric: str = VALIDATION_METRIC
) -> dict[str, Forecaster]:
    """Target -> the candidate of least ``metric`` in its manifest metrics (validation
    WAPE at 5 s by default; ties go to the earlier candidate). A target no candidate has
    a finite score for is an error: a composite is chosen on scores, never by default."""
    out = {}
    for target in TARGETS:
        key = metric.format(target=target)
        scored = [
            (float(m.metrics_[key]), i, m)
            for i, m in enumerate(candidates)
            if isinstance(m.metrics_.get(key), int | float) and math.isfinite(m.metrics_[key])
        ]
        if not scored:
            names = ", ".join(m.name for m in candidates)
            raise ConfigError(
                f"no candidate ({names}) has a score '{key}' to choose the {target} member by",
                hint="ship the candidates with validation metrics (`prorsa forecast ship`)",
            )
        out[target] = min(scored, key=lambda s: s[:2])[2]
    return out


def _narrowest(ranges: list[dict]) -> dict[str, tuple[float, float]]:
    """Per feature, the narrowest training range any member has (a feature only some
    members know keeps their range): the composite falls back once any member would."""
    out: dict[str, tuple[float, float]] = {}
    for table in ranges:
        for name, (lo, hi) in table.items():
            if name in out:
                lo, hi = max(lo, out[name][0]), min(hi, out[name][1])
            out[name] = (float(lo), float(hi))
    return out


#: The shipped forecasters a shipped composite chooses among.
SHIPPED_CANDIDATES = ("lightgbm-trajectory", "lightgbm-aggregate")


def compose_shipped(
    folder: str | Path,
    candidates: Sequence[str] = SHIPPED_CANDIDATES,
    *,
    metric: str = VALIDATION_METRIC,
    out: str | Path | None = None,
) -> tuple[Path, dict]:
    """Compose the saved models ``folder/<candidate>`` into ``out`` (default
    ``folder/per-target``), each target from the candidate of least ``metric``.

    Returns the composite's folder and the choice: ``{target: {"member": name,
    "scores": {candidate: score}}}``, which its manifest records as ``chosen_by``."""
    folder = Path(folder)
    models = [load_forecaster(folder / name) for name in candidates]
    chosen = choose_members(models, metric)
    composite = PerTargetForecaster.from_members(chosen)
    choice = {
        target: {
            "member": model.name,
            "scores": {m.name: m.metrics_.get(metric.format(target=target)) for m in models},
        }
        for target, model in chosen.items()
    }
    shared = {
        key: models[0].manifest_[key]
        for key in ("recipe", "simulator")
        if key in getattr(models[0], "manifest_", {})
    }
    path = composite.save(
        folder / "per-target" if out is None else out,
        extra={**shared, "chosen_by": {"metric": metric, "targets": choice}},
    )
    return path, choice


def choice_cells(
    entry: Mapping, names: Sequence[str], *, digits: int, mark: Callable[[str], str]
) -> list[str]:
    """One target's row of a choice (:func:`compose_shipped`): each candidate's score
    with ``digits`` decimals ("-" where it has none), the chosen one passed through
    ``mark`` (bold in a table)."""
    cells = []
    for name in names:
        score = entry["scores"].get(name)
        text = "-" if score is None else f"{score:.{digits}f}"
        cells.append(mark(text) if name == entry["member"] else text)
    return cells
