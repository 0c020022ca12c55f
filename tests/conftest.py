"""Fixtures shared across the suite (light imports only: the CLI module imports click alone)."""

from __future__ import annotations

import pytest


@pytest.fixture
def deploykit_cli(capsys):
    """Run ``deploykit ARGS`` in-process (as the console script does): returns (exit code, stderr)."""
    from deploykit.cli import main

    def run(*args) -> tuple[int, str]:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
        except SystemExit as exit_:
            return exit_.code, capsys.readouterr().err
        return 0, capsys.readouterr().err

    return run
