"""Backends behind one ``Runner`` interface (``deploykit.runtime``, with ONNX Runtime's runners):
torch, tensorrt, tensorrt_rtx, openvino, and the registry that creates any runner by name.

Names are imported on first use (the engine modules need neither PyTorch nor ONNX Runtime);
TensorRT itself is imported lazily inside ``deploykit.backends.tensorrt``.
"""

from deploykit._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".torch_runner": ["TorchRunner"],
    },
)
