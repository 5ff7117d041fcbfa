"""Task profiles: seeded generators of trajectory specs, fitted to traces or set by hand."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import pandas as pd
import pyarrow as pa

from prorsa.errors import ConfigError, InputError
from prorsa.workload.distributions import LogNormal, PerTurnLogNormal
from prorsa.workload.spec import TrajectorySpec

# Tool calls shorter than this are treated as "no wait" when fitting latency.
_ZERO_TOOL_S = 0.05


@dataclass
class TaskProfile:
    """Distributions of one task's trajectories.

    Attributes:
        name: registry name, also the spec's ``task``.
        turns: turns per trajectory (rounded, clipped).
        prompt_tokens: turn-0 new tokens (shared by a GRPO group: one prompt, n samples).
        new_tokens: tokens appended per later turn (tool observations, user messages).
        output_tokens: tokens decoded per turn.
        tool_latency_s: tool time between turns, with ``tool_zero_fraction`` of calls instant.
        group_rho: correlation of the turn count and length levels inside a GRPO group.
        max_context_tokens: a trajectory stops once its context would exceed this.
        sources: where each number came from (a fitted trace, a paper, a default).
    """

    name: str
    turns: LogNormal
    prompt_tokens: LogNormal
    new_tokens: PerTurnLogNormal
    output_tokens: PerTurnLogNormal
    tool_latency_s: LogNormal
    tool_zero_fraction: float = 0.0
    group_rho: float = 0.5
    max_context_tokens: int = 131_072
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.group_rho <= 1:
            raise ConfigError(f"profile {self.name}: group_rho must be in [0, 1]")
        if not 0 <= self.tool_zero_fraction <= 1:
            raise ConfigError(f"profile {self.name}: tool_zero_fraction must be in [0, 1]")
        if self.max_context_tokens <= 0:
            raise ConfigError(f"profile {self.name}: max_context_tokens must be > 0")

    # ------------------------------------------------------------------ sampling
    def sample(
        self, n: int, seed: int, *, group_size: int = 1, id_prefix: str | None = None
    ) -> list[TrajectorySpec]:
        """Draw ``n`` trajectory specs in GRPO groups of ``group_size`` (last may be smaller)."""
        if n < 0 or group_size < 1:
            raise ConfigError("n must be >= 0 and group_size >= 1")
        rng = np.random.default_rng(seed)
        prefix = id_prefix or f"{self.name}-s{seed}"
        specs: list[TrajectorySpec] = []
        for g, start in enumerate(range(0, n, group_size)):
            members = min(group_size, n - start)
            specs += self._sample_group(rng, members, f"{prefix}-g{g:05d}", start, prefix)
        return specs

    def _sample_group(
        self, rng: np.random.Generator, members: int, group_id: str, start: int, prefix: str
    ) -> list[TrajectorySpec]:
        prompt = round(float(self.prompt_tokens.draw(rng.standard_normal(1))[0]))
        shared = np.sqrt(self.group_rho)
        own = np.sqrt(1.0 - self.group_rho)
        z_group = rng.standard_normal(3)
        out = []
        for m in range(members):
            z = shared * z_group + own * rng.standard_normal(3)
            turns = round(float(self.turns.draw(z[:1])[0]))
            turns = max(turns, 1)
            new = self.new_tokens.draw(z[1], turns, rng)
            new[0] = prompt
            output = self.output_tokens.draw(z[2], turns, rng)
            tool = self.tool_latency_s.draw(rng.standard_normal(turns))
            tool[rng.random(turns) < self.tool_zero_fraction] = 0.0
            new_i = np.maximum(np.rint(new).astype(np.int64), 0)
            out_i = np.maximum(np.rint(output).astype(np.int64), 1)
            turns = _turns_within_context(new_i, out_i, self.max_context_tokens)
            out.append(
                TrajectorySpec(
                    trajectory_id=f"{prefix}-{start + m:06d}",
                    group_id=group_id,
                    task=self.name,
                    new_tokens=new_i[:turns],
                    output_tokens=out_i[:turns],
                    tool_latency_s=tool[:turns],
                    shared_prompt_tokens=prompt,
                )
            )
        return out

    # ------------------------------------------------------------------- fitting
    def fit(
        self,
        trace: pa.Table | pd.DataFrame | str | os.PathLike[str],
        *,
        allow_partial: bool = False,
    ) -> TaskProfile:
        """Fit every distribution to an imported trace (events or a turn table); returns self.

        Events of a run that did not complete (see
        :func:`prorsa.telemetry.manifest.check_complete`) are refused unless
        ``allow_partial``: cut-short trajectories would bias the turn counts.
        """
        turns = _turn_frame(trace, allow_partial=allow_partial)
        per_traj = turns.groupby(["run_id", "trajectory_id"], sort=False)
        counts = per_traj.size().to_numpy()
        if len(counts) < 2:
            raise InputError(
                "need at least two trajectories to fit a profile",
                source=_trace_name(trace),
                field="trajectory_id",
            )
        appended = _appended_tokens(turns)
        later = turns["turn"].to_numpy() > 0
        self.turns = LogNormal.fit(counts)
        self.prompt_tokens = LogNormal.fit(turns.loc[~later, "context_tokens"].to_numpy())
        traj_key = (turns["run_id"] + "/" + turns["trajectory_id"]).to_numpy()
        self.new_tokens = PerTurnLogNormal.fit(
            appended[later], traj_key[later], turns["turn"].to_numpy()[later]
        )
        self.output_tokens = PerTurnLogNormal.fit(
            turns["output_tokens"].to_numpy(), traj_key, turns["turn"].to_numpy()
        )
        tool = turns["tool_latency_s"].to_numpy(dtype=float)
        tool = tool[np.isfinite(tool)]
        self.tool_zero_fraction = float((tool < _ZERO_TOOL_S).mean()) if len(tool) else 1.0
        positive = tool[tool >= _ZERO_TOOL_S]
        self.tool_latency_s = LogNormal.fit(positive) if len(positive) else LogNormal(0, 0, 0, 0)
        self.max_context_tokens = int(max(turns["context_tokens"].max(), 1))
        groups = turns.loc[turns["group_id"] != "", "group_id"]
        self.sources = {
            "fit": f"fitted to {len(counts)} trajectories / {len(turns)} turns",
            "new_tokens": "context growth between turns minus the previous turn's output",
            "group_rho": (
                "kept at its prior value: the trace has no multi-member GRPO groups"
                if groups.empty or groups.value_counts().max() < 2
                else "kept at its prior value"
            ),
        }
        return self

    # --------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        data = asdict(self)
        data["kind"] = "task-profile"
        return data

    @classmethod
    def from_dict(cls, data: dict, *, source: str | None = None) -> TaskProfile:
        """The profile ``to_dict`` wrote; InputError naming ``source`` (its file), the
        record (a distribution) and the field for anything missing, unknown or not a
        finite number."""
        if not isinstance(data, dict):
            raise InputError(
                f"a task profile is a JSON object, got {type(data).__name__}", source=source
            )
        data = dict(data)
        data.pop("kind", None)
        if not isinstance(data.get("name"), str) or not data["name"]:
            raise InputError("missing or not a string", source=source, field="name")
        kinds = {
            "turns": LogNormal,
            "prompt_tokens": LogNormal,
            "new_tokens": PerTurnLogNormal,
            "output_tokens": PerTurnLogNormal,
            "tool_latency_s": LogNormal,
        }
        parts = {
            name: _distribution(data.pop(name, None), kind, name, source)
            for name, kind in kinds.items()
        }
        for name in ("tool_zero_fraction", "group_rho", "max_context_tokens"):
            if name in data:
                _finite(data[name], source, None, name)
        unknown = sorted(
            set(data) - {"name", "tool_zero_fraction", "group_rho", "max_context_tokens", "sources"}
        )
        if unknown:
            raise InputError("unknown field", source=source, field=unknown[0])
        if not isinstance(data.get("sources", {}), dict):
            raise InputError("must be an object", source=source, field="sources")
        try:
            return cls(**parts, **data)
        except ConfigError as exc:
            raise InputError(str(exc), source=source) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON (whole or not at all: a failed write keeps the old file)."""
        from prorsa.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


