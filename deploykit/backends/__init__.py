"""Backends behind one ``Runner`` interface: torch, onnxruntime, tensorrt, tensorrt_rtx.

Names are imported on first use (the engine modules need neither PyTorch nor ONNX Runtime);
TensorRT itself is imported lazily inside ``deploykit.backends.tensorrt``.
"""

from deploykit._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "deploykit.backends.base": ["Runner"],
        "deploykit.backends.onnxrt": ["OnnxrtRunner"],
        "deploykit.backends.torch_runner": ["TorchRunner"],
    },
)
