"""One cell of a sweep: a single simulation, run in a worker process.

A :class:`Cell` composes the run configurations every entry point shares
(:class:`~prorsa.workload.config.WorkloadConfig`,
:class:`~prorsa.runtime.cluster.config.ClusterConfig`,
:class:`~prorsa.runtime.cluster.control.ControlConfig`) with the regime map's
:class:`~prorsa.experiments.knobs.WorkloadKnobs`, so a default lives in one place only.

Workers return small, picklable summaries (metrics and a few time series for plots),
never the full telemetry, so a sweep can run in parallel processes cheaply. A summary's
``"cell"`` is :meth:`Cell.to_dict` (nested by config); :meth:`Cell.from_dict` also reads
the flat dicts that results files written before the configs were shared hold.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prorsa.errors import ConfigError
from prorsa.experiments.knobs import WorkloadKnobs
from prorsa.policy.types import ROLES, SWITCHING
from prorsa.runtime.cluster.config import ClusterConfig
from prorsa.runtime.cluster.control import ControlConfig
from prorsa.runtime.sim.metrics import role_intervals
from prorsa.telemetry.views import trajectory_table
from prorsa.workload.config import WorkloadConfig

#: Which part of a cell each field name belongs to (:meth:`Cell.of`, :meth:`Cell.changed`).
_PARTS: dict[str, type] = {
    "work": WorkloadConfig,
    "cluster": ClusterConfig,
    "control": ControlConfig,
    "knobs": WorkloadKnobs,
}
_OWNER: dict[str, str] = {
    f.name: part for part, cls in _PARTS.items() for f in dataclasses.fields(cls)
}
_OWN = ("series", "record")
#: Old flat results files named the cluster size ``engines`` and gave other cluster
#: fields as ``cluster_overrides``.
_LEGACY_RENAMES = {"engines": "num_slots"}


@dataclass(frozen=True)
class Cell:
    """One simulation: workload x cluster x control loop, the workload knobs, and what
    the summary keeps (plain dataclasses, so it pickles to workers)."""

    work: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    knobs: WorkloadKnobs = field(default_factory=WorkloadKnobs)
    series: bool = True  # keep time series for plots
    # Lifecycle telemetry; runs with a forecaster or time series record regardless.
    record: bool = True

    # ------------------------------------------------------------- building
    @classmethod
    def of(cls, **fields: Any) -> Cell:
        """A cell from flat field names of any of its configs (``seed``, ``num_slots``,
        ``policy``, ``tool_scale``, ``series`` ...); the rest keep the configs' defaults.
        A ``trace`` given without a ``scenario`` replaces the default scenario."""
        if fields.get("trace") is not None and "scenario" not in fields:
            fields["scenario"] = None
        return cls().changed(**fields)

    def changed(self, **fields: Any) -> Cell:
        """A copy with the named fields (flat names, as in :meth:`of`) changed."""
        parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        own: dict[str, Any] = {}
        for name, value in fields.items():
            if name in _OWN:
                own[name] = value
            elif name in _OWNER:
                parts[_OWNER[name]][name] = value
            else:
                raise ConfigError(f"a cell has no field '{name}'", hint=_closest(name))
        changes = {
            part: dataclasses.replace(getattr(self, part), **values)
            for part, values in parts.items()
            if values
        }
        return dataclasses.replace(self, **changes, **own)

    # ------------------------------------------------------------- identity
    @property
    def workload(self) -> str:
        """The scenario or trace name."""
        return self.work.label

    @property
    def mode(self) -> str:
        return self.work.mode

    @property
    def policy(self) -> str:
        return self.control.policy

    @property
    def seed(self) -> int:
        return self.work.seed

    def to_dict(self) -> dict[str, Any]:
        """Plain values, nested by config (what results files store)."""
        return dataclasses.asdict(self)

    def key(self) -> str:
        """Stable 16-hex-digit key: a hash of :meth:`to_dict` and of what the run reads
        besides (:meth:`inputs`), so a sweep, which skips cells whose key is already in
        its results file, reuses a result only from the same code, data and models."""
        from prorsa import __version__

        inputs = self.inputs()
        fields = self.to_dict()
        fields["work"]["trace"] = inputs.pop("trace")
        text = json.dumps(
            {"version": __version__, **inputs, "type": "Cell", "fields": fields},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def inputs(self) -> dict[str, str | None]:
        """What a run of this cell reads besides its settings, by content: the simulator
        (its code and data: :func:`~prorsa.runtime.sim.version.simulator_hash`), the
        trained forecaster, the RL agent (a retrained one is another result) and the
        trace (named inside ``datasets/``, hashed with the simulator, so the same in
        every checkout; any other by its content)."""
        from prorsa.runtime.sim.version import model_fingerprint, simulator_hash

        forecaster = self.control.forecaster
        agent = str(self.control.policy_params.get("model", "rl-ppo"))
        return {
            "simulator": simulator_hash(),
            "model": model_fingerprint(forecaster) if forecaster else None,
            "agent": _agent_identity(agent) if self.control.policy == "rl" else None,
            "trace": _trace_identity(self.work.trace),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        """The cell a results file describes: :meth:`to_dict`'s nested form, or the flat
        form of files written before the run configs were shared."""
        if "work" not in data:
            return cls._from_flat(data)
        try:
            return cls(
                **{part: kind(**data.get(part, {})) for part, kind in _PARTS.items()},
                **{name: data[name] for name in _OWN if name in data},
            )
        except TypeError as exc:
            raise ConfigError(f"not a cell description: {exc}") from None

    @classmethod
    def _from_flat(cls, data: dict[str, Any]) -> Cell:
        fields = {_LEGACY_RENAMES.get(k, k): v for k, v in data.items()}
        fields.update(fields.pop("cluster_overrides", None) or {})
        return cls.of(**fields)


def _closest(name: str) -> str:
    import difflib

    cli_names = {
        f.metadata["cli"].replace("-", "_"): f.name
        for cls in _PARTS.values()
        for f in dataclasses.fields(cls)
        if "cli" in f.metadata
    }
    if name in cli_names:  # the option's name (--engines) for the field's (num_slots)
        return f"did you mean '{cli_names[name]}'?"
    close = difflib.get_close_matches(name, [*_OWNER, *_OWN], n=1)
    if close:
        return f"did you mean '{close[0]}'?"
    return "fields of WorkloadConfig, ClusterConfig, ControlConfig or WorkloadKnobs"


def cell_of(run: dict[str, Any]) -> Cell:
    """The cell of a summary (``run["cell"]``), old flat files included."""
    return Cell.from_dict(run["cell"])


def run_cell(cell: Cell) -> dict:
    """Simulate ``cell`` and summarise it (top-level function: picklable for pools)."""
    from prorsa.experiments.knobs import simulate_with_knobs
    from prorsa.policy import POLICIES
    from prorsa.runtime.sim.scenario import RunRequest

    needs_events = cell.series or cell.control.forecaster is not None
    needs_events = needs_events or POLICIES.get(cell.policy).needs_forecast
    request = RunRequest(
        # Copies: the simulation must not share mutable parts with the caller's cell.
        work=dataclasses.replace(cell.work),
        cluster=dataclasses.replace(cell.cluster),
        control=dataclasses.replace(cell.control, policy_params=dict(cell.control.policy_params)),
        record=cell.record or needs_events,
        run_id=f"{cell.workload}-{cell.mode}-{cell.policy}-s{cell.seed}",
    )
    started = time.perf_counter()
    result = simulate_with_knobs(request, cell.knobs, keep_forecasts=cell.series)
    wall_s = time.perf_counter() - started
    summary = {
        "cell": cell.to_dict(),
        "metrics": result.metrics,
        "wall_s": wall_s,
        "objective": objective(result.metrics),
    }
    if cell.series:
        summary["series"] = _series(result)
    return summary


def objective(metrics: dict) -> float:
    """Lower is better: makespan (sync) or seconds per trajectory (async)."""
    if metrics["mode"] == "sync":
        return float(metrics["makespan_s"])
    return 3600.0 / max(float(metrics["throughput_traj_per_hour"]), 1e-9)


def _series(result) -> dict:
    """Allocation, demand and forecast over time, and completion times (for plots)."""
    cluster = result.cluster
    end = float(result.metrics["end_s"])
    grid = np.arange(0.0, end + 1.0, max(end / 400.0, 1.0))
    gpus = {role: np.zeros_like(grid) for role in (*ROLES, SWITCHING)}
    for t0, t1, role, n in role_intervals(cluster, float("inf")):
        gpus[role][(grid >= t0) & (grid < t1)] += n
    table = result.telemetry.to_pandas()
    kind = table["kind"].astype(str)
    queued = table[kind == "prefill_queued"]
    demand, _ = np.histogram(
        queued["time"], bins=np.append(grid, grid[-1] + 1.0), weights=queued["new_tokens"]
    )
    step = grid[1] - grid[0] if len(grid) > 1 else 1.0
    trajs = trajectory_table(result.telemetry)
    completion = np.sort(trajs.loc[trajs["done"], "completion_s"].to_numpy(dtype=float))
    forecasts = []
    for d in result.decisions:
        if d.forecast is not None and 5.0 in d.forecast.horizons_s:
            forecasts.append((d.time_s, d.forecast.at("prefill_tokens", 5.0) / 5.0))
    return {
        "time_s": grid.tolist(),
        "gpus": {k: v.tolist() for k, v in gpus.items()},
        "prefill_tokens_per_s": (demand / step).tolist(),
        "forecast_prefill_tokens_per_s": forecasts,
        "completion_s": completion.tolist(),
        "decisions": [
            {"time_s": d.time_s, "switches": d.switches, "reason": d.reason}
            for d in result.decisions
            if d.switches
        ][:500],
    }


def to_json(obj: object) -> str:
    return json.dumps(obj, default=float)


def _trace_identity(path: str | None) -> str | None:
    """``path`` relative to ``datasets/`` when it lies there, else the SHA-256 of its
    content (a file, or every file of a folder): a trace re-imported to the same path,
    or another file reached by the same relative path, is another result."""
    if not path:
        return path
    from prorsa.workload.scenarios import datasets_dir

    resolved = Path(path).resolve()
    try:
        return "datasets:" + resolved.relative_to(datasets_dir().resolve()).as_posix()
    except (ValueError, OSError, ConfigError):
        pass
    if resolved.is_dir():
        files = sorted(p for p in resolved.rglob("*") if p.is_file())
    else:
        files = [resolved]
    try:
        return "sha256:" + _files_hash(files)
    except OSError:
        return path  # missing: the run will say so


def _agent_identity(name: str) -> str | None:
    """SHA-256 over an RL agent folder's manifest, weights and opening table (what
    :class:`~prorsa.policy.rl.RLPolicy` loads), or None where there is none."""
    from prorsa.policy.rl import resolve_model_dir

    folder = resolve_model_dir(name)
    files = [folder / n for n in ("manifest.json", "model.zip", "opening.txt")]
    files = [f for f in files if f.is_file()]
    try:
        return _files_hash(files) if files else None
    except OSError:
        return None


def _files_hash(files: list[Path]) -> str:
    """SHA-256 over ``files``' contents, read again only when a size or mtime changed."""
    return _content_hash(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=64)
def _content_hash(files: tuple[tuple[str, int, int], ...]) -> str:
    """SHA-256 over the files' own digests, in order (cached while their size and mtime
    stay)."""
    from prorsa.io import file_sha256

    return hashlib.sha256("".join(file_sha256(name) for name, _, _ in files).encode()).hexdigest()
