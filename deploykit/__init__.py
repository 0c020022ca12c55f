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

# Two steps share their names with the packages that implement them (``deploykit/export/``,
# ``deploykit/profile/``). Python binds a subpackage to its parent's attribute once, when it first
# loads it: so both load here, first (each only lists its names, imported on first use), and the
# steps are bound over them; ``deploykit.export`` stays the function whatever is imported later.
from deploykit import export, profile
from deploykit._version import __version__ as __version__
from deploykit.api import build, create_model, export, list_encodings, list_models, load, profile, validate  # noqa: F811

__all__ = ["build", "create_model", "export", "list_encodings", "list_models", "load", "profile", "validate"]
