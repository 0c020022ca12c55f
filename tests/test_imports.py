"""Every ``deploykit`` module imports on a base install, and heavy extras stay unimported."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

import deploykit

_WALK_ERRORS: list[str] = []


def _all_modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(deploykit.__path__, prefix="deploykit.", onerror=_WALK_ERRORS.append)]
    # plugins/ installs as deploykit.plugins: its own path, walked from the package as imported
    plugins = importlib.import_module("deploykit.plugins")
    names += ["deploykit.plugins"] + [
        i.name for i in pkgutil.walk_packages(plugins.__path__, prefix="deploykit.plugins.", onerror=_WALK_ERRORS.append)
    ]
    return sorted(set(names))


MODULES = _all_modules()
OPTIONAL = ("tensorrt_rtx", "tensorrt", "polygraphy", "skimage", "triton")


def test_walk_found_the_package():
    assert not _WALK_ERRORS, f"packages that failed to import while walking: {_WALK_ERRORS}"
    for expected in (
        "deploykit.cli",
        "deploykit.nn.checkpoint",
        "deploykit.export.bundle",
        "deploykit.backends.tensorrt",
        "deploykit.plugins.sape2.kernels",
    ):
        assert expected in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)


def test_cli_and_pipeline_do_not_import_optional_extras():
    code = (
        "import json, sys\n"
        "import deploykit.cli, deploykit.backends, deploykit.backends.tensorrt, deploykit.export, deploykit.validation.run\n"
        f"print(json.dumps(sorted(m for m in {OPTIONAL!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"optional extras imported eagerly: {loaded}"


@pytest.mark.parametrize("name", ["deploykit.backends", "deploykit.export", "deploykit.profile", "deploykit.serve"])
def test_every_name_a_package_lists_resolves(name):
    """A package's names imported on first use point at modules by path: a moved module must not
    leave one of them pointing nowhere."""
    package = importlib.import_module(name)
    missing = [attr for attr in package.__all__ if not hasattr(package, attr)]
    assert missing == []
