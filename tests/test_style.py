"""ruff (lint and format, configured in pyproject.toml) is clean on the package, its plugins, the tests and
the benchmarks, the examples and the docs hooks; the test command runs it, so a style regression fails CI with ruff's own report."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["deploykit", "plugins", "tests", "benchmarks", "examples", "docs/hooks.py"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"ruff {' '.join(command)} found problems (fix: ruff {' '.join(command).replace(' --check', '')}):\n{result.stdout}{result.stderr}"
    )


def test_every_unknown_name_is_refused_through_one_helper():
    """A name outside a fixed set (model, encoding, precision, backend, ...) is refused by
    ``errors.unknown_choice``, so every such message reads the same and lists the choices."""
    import ast

    from deploykit.errors import unknown_choice

    assert unknown_choice("model", "vit_x", ["a", "b"]) == "unknown model 'vit_x'; choose one of: a, b"
    spelled = []
    for path in (ROOT / "deploykit").rglob("*.py"):
        if path.name == "errors.py" and path.parent.name == "deploykit":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "choose one of" in node.value:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not spelled, spelled
