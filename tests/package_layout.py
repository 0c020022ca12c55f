"""The package's modules as the build configuration installs them: ``pyproject.toml``'s
``packages`` and ``package-dir`` (``plugins/`` at the top level installs as ``deploykit.plugins``),
read rather than restated, so the layer and import tests see exactly what a wheel holds."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_dirs() -> dict[str, Path]:
    """Installed package name -> its source directory."""
    config = _setuptools()
    mapped = config.get("package-dir", {})
    dirs = {}
    for package in config["packages"]:
        base = next((p for p in sorted(mapped, key=len, reverse=True) if package == p or package.startswith(p + ".")), None)
        if base is None:
            dirs[package] = ROOT.joinpath(*package.split("."))
        else:
            dirs[package] = ROOT / mapped[base] / Path(*package[len(base) + 1 :].split(".")) if package != base else ROOT / mapped[base]
    return dirs


def modules() -> dict[str, Path]:
    """Every installed module's name -> its source file."""
    found = {}
    for package, directory in package_dirs().items():
        for path in sorted(directory.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def source_packages() -> set[Path]:
    """Every directory with an ``__init__.py`` under ``deploykit/`` and ``plugins/``."""
    return {p.parent for top in ("deploykit", "plugins") for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts}
