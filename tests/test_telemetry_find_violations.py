"""``find_violations`` against a plain pandas reading of the same rules, on tables with
every kind of fault, several chunks and dictionary-encoded ids."""

from __future__ import annotations

import math
import random

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from prorsa.telemetry import events_to_table, find_violations
from prorsa.telemetry.schema import CLUSTER_EVENT_KINDS, EVENT_KIND_SET, FIELDS, TOKEN_FIELDS
from tests.conftest import make_two_turn_events


def reference(table: pa.Table) -> list[tuple[int, str, str]]:
    """The rules read row by row through pandas (the validator's earlier implementation)."""
    df = table.select(list(FIELDS)).to_pandas()
    problems = []
    for name in FIELDS:
        problems += [(int(i), name, "missing value") for i in np.flatnonzero(df[name].isna())]
    kind = df["kind"].astype(object)
    unknown = (kind.notna() & ~kind.isin(EVENT_KIND_SET)).to_numpy()
    problems += [
        (int(i), "kind", f"unknown kind {kind.iloc[i]!r}") for i in np.flatnonzero(unknown)
    ]
    time = pd.to_numeric(df["time"], errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(time) | (time < 0)
    problems += [(int(i), "time", "must be a finite number >= 0") for i in np.flatnonzero(bad)]
    for name in (*TOKEN_FIELDS, "turn"):
        values = pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=float)
        problems += [
            (int(i), name, "must be a non-negative integer") for i in np.flatnonzero(~(values >= 0))
        ]
    sub = df.loc[~kind.isin(CLUSTER_EVENT_KINDS).to_numpy(), ["run_id", "trajectory_id"]]
    sub = sub.assign(time=pd.to_numeric(df["time"], errors="coerce"), turn=df["turn"])
    keys = [sub["run_id"], sub["trajectory_id"]]
    for column, reason in (
        ("time", "time goes backwards within its trajectory"),
        ("turn", "turn out of order within its trajectory"),
    ):
        earlier = sub.groupby(["run_id", "trajectory_id"])[column].cummax().groupby(keys).shift()
        problems += [
            (int(i), column, reason) for i in sub.index[(sub[column] < earlier).to_numpy()]
        ]
    return sorted(problems)


def faulty_table(seed: int) -> pa.Table:
    rng = random.Random(seed)
    events = []
    for n in range(6):
        events += make_two_turn_events(f"t{n}", t0=rng.uniform(0, 3))
    events.sort(key=lambda e: e.time)  # interleaved trajectories
    rows = [e.as_row() for e in events]
    columns = {name: [row[i] for row in rows] for i, name in enumerate(FIELDS)}
    n = len(rows)
    for _ in range(rng.randint(0, 8)):
        i, fault = rng.randrange(n), rng.randrange(9)
        if fault == 0:
            columns["time"][i] = max(0.0, columns["time"][i] - rng.uniform(0, 2))
        elif fault == 1:
            columns["time"][i] = rng.choice([math.nan, -1.0, math.inf, None])
        elif fault == 2:
            columns["turn"][i] = rng.choice([0, -1, None])
        elif fault == 3:
            columns["kind"][i] = rng.choice(["teleport", None, "allocation"])
        elif fault == 4:
            columns[rng.choice(TOKEN_FIELDS)][i] = rng.choice([-5, None])
        elif fault == 5:
            columns[rng.choice(["run_id", "trajectory_id"])][i] = None
        elif fault == 6:
            columns["trajectory_id"][i] = rng.choice(["t0", "t1", "t9"])
        elif fault == 7:
            columns["time"][i] = columns["time"][i] + rng.uniform(0, 5)
        else:
            columns["task"][i] = None
    types = {f.name: f.type for f in events_to_table(events[:1]).schema}
    arrays = {
        name: pa.array(values, types[name], from_pandas=True) for name, values in columns.items()
    }
    if seed % 3 == 1:  # ids dictionary-encoded, as ship reads them
        arrays["run_id"] = arrays["run_id"].dictionary_encode()
        arrays["trajectory_id"] = arrays["trajectory_id"].dictionary_encode()
    table = pa.table(arrays)
    cut = rng.randrange(1, n)  # more than one chunk
    return pa.concat_tables([table.slice(0, cut), table.slice(cut)])


@pytest.mark.parametrize("seed", range(60))
def test_the_same_violations_as_the_pandas_reading(seed):
    table = faulty_table(seed)
    assert table.column("time").num_chunks == 2
    assert find_violations(table) == reference(table)


def test_a_clean_table_has_none_and_limit_keeps_the_first():
    clean = faulty_table(0).slice(0, 0)
    assert find_violations(clean) == []
    table = events_to_table(make_two_turn_events())
    times = table.column("time").to_pylist()
    times[3], times[6] = -1.0, 0.0
    bad = table.set_column(0, "time", pa.array(times, pa.float64()))
    assert find_violations(bad, limit=1) == [(3, "time", "must be a finite number >= 0")]
    assert len(find_violations(bad)) > 1


def test_text_columns_are_read_as_numbers_where_they_parse():
    table = events_to_table(make_two_turn_events())
    text = pa.array([str(t) for t in table.column("time").to_pylist()[:-1]] + ["soon"])
    table = table.set_column(0, "time", text)
    assert find_violations(table) == reference(table)
    assert find_violations(table)[0] == (table.num_rows - 1, "time", "must be a finite number >= 0")


def test_a_row_past_a_missing_time_is_still_held_to_the_earlier_maximum():
    # 5, NaN, 4, 4.5: no row is below the one just before it, yet 4.5 is below 5.
    table = events_to_table(make_two_turn_events())
    times = table.column("time").to_pylist()
    times[4:8] = [50.0, math.nan, 40.0, 45.0]
    times[8:] = [60.0 + i for i in range(len(times) - 8)]
    table = table.set_column(0, "time", pa.array(times, pa.float64()))
    found = find_violations(table)
    assert found == reference(table)
    assert (7, "time", "time goes backwards within its trajectory") in found
