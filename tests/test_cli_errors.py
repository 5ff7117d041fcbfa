"""The CLI error handler: every expected failure is one line, tracebacks only with --debug."""

from __future__ import annotations

import errno

import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from prorsa.cli.common import EXIT_INTERNAL, EXIT_INTERRUPTED, friendly_errors, set_debug
from prorsa.errors import ConfigError

runner = CliRunner()


def _app(exc: BaseException) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @friendly_errors
    def boom() -> None:
        raise exc

    return app


@pytest.fixture(autouse=True)
def _no_debug():
    set_debug(False)
    yield
    set_debug(False)


@pytest.mark.parametrize(
    ("exc", "line", "hint"),
    [
        (ConfigError("bad interval", hint="use > 0"), "error: bad interval", "hint: use > 0"),
        (
            OSError(errno.ENOSPC, "No space left on device", "/out/x.parquet"),
            "error: /out/x.parquet: No space left on device",
            "free space",
        ),
        (
            OSError(errno.EROFS, "Read-only file system", "/ro/x"),
            "error: /ro/x: Read-only file system",
            "read-only",
        ),
        (
            IsADirectoryError(errno.EISDIR, "Is a directory", "out"),
            "error: out: Is a directory",
            "not a folder",
        ),
        (
            pa.ArrowInvalid("Parquet magic bytes not found in footer"),
            "error: cannot read the data: Parquet magic bytes",
            ".parquet file",
        ),
        (ValueError("could not convert 'x' to float"), "error: invalid value: could not", None),
    ],
)
def test_expected_failures_are_one_line(exc, line, hint):
    result = runner.invoke(_app(exc), [])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith(line)
    if hint:
        assert hint in result.output
    assert len(result.output.strip().splitlines()) <= 2


def test_ctrl_c_exits_130_without_traceback():
    result = runner.invoke(_app(KeyboardInterrupt()), [])
    assert result.exit_code == EXIT_INTERRUPTED
    assert result.output.strip() == "interrupted"


def test_a_bug_is_one_line_that_says_so():
    result = runner.invoke(_app(TypeError("unsupported operand")), [])
    assert result.exit_code == EXIT_INTERNAL
    assert "internal error: TypeError: unsupported operand" in result.output
    assert "--debug" in result.output and "Traceback" not in result.output


def test_debug_shows_the_exception():
    set_debug(True)
    result = runner.invoke(_app(ConfigError("bad")), [])
    assert isinstance(result.exception, ConfigError)


def test_markup_in_messages_is_printed_verbatim():
    result = runner.invoke(_app(ConfigError("field [bold]x[/bold] bad")), [])
    assert "field [bold]x[/bold] bad" in result.output


def test_typer_exit_passes_through():
    result = runner.invoke(_app(typer.Exit(3)), [])
    assert result.exit_code == 3 and result.output == ""


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--param", "foo=1"], "policy 'colocate' has no parameter 'foo'"),
        (["--policy", "static", "--param", "prefill_gpus=x"], "static.prefill_gpus must be"),
        (["--interval-s", "nan"], "interval_s must be a finite number"),
        (["--interval-s", "1e-9"], "interval_s must be a finite number >= 0.01"),
        (["--trajectories", "0"], "trajectories, group_size and steps must be >= 1"),
        (["--connector", "bogus"], "unknown connector 'bogus'"),
        (["--out", "{model}"], "is also an input"),
        (["--out", "{parent}"], "is also an input"),
    ],
)
def test_rollout_bad_settings_are_one_line_before_engines_start(
    tmp_path, monkeypatch, options, message
):
    from prorsa.cli.main import app
    from prorsa.runtime.ray import rollout

    def no_engines(*_a, **_k):
        raise AssertionError("engines started for a run that cannot work")

    monkeypatch.setattr(rollout, "start_fleet", no_engines)
    model = tmp_path / "model"
    model.mkdir()
    options = [o.format(model=model, parent=tmp_path) for o in options]
    out = [] if "--out" in options else ["--out", str(tmp_path / "out")]
    result = runner.invoke(app, ["rollout", "--model", str(model), *out, *options])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error:") and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--param", "statc.prefill_gpus=4"], "--param names policy 'statc'"),
        (["--param", "threshold.prefill_gpus=4"], "policy 'threshold' has no parameter"),
        (["--param", "threshold.cooldown_s=soon"], "threshold.cooldown_s must be"),
        (["--param", "mpc.max_step=2"], "not among the policies run"),
        (["--workers", "-1"], "workers must be at least 0"),
        (["--seeds", "0"], "seeds must be at least 1"),
        (["--interval-s", "nan"], "interval_s must be finite"),
        (["--interval-s", "1e-9"], "interval_s must be at least 0.01"),
        (["--engines", "1"], "engines >= 2"),
        (["--mode", "sync,later"], "unknown mode 'later'"),
        (["--trace", "missing.parquet"], "trace not found"),
        (["--tuned", "optuna.db"], "not a database"),
    ],
)
def test_compare_bad_inputs_are_one_line_before_any_cell(tmp_path, monkeypatch, options, message):
    from prorsa.cli.main import app
    from prorsa.experiments import compare

    def no_sweep(*_a, **_k):
        raise AssertionError("cells started for a comparison that cannot work")

    monkeypatch.setattr(compare, "Sweep", no_sweep)
    args = ["compare", "--policies", "colocate,static,threshold", "--out", str(tmp_path / "o")]
    result = runner.invoke(app, [*args, *options])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error:") and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--param", "prefill_gpu=4"], "policy 'static' has no parameter 'prefill_gpu'"),
        (["--param", "prefill_fraction=half"], "static.prefill_fraction must be"),
        (["--workers", "-1"], "workers must be at least 1"),
        (["--trials", "0"], "trials must be at least 1"),
        (["--interval-s", "nan"], "interval_s must be finite"),
        (["--interval-s", "1e-9"], "interval_s must be at least 0.01"),
        (["--storage", "optuna.db"], "not a database"),
        (["--storage", "redis://host/0"], "not a database"),
        (["--storage", "sqlite:///"], "names no database file"),
        (["--trace", "missing.parquet"], "trace not found"),
    ],
)
def test_tune_bad_inputs_are_one_line_before_any_trial(tmp_path, monkeypatch, options, message):
    from prorsa import tune
    from prorsa.cli.main import app

    def no_study(*_a, **_k):
        raise AssertionError("a study opened for settings that cannot work")

    monkeypatch.setattr(tune, "open_storage", no_study)
    args = ["tune", "static", "--out", str(tmp_path / "o")]
    if "--storage" not in options:
        args += ["--storage", f"sqlite:///{tmp_path / 'study.db'}"]
    result = runner.invoke(app, [*args, *options])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error:") and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2


@pytest.mark.parametrize("command", [["explore", "--quick"], ["demo"]])
def test_regime_map_bad_workers_are_one_line_before_any_cell(tmp_path, monkeypatch, command):
    from prorsa.cli.main import app
    from prorsa.experiments import regimes

    def no_sweep(*_a, **_k):
        raise AssertionError("cells started for a map that cannot work")

    monkeypatch.setattr(regimes, "Sweep", no_sweep)
    result = runner.invoke(app, [*command, "--workers", "-1", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: workers must be at least 0")
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2
