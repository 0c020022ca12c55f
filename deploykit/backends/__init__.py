"""The runners above the export (behind ``deploykit.runners.base``'s ``Runner`` interface):
PyTorch eager, TensorRT and TensorRT-RTX engines (built by ``build``, cached by ``engine_cache``,
described by ``inspection``), OpenVINO; and the registry that creates any runner of the table of
backends (``deploykit.runners.table``) by name. ONNX Runtime's runners sit below the export, in
``deploykit.runners``.

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