def _finite(value: object, source: str | None, record: str | None, name: str) -> float:
    """``value`` as a float if it is a finite JSON number; InputError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise InputError(
            f"must be a finite number, got {value!r}", source=source, record=record, field=name
        )
    return float(value)


def _distribution(data: object, kind: type, record: str, source: str | None):
    """One distribution of a profile file (its fields all finite numbers)."""
    if not isinstance(data, dict):
        raise InputError("missing or not an object", source=source, field=record)
    names = [f.name for f in fields(kind)]
    for name in names:
        if name in data:
            _finite(data[name], source, record, name)
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise InputError("unknown field", source=source, record=record, field=unknown[0])
    try:
        return kind(**data)
    except TypeError:  # a required field missing
        missing = next(n for n in names if n not in data)
        raise InputError("missing", source=source, record=record, field=missing) from None
    except ConfigError as exc:
        raise InputError(str(exc), source=source, record=record) from None


@dataclass
class MixtureProfile:
    """A blend of task profiles; each GRPO group draws one component by weight."""

    name: str
    components: list[tuple[TaskProfile, float]]
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.components or any(w <= 0 for _, w in self.components):
            raise ConfigError(f"mixture {self.name}: needs components with positive weights")

    def sample(
        self, n: int, seed: int, *, group_size: int = 1, id_prefix: str | None = None
    ) -> list[TrajectorySpec]:
        rng = np.random.default_rng(seed)
        weights = np.array([w for _, w in self.components], dtype=float)
        n_groups = -(-n // group_size) if n else 0
        picks = rng.choice(len(self.components), size=n_groups, p=weights / weights.sum())
        prefix = id_prefix or f"{self.name}-s{seed}"
        specs: list[TrajectorySpec] = []
        for g, comp in enumerate(picks):
            members = min(group_size, n - g * group_size)
            profile = self.components[comp][0]
            sub_seed = int(rng.integers(2**31))
            specs += profile.sample(
                members, sub_seed, group_size=members, id_prefix=f"{prefix}-g{g:05d}"
            )
        return specs

    def to_dict(self) -> dict:
        return {
            "kind": "mixture",
            "name": self.name,
            "components": [{"profile": p.name, "weight": w} for p, w in self.components],
            "sources": self.sources,
        }


def _turns_within_context(new: np.ndarray, out: np.ndarray, max_context: int) -> int:
    context = np.cumsum(new) + np.concatenate([[0], np.cumsum(out)[:-1]])
    fits = np.flatnonzero(context + out <= max_context)
    # Keep at least the first turn: a prompt over the limit is the profile's clip's job.
    return int(fits[-1] + 1) if len(fits) else 1


def _turn_frame(
    trace: pa.Table | pd.DataFrame | str | os.PathLike[str], *, allow_partial: bool = False
) -> pd.DataFrame:
    from prorsa.telemetry.manifest import check_complete
    from prorsa.telemetry.reader import read_telemetry
    from prorsa.telemetry.views import turn_table

    location = None
    if isinstance(trace, (str, os.PathLike)):
        location = trace
        trace, _ = read_telemetry(trace, validate=True)
    if isinstance(trace, pd.DataFrame) and "tool_latency_s" in trace.columns:
        return trace  # a turn table: completeness was the caller's to check
    check_complete(trace, allow_partial=allow_partial, location=location)
    turns = turn_table(trace)
    if turns.empty:
        raise InputError("trace holds no trajectory turns", source=_trace_name(location))
    return turns


def _trace_name(trace: object) -> str:
    """The file a trace came from, or ``trace`` for one given as a table."""
    return str(trace) if isinstance(trace, str | os.PathLike) else "trace"


def _appended_tokens(turns: pd.DataFrame) -> np.ndarray:
    """Tokens added to the context before each turn other than the previous output.

    Clamped at zero: some agents drop reasoning tokens from the next context, so the
    context can grow by less than the previous turn's output.
    """
    ordered = turns.sort_values(["run_id", "trajectory_id", "turn"], kind="stable")
    grouped = ordered.groupby(["run_id", "trajectory_id"], sort=False)
    prev_context = grouped["context_tokens"].shift(1)
    prev_output = grouped["output_tokens"].shift(1)
    appended = (ordered["context_tokens"] - prev_context - prev_output).clip(lower=0)
    appended = appended.fillna(ordered["context_tokens"])
    return appended.reindex(turns.index).to_numpy(dtype=float)


def profile_from_trace(
    name: str,
    trace: pa.Table | pd.DataFrame | str | os.PathLike[str],
    *,
    allow_partial: bool = False,
    **overrides: object,
) -> TaskProfile:
    """A new :class:`TaskProfile` fitted to ``trace``; ``overrides`` replace fitted fields.

    A partial run is refused unless ``allow_partial`` (see :meth:`TaskProfile.fit`).
    """
    unit = LogNormal(0.0, 0.0, 1.0, 1.0)
    per_turn = PerTurnLogNormal(0.0, 0.0, 0.0, 1.0, 1.0)
    profile = TaskProfile(name, unit, unit, per_turn, per_turn, unit).fit(
        trace, allow_partial=allow_partial
    )
    for key, value in overrides.items():
        if not hasattr(profile, key):
            raise ConfigError(f"unknown profile field '{key}'")
        setattr(profile, key, value)
    profile.__post_init__()
    return profile
