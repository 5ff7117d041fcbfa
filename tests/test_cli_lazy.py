"""The ``prorsa`` entry point imports only the module of the command it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from prorsa.cli.main import COMMANDS, GROUPS, build_app, command_named


def test_command_named_finds_the_command_past_root_flags():
    assert command_named(["--debug", "traces", "import", "x.csv"]) == "traces"
    assert command_named(["simulate", "--trace", "serve"]) == "simulate"
    assert command_named(["nosuch"]) is None
    assert command_named(["--help"]) is None
    assert command_named([]) is None


def test_the_whole_app_lists_every_command():
    result = CliRunner().invoke(build_app(), ["--help"], terminal_width=200)
    assert result.exit_code == 0
    for name in [*GROUPS, *COMMANDS]:
        assert f" {name} " in result.output


def test_one_command_runs_without_importing_the_others():
    code = (
        "import sys\n"
        "from prorsa.cli.main import main\n"
        "sys.argv = ['prorsa', 'traces', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0, done.code\n"
        "print(sorted(m for m in sys.modules if m.startswith('prorsa.cli.')))\n"
        "print('torch' in sys.modules, 'ray' in sys.modules)\n"
    )
    modules, heavy = _printed_by(code)[-2:]
    assert "prorsa.cli.traces" in modules
    for other in ("simulate", "serve", "compare", "rollout", "rl", "forecast"):
        assert f"prorsa.cli.{other}'" not in modules
    assert heavy == "False False"


def test_the_simulator_and_policies_import_no_compiler_or_ml_framework():
    pytest.importorskip("numba")  # without it there is nothing to keep out
    # numba (the forecasters' kernels) costs ~0.15 s and ~60 MB of every simulator
    # process; it is imported when a forecaster first sums its terms, not before.
    code = (
        "import sys\n"
        "from prorsa.policy import make_policy\n"
        "from prorsa.runtime.sim.simulation import Simulation\n"
        "from prorsa.forecast import make_forecaster\n"
        "print(sorted(m for m in ('numba', 'torch', 'lightgbm', 'ray') if m in sys.modules))\n"
    )
    assert _printed_by(code)[-1] == "[]"


def _printed_by(code: str) -> list[str]:
    """The lines ``code`` prints, run in a fresh interpreter (nothing imported yet)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.strip().splitlines()
