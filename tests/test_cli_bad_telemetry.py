"""Commands that read telemetry refuse a bad record by file, record and field."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from prorsa.cli.main import app
from prorsa.telemetry import read_telemetry, write_parquet

runner = CliRunner()
AZURE_SLICE = Path(__file__).resolve().parents[1] / "datasets/traces/azure-code-2023-slice.csv"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    from prorsa.telemetry.importers import import_trace

    path = tmp_path_factory.mktemp("tel") / "good.parquet"
    table = import_trace(AZURE_SLICE, "azure").table
    write_parquet(table.slice(0, 400), path)  # whole requests: the slice starts at one
    return path


@pytest.fixture(scope="module")
def negative(good, tmp_path_factory) -> Path:
    table, _ = read_telemetry(good)
    column = table.column_names.index("context_tokens")
    tokens = table.column(column).to_pylist()
    tokens[3] = -7
    path = tmp_path_factory.mktemp("bad") / "negative.parquet"
    write_parquet(table.set_column(column, "context_tokens", pa.array(tokens, pa.int32())), path)
    return path


# Found by review: these read telemetry without checking it, so a negative token count
# went into percentiles and datasets.
@pytest.mark.parametrize(
    "command",
    [
        ["traces", "summary", "--allow-partial"],
        ["forecast", "dataset", "--allow-partial", "--out", "{tmp}/ds.parquet", "--telemetry"],
        ["forecast", "backtest", "--model", "ewma", "--telemetry"],
    ],
)
def test_a_negative_token_count_is_refused_by_record_and_field(command, negative, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command] + [str(negative)]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert "negative.parquet" in text and "context_tokens" in text and "record" in text


def test_the_same_run_twice_names_both_files(good, tmp_path):
    twin = tmp_path / "twin.parquet"
    twin.write_bytes(good.read_bytes())
    out = tmp_path / "ds.parquet"
    args = ["forecast", "dataset", "--allow-partial", "--out", str(out)]
    result = runner.invoke(app, [*args, "--telemetry", str(good), "--telemetry", str(twin)])
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert "twin.parquet" in text and "good.parquet" in text and "run id" in text
