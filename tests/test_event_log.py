"""EventLog: sealed chunks, the packed tail and odd values read back exactly as appended."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prorsa.telemetry.columns import KIND_CODE, EventLog


def _fill(log: EventLog, n: int, seed: int = 0, *, seal_every: int = 0) -> list[tuple]:
    """Append ``n`` events (some with detail, some through row_writer); returns what was
    appended as ``(time, key, turn, kind, engine, ctx, new, cached, out, detail)``."""
    rng = np.random.default_rng(seed)
    pack, write = log.row_writer()
    kinds = list(KIND_CODE.values())
    appended = []
    for i in range(n):
        key = log.key(f"t{i % 13}", f"g{i % 3}", "swe")
        row = (
            float(rng.uniform(0, 500)),
            key,
            int(rng.integers(0, 40)),
            int(rng.choice(kinds)),
            int(rng.integers(-1, 64)),
            int(rng.integers(0, 200_000)),
            int(rng.integers(0, 9000)),
            int(rng.integers(0, 9000)),
            int(rng.integers(0, 3000)),
        )
        detail = '{"preempted":true}' if i % 17 == 0 else ""
        if detail or i % 2:
            log.append(*row, detail)
        else:
            write(pack(*row))
        appended.append((*row, detail))
        if seal_every and i % seal_every == seal_every - 1:
            log.seal()
    return appended


@pytest.mark.parametrize("seal_every", [0, 7, 100])
def test_sealed_and_unsealed_logs_read_back_the_same(seal_every):
    plain, sealed = EventLog("r"), EventLog("r")
    rows = _fill(plain, 333)
    assert _fill(sealed, 333, seal_every=seal_every) == rows
    assert len(plain) == len(sealed) == 333
    assert plain.to_table().equals(sealed.to_table())
    for start, stop in [(0, None), (5, 6), (6, 213), (100, 333), (332, 400), (50, 20)]:
        a, b = plain.batch(start, stop), sealed.batch(start, stop)
        assert list(a.rows()) == list(b.rows())
        assert a.context_tokens.dtype == b.context_tokens.dtype == np.int64
        assert a.details == b.details
        assert plain.to_table(start, stop).equals(sealed.to_table(start, stop))
    table = sealed.to_table()
    got = list(
        zip(
            table.column("time").to_pylist(),
            table.column("context_tokens").to_pylist(),
            table.column("detail").to_pylist(),
            strict=True,
        )
    )
    assert got == [(r[0], r[5], r[9]) for r in rows]


def test_batch_columns_are_copies_a_caller_may_change():
    log = EventLog("r")
    _fill(log, 50)
    log.seal()
    batch = log.batch()
    batch.context_tokens[3] = -5
    batch.time[0] = -1.0
    again = log.batch()
    assert again.context_tokens[3] != -5 and again.time[0] != -1.0


def test_the_table_shares_sealed_numeric_columns():
    log = EventLog("r")
    _fill(log, 200)
    log.seal()
    chunk = log._chunks[0]
    table = log.to_table()
    time_buffer = table.column("time").chunk(0).buffers()[1]
    assert time_buffer.address == chunk[0].ctypes.data
    assert table.column("turn").chunk(0).buffers()[1].address == chunk[2].ctypes.data


def test_odd_values_are_kept_as_given_and_fail_only_when_read():
    log = EventLog("r")
    key = log.key("t")
    log.append(1.0, key, 0, KIND_CODE["decode_start"], 3, 10)
    log.append(2.0, key, 0, KIND_CODE["decode_end"], "not a number", 10)  # type: ignore[arg-type]
    log.append(3.0, key, 1, KIND_CODE["decode_start"], 4, 11.0)  # a float token count
    assert len(log) == 3
    log.seal()  # odd rows are never sealed (their conversion belongs to the reader)
    with pytest.raises(ValueError):
        log.batch()
    assert log.batch(0, 1).engine_id.tolist() == [3]
    assert log.batch(2, 3).context_tokens.tolist() == [11]


def test_token_counts_beyond_int32_are_named_when_the_table_is_built():
    log = EventLog("big")
    key = log.key("t")
    log.append(0.0, key, 0, KIND_CODE["decode_end"], 1, 2**31)
    log.seal()
    assert log.batch().context_tokens.tolist() == [2**31]
    with pytest.raises(OverflowError, match=r"event 0 .*context_tokens=2147483648"):
        log.to_table()


def test_empty_log_reads_empty():
    log = EventLog("r")
    assert log.to_table().num_rows == 0 and len(log.batch()) == 0
    assert isinstance(log.to_table(), pa.Table)


@pytest.mark.parametrize("seal_every", [0, 7, 100])
def test_rows_let_go_are_refused_and_the_rest_read_back_the_same(seal_every):
    whole, trimmed = EventLog("r"), EventLog("r")
    _fill(whole, 333)
    _fill(trimmed, 333, seal_every=seal_every)
    let_go = trimmed.forget_before(150)
    first = trimmed.first_row
    # Sealed rows go a whole chunk at a time; unsealed ones exactly.
    assert let_go == first == {0: 150, 7: 147, 100: 100}[seal_every]
    assert len(trimmed) == 333 and trimmed.keys == whole.keys
    assert trimmed.to_table(first).equals(whole.to_table(first))
    assert trimmed.rows(first, 200) == whole.rows(first, 200)
    with pytest.raises(ValueError, match="let go"):
        trimmed.batch(first - 1)
    # Numbering goes on; an odd value among the rows let go no longer fails a read.
    for log in (whole, trimmed):
        log.append(1.0, 1, 0, KIND_CODE["decode_end"], 0, "odd")
        _fill(log, 40, seed=1)
    assert trimmed.forget_before(334) == 334 - first
    assert trimmed.to_table(334).equals(whole.to_table(334))
    assert trimmed.forget_before(10**9) == len(trimmed) - 334 and trimmed.first_row == 374
    assert trimmed.to_table(374).num_rows == 0
