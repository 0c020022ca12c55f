"""deploykit: Vision Transformers with novel positional encodings, from PyTorch to served engines.

The whole workflow, each step imported on first use (``import deploykit`` loads neither PyTorch
nor ONNX Runtime)::

    import deploykit

    exported = deploykit.export(None, "out/default")        # the zoo's trained default model
    deploykit.validate("out/default").raise_for_failure()   # against the float64 PyTorch reference
    deploykit.profile("out/default", batches=[1])          # times the plans, writes the choice
    print(deploykit.load("out/default")("photo.jpg"))       # images in, top-k classes out

``deploykit.api`` documents each function.
"""

import sys
import types

__version__ = "0.1.0"

__all__ = ["build", "create_model", "export", "list_encodings", "list_models", "load", "profile", "validate"]


def __getattr__(name: str):
    if name in __all__:
        from deploykit import api

        return getattr(api, name)
    raise AttributeError(f"module 'deploykit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


class _Package(types.ModuleType):
    """``deploykit``'s module type. Four steps share their names with the modules that implement
    them (``deploykit/export/``, ``validate.py``, ``build.py``, ``profile/``), and importing a
    submodule sets it as an attribute of its package: these properties keep ``deploykit.validate``
    the function whatever was imported before. The modules stay importable by their full names
    (``from deploykit.validate import Record``, ``importlib.import_module("deploykit.validate")``)."""


for _name in ("build", "export", "profile", "validate"):
    # The setter drops the import system's ``setattr(deploykit, "validate", <module>)``.
    setattr(_Package, _name, property(lambda self, name=_name: __getattr__(name), lambda self, value: None))

sys.modules[__name__].__class__ = _Package
del _name
