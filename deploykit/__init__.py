"""deploykit: Vision Transformers with novel positional encodings, from PyTorch to served engines.

The pipeline, each step usable from Python::

    from deploykit.nn import create_model
    from deploykit.export import export
    from deploykit.validate import validate
"""

__version__ = "0.1.0"
