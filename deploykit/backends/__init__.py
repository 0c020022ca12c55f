"""Every runner behind one ``Runner`` interface (``base``): ONNX Runtime (``onnxrt``, torch-free and
below ``deploykit.export``, whose checks run graphs through it), PyTorch eager, TensorRT and
TensorRT-RTX engines, OpenVINO; the table of backends (``table``) and the registry that creates
any runner by name.

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
