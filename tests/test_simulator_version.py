"""What the simulator hash covers: code that runs in a simulated result, not its reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prorsa.runtime.sim import version


@pytest.mark.parametrize(
    ("relative", "counts"),
    [
        ("runtime/sim/engine.py", True),
        ("experiments/regimes.py", True),
        ("experiments/held_out.py", True),
        ("experiments/regime_report.py", False),
        ("experiments/report.py", False),
        ("serve/app.py", False),
        ("cli/demo.py", False),
        ("integrations/skyrl.py", False),
        ("experiments/report_extra.py", True),  # a prefix of a name is not the name
    ],
)
def test_which_files_count_as_simulator_code(relative, counts):
    assert version.is_simulator_code(Path(relative)) is counts


def test_a_simulated_result_never_imports_the_report_modules():
    # The hash leaves the report modules out; that is only sound while running a map's
    # cells, summarising them and computing mechanisms never imports them (most imports
    # here happen inside functions, so a cell is run, not only imported).
    code = (
        "import sys\n"
        "import prorsa.experiments.regimes, prorsa.experiments.cells, "
        "prorsa.experiments.sweep, prorsa.experiments.mechanisms, prorsa.runtime.sim\n"
        "from prorsa.experiments.cells import Cell\n"
        "from prorsa.experiments.regimes import run_cell_recorded\n"
        "run_cell_recorded(Cell.of(scenario='swe', trajectories=4, num_slots=2, "
        "policy='predictive', forecaster='ewma'))\n"
        "bad = [m for m in sys.modules if m.startswith(('prorsa.serve', 'prorsa.cli', "
        "'prorsa.integrations', 'prorsa.experiments.report', "
        "'prorsa.experiments.regime_report'))]\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
