"""Every package the ``test`` extra installs is installed and imports: the suite imports them at
the top of its modules instead of skipping a module when one is missing, so a broken install
fails here, by name, rather than turning whole modules into skips."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Installed but not imported here, and why. timm imports torchvision, whose ops do not load beside
# the CPU torch of constraints-cpu.txt; the suite reads timm's outputs from fixtures recorded in a
# scratch environment with the CUDA builds (tests/nn/test_from_timm.py says how).
NOT_IMPORTED = {"timm": "imports torchvision, whose ops need the CUDA builds of torch"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_extra_distributions(extra: str = "test", seen: set[str] | None = None) -> set[str]:
    """The distributions ``extra`` names, ``deploykit[...]`` extras expanded."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    seen = set() if seen is None else seen
    names = set()
    for requirement in extras[extra]:
        name, _, nested = re.match(r"([A-Za-z0-9_.-]+)(\[([^\]]*)\])?", requirement).groups()
        if _normal(name) == "deploykit":
            for inner in nested.split(","):
                if inner not in seen:
                    seen.add(inner)
                    names |= test_extra_distributions(inner.strip(), seen)
        else:
            names.add(_normal(name))
    return names


test_extra_distributions.__test__ = False  # a helper, not a test


def test_every_package_of_the_test_extra_is_installed_and_imports():
    modules: dict[str, list[str]] = {}
    for module, distributions in metadata.packages_distributions().items():
        for distribution in distributions:
            modules.setdefault(_normal(distribution), []).append(module)
    wanted = test_extra_distributions()
    assert {"pytest", "tensorrt-rtx", "openvino", "nvidia-pytriton", "hypothesis", "h2"} <= wanted  # control: the extra was read
    missing = []
    for name in sorted(wanted):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"not installed: {missing}; pip install -c constraints-cpu.txt -e '.[test]'"
    chosen = []
    for name in sorted(wanted - set(NOT_IMPORTED)):
        if name not in modules:  # a meta-package (tensorrt-rtx): the modules are its requirement's
            required = [_normal(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in metadata.requires(name) or []]
            name = next(r for r in required if r in modules)
        public = sorted(m for m in modules[name] if not m.startswith("_"))
        chosen.append(next((m for m in public if _normal(m) in name or name.endswith(_normal(m))), public[0]))
    # in a child process: some of them patch others as they import (ModelOpt patches ONNX
    # Runtime's calibrators), which the suite's own process must not see
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    done = subprocess.run([sys.executable, "-c", script, *chosen], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"importing the test extra's packages failed: {done.stderr.strip().splitlines()[-1:]}"
