"""Serving: the in-process pipeline, a Triton server (PyTriton), a Triton model repository, Ray Serve.

Only the pipeline is imported here; the server modules import their optional packages lazily.
"""

from deploykit.serve.pipeline import ImageLimits, Pipeline, Prediction, load, nearest_resolution

__all__ = ["ImageLimits", "Pipeline", "Prediction", "load", "nearest_resolution"]
