"""ruff (lint and format, configured in pyproject.toml) is clean on the package, its plugins, the tests and
the benchmarks; the test command runs it, so a style regression fails CI with ruff's own report."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["deploykit", "plugins", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"ruff {' '.join(command)} found problems (fix: ruff {' '.join(command).replace(' --check', '')}):\n{result.stdout}{result.stderr}"
    )
