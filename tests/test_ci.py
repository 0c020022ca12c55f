"""CI runs what the README tells a contributor to run, and that command includes the slow tests."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("python3 -m venv .venv && ")]


def test_ci_runs_the_readme_test_command_with_the_slow_tests():
    readme = [c for c in _commands((ROOT / "README.md").read_text()) if "pytest" in c]
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert len(readme) == 1 and ci == readme, (readme, ci)
    pytest_args = shlex.split(readme[0].split("-m pytest", 1)[1])
    # The last -m wins over pyproject's addopts -m 'not slow'; an empty one selects everything.
    marks = [pytest_args[i + 1] for i, arg in enumerate(pytest_args) if arg == "-m"]
    assert marks and marks[-1] == "", pytest_args


def test_the_quick_set_leaves_out_exactly_the_slow_marker(pytestconfig):
    """pyproject's addopts deselect ``slow`` and nothing else, and the marker is registered."""
    addopts = pytestconfig.getini("addopts")
    assert "--strict-markers" in addopts and addopts[addopts.index("-m") + 1] == "not slow"
    assert any(re.match(r"slow:", m) for m in pytestconfig.getini("markers"))
