"""Serving: the in-process pipeline, a Triton server (PyTriton), a Triton model repository, Ray Serve.

Names are imported on first use; the server modules import their optional packages lazily.
"""

from deploykit._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".classifier": ["ImageLimits"],
        "..inputs.imaging": ["nearest_resolution"],
        ".pipeline": ["Pipeline", "Prediction", "load"],
    },
)
