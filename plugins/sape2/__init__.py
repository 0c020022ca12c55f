"""SaPE² on the GPU: the ``deploykit::SaPE2Bias`` op as Triton kernels (``kernels``: signatures once
per image and head, then pairwise distances) and a TensorRT plugin running the distance kernel
ahead-of-time compiled (``trt_plugin``). See ``deploykit.encodings.sape2`` for the reference."""


def register() -> str:
    """Register the ``deploykit::SaPE2Distance`` TensorRT plugin (imports TensorRT and Triton);
    ``deploykit build --backend trt --plugins sape2`` calls this (entry point ``deploykit.plugins``)."""
    from deploykit.plugins.sape2.trt_plugin import register as register_trt_plugin

    return register_trt_plugin()
