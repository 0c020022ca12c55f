"""Every script in ``examples/`` runs, with ``--quick`` (a tiny model or a short budget), so none rots."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_each_example_says_what_it_shows():
    for script in EXAMPLES:
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        assert doc.count("\n") >= 3 and f"python examples/{script.name}" in doc, script.name


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[s.stem for s in EXAMPLES])
def test_example_runs_quick(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
