"""Heavy optional packages are imported here and only here, on first use.

Keeping them in one place means a base install (no TensorRT, no scikit-image) can import every
``deploykit`` module, and a missing extra fails with one line that names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deploykit.errors import MissingDependencyError

# module name -> the pip extra that provides it (the TensorRT flavours' records name theirs)
_EXTRAS = {
    "skimage": "images",
    "matplotlib": "plot",
    "PIL.Image": "images",
    "pytriton": "serve",
    "tritonclient": "serve",
    "tritonclient.grpc.model_config_pb2": "serve",
    "ray": "ray",
    "triton": "triton",
    "timm": "timm",
    "timm.layers": "timm",
    "openvino": "openvino",
}


def lazy_import(module: str, extra: str | None = None) -> ModuleType:
    """Import an optional module, or raise a one-line error naming the extra that provides it.

    Args:
        module: importable module name, e.g. ``"tensorrt_rtx"``.
        extra: the pip extra that provides it, where the caller holds that fact (a TensorRT
            flavour's record); None: ``_EXTRAS``'s.

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: the module is not installed (or fails to import).
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = extra or _EXTRAS.get(module)
        hint = f"pip install 'deploykit[{extra}]'" if extra else f"pip install {module}"
        raise MissingDependencyError(f"{module} is not available ({err}); install it with: {hint}") from err
    except RuntimeError as err:
        # Installed but broken at import: e.g. timm imports torchvision, whose PyPI wheel for
        # this torch version is built against CUDA torch and fails beside a CPU build.
        raise MissingDependencyError(
            f"{module} is installed but does not import ({err}); a dependency is built for another torch "
            f"(torch {importlib.import_module('torch').__version__})"
        ) from err


def is_available(module: str) -> bool:
    """Whether an optional module imports, without raising."""
    try:
        lazy_import(module)
    except MissingDependencyError:
        return False
    return True


def lazy_exports(package: str, exports: dict[str, list[str]]):
    """``__getattr__``, ``__dir__`` and ``__all__`` for a package whose public names live in
    submodules that are imported on first use (PEP 562), so importing one light submodule does
    not import its heavy siblings.

    Args:
        package: the package's ``__name__``.
        exports: module → the names it provides; module names are relative to ``package``
            (``".report"``, ``"..imaging"``), so a package's own path is written once.
    """
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name], package), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
