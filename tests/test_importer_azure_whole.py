"""The Azure importer's whole-file read gives the line-by-line reader's events exactly, and
leaves every unusual file to that reader (which names the line and field)."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest

from prorsa.errors import InputError
from prorsa.telemetry.importers import azure, import_trace

SLICE = Path(__file__).resolve().parents[1] / "datasets" / "traces" / "azure-code-2023-slice.csv"


def _lines() -> list[str]:
    return SLICE.read_text().splitlines()[:301]


def _both(path: Path, monkeypatch) -> tuple:
    """(whole-file result, whether the whole-file read took it, line-by-line result)."""
    took: list[bool] = []
    whole = azure._read_whole

    def spy(p, out):
        took.append(whole(p, out))
        return took[-1]

    monkeypatch.setattr(azure, "_read_whole", spy)
    fast = import_trace(path, "azure", skip_bad=True)
    monkeypatch.setattr(azure, "_read_whole", lambda p, out: False)
    slow = import_trace(path, "azure", skip_bad=True)
    return fast, all(took), slow


def _variants(lines: list[str]) -> dict[str, bytes]:
    head, rows = lines[0], lines[1:]
    reordered = ["GeneratedTokens,Extra,TIMESTAMP,ContextTokens"] + [
        f"{g},x,{t},{c}" for t, c, g in (r.split(",") for r in rows)
    ]
    return {
        "lf": ("\n".join(lines) + "\n").encode(),
        "crlf": ("\r\n".join(lines) + "\r\n").encode(),  # as the published files
        "no final newline": "\n".join(lines).encode(),
        "columns reordered, one extra": ("\n".join(reordered) + "\n").encode(),
        "spaces around values": (
            "\n".join([head] + [r.replace(",", " , ") for r in rows])
        ).encode(),
        "T separator, 1-digit fraction": (
            "\n".join(
                [head] + [r.replace(" ", "T", 1) for r in rows[:5]] + ["2023-11-16 19:00:00.5,1,2"]
            )
        ).encode(),
    }


@pytest.mark.parametrize("name", list(_variants(_lines())))
def test_a_clean_file_is_read_whole_with_the_same_events(name, tmp_path, monkeypatch):
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_bytes(_variants(_lines())[name])
    fast, took_whole, slow = _both(path, monkeypatch)
    assert took_whole
    assert fast.table.equals(slow.table)
    assert (fast.trajectories, fast.turns, fast.derived) == (
        slow.trajectories,
        slow.turns,
        slow.derived,
    )
    assert fast.table.column("trajectory_id")[0].as_py() == "AzureLLMInferenceTrace_code-r00000"


def _damaged(lines: list[str]) -> dict[str, str]:
    rows = lines[1:]
    swapped = rows[:]
    swapped[10], swapped[11] = swapped[11], swapped[10]
    return {
        "blank line": "\n".join([lines[0], *rows[:5], "", *rows[5:]]),
        "negative count": "\n".join(
            [lines[0], *rows[:5], rows[5].rsplit(",", 1)[0] + ",-3", *rows[6:]]
        ),
        "out of order": "\n".join([lines[0], *swapped]),
        "bad timestamp": "\n".join([lines[0], *rows[:5], "2023-02-30 10:00:00,1,2", *rows[6:]]),
        "placeholder year": "\n".join([lines[0], "1970-01-01 00:00:00,1,2", *rows]),
        "count too large": "\n".join(
            [lines[0], *rows[:5], rows[5].rsplit(",", 1)[0] + ",9999999999"]
        ),
        "short line": "\n".join([lines[0], *rows[:5], "2023-11-16 19:00:00,5", *rows[6:]]),
        "byte-order mark": "\ufeff" + "\n".join(lines),
        "field over the csv limit": "\n".join(
            [lines[0] + ",Note", *(r + ",x" for r in rows[:5]), rows[5] + "," + "y" * 200_000]
        ),
    }


@pytest.mark.parametrize("name", list(_damaged(_lines())))
def test_an_unusual_file_goes_line_by_line(name, tmp_path, monkeypatch):
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text(_damaged(_lines())[name] + "\n")
    took: list[bool] = []
    whole = azure._read_whole
    monkeypatch.setattr(azure, "_read_whole", lambda p, out: took.append(whole(p, out)) or False)
    if name in ("blank line", "byte-order mark"):  # imports all the same, numbered by line
        assert import_trace(path, "azure").trajectories == len(_lines()) - 1
    else:
        with pytest.raises(InputError) as err:
            import_trace(path, "azure")
        assert err.value.source == str(path)
        assert err.value.record is not None or err.value.field is not None
    assert took == [False]


def test_bytes_the_line_reader_cannot_decode_go_line_by_line(tmp_path):
    from prorsa.telemetry.importers.base import TraceBuilder

    lines = _lines()
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    # Invalid UTF-8 in a column the whole-file read does not import.
    text = [lines[0] + ",Note", *(r + ",ok" for r in lines[1:])]
    path.write_bytes(("\n".join(text[:10]) + "\n").encode() + b"x,1,2,\xff\xfe\n")
    assert not azure._read_whole(path, TraceBuilder("r"))
    with pytest.raises(InputError, match="not UTF-8") as err:
        import_trace(path, "azure")
    assert err.value.record == "line 11"  # the line, not the decoder's chunk
    # Skipping it keeps the file's other rows (the file used to be dropped whole).
    result = import_trace(path, "azure", skip_bad=True)
    assert (result.trajectories, result.skipped) == (9, 1)


def test_a_byte_order_mark_and_a_quoted_newline_keep_lines_right(tmp_path):
    lines = _lines()
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    rows = [lines[0] + ",Note", lines[1] + ',"two\nlines"', lines[2] + ",ok", "bad,1,2,ok"]
    path.write_bytes(codecs.BOM_UTF8 + ("\n".join(rows) + "\n").encode())
    with pytest.raises(InputError) as err:
        import_trace(path, "azure")
    assert err.value.record == "line 5" and err.value.field == "TIMESTAMP"
    assert import_trace(path, "azure", skip_bad=True).trajectories == 2


def test_ids_already_imported_go_line_by_line(tmp_path):
    from prorsa.telemetry.importers.base import TraceBuilder

    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("\n".join(_lines()) + "\n")
    builder = TraceBuilder("r")
    assert azure._read_whole(path, builder)
    # The same ids again: left to the line reader, which names the duplicate's line.
    assert not azure._read_whole(path, builder)
    assert builder.trajectories == 300
    with pytest.raises(InputError, match="duplicate trajectory id"):
        azure._read_file(path, builder)
