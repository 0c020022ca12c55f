"""deploykit: Vision Transformers with novel positional encodings, from PyTorch to served engines.

The pipeline, each step usable from Python::

    from deploykit.nn import create_model
    from deploykit.export import export
    from deploykit.validate import validate

    pipeline = deploykit.load("out/small")   # images in, top-k classes out
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``deploykit.load`` without importing onnxruntime / torch on ``import deploykit``.
    if name == "load":
        from deploykit.serve.pipeline import load

        return load
    raise AttributeError(f"module 'deploykit' has no attribute {name!r}")
