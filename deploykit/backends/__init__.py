"""Backends behind one ``Runner`` interface: torch, onnxruntime, tensorrt, tensorrt_rtx.

TensorRT modules are imported lazily inside ``deploykit.backends.tensorrt``.
"""

from deploykit.backends.base import Runner
from deploykit.backends.onnxrt import OnnxrtRunner
from deploykit.backends.torch_runner import TorchRunner

__all__ = ["OnnxrtRunner", "Runner", "TorchRunner"]
