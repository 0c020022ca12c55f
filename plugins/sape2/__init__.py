"""SaPE² on the GPU: the ``deploykit::SaPE2Bias`` op as a Triton kernel (``kernels``), a TensorRT
plugin running it ahead-of-time compiled (``trt_plugin``), and a fused attention variant that
never writes the N×N bias (``fused``). See ``deploykit.encodings.sape2`` for the reference."""
