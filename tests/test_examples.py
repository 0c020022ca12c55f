"""Every script in ``examples/`` runs, with ``--quick`` (a tiny model or a short budget), so none rots.

Each runs in this process as ``__main__`` (``runpy``), as ``python examples/NAME.py --quick`` would
run it, without paying PyTorch's import again per script."""

from __future__ import annotations

import ast
import runpy
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
def test_example_runs_quick(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--out", str(tmp_path / "out")])
    runpy.run_path(str(script), run_name="__main__")  # an error or a failed check raises
