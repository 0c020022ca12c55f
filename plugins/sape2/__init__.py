"""SaPE² on the GPU: the ``deploykit::SaPE2Bias`` op as a Triton kernel (``kernels``), a TensorRT
plugin running it ahead-of-time compiled (``trt_plugin``), and a fused attention variant that
never writes the N×N bias (``fused``). See ``deploykit.encodings.sape2`` for the reference."""


def register() -> str:
    """Register the ``deploykit::SaPE2Bias`` TensorRT plugin (imports TensorRT and Triton);
    ``deploykit build --backend trt --plugins sape2`` calls this (entry point ``deploykit.plugins``)."""
    from deploykit.plugins.sape2.trt_plugin import register as register_trt_plugin

    return register_trt_plugin()
