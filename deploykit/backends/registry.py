"""Backend name → runner for one exported graph: the one mapping ``validate`` and ``profile`` share.

Each factory takes the path of an exported ONNX graph. ONNX Runtime runs it directly; the
TensorRT backends run the engine ``deploykit build`` wrote beside it, after checking its
fingerprint (``deploykit.backends.engine_cache``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

from deploykit.backends.base import Runner
from deploykit.backends.engine_cache import ENGINE_MODULES
from deploykit.backends.onnxrt import OnnxrtCudaRunner, OnnxrtRunner
from deploykit.backends.trt_runner import engine_runner
from deploykit.errors import ConfigError

RUNNER_FACTORIES: dict[str, Callable[[str | os.PathLike], Runner]] = {
    "ort": OnnxrtRunner,
    "ort-cuda": OnnxrtCudaRunner,
    **{tag: partial(engine_runner, module=module) for tag, module in ENGINE_MODULES.items()},
}


def create_runner(backend: str, onnx_path: str | os.PathLike) -> Runner:
    """The runner for ``backend`` on one exported graph (not yet activated).

    Raises:
        ConfigError: unknown backend name.
    """
    if backend not in RUNNER_FACTORIES:
        raise ConfigError(f"unknown backend {backend!r}; choose one of: {', '.join(RUNNER_FACTORIES)}")
    return RUNNER_FACTORIES[backend](onnx_path)


def available_backends() -> list[str]:
    """The registered backends whose prerequisites are present here: ``ort`` always; ``ort-cuda``
    when onnxruntime has its CUDA provider; ``trt``/``rtx`` when their package imports and
    PyTorch sees a CUDA GPU (the engine runners use torch for device buffers)."""
    import onnxruntime as ort

    from deploykit._lazy import is_available

    def usable(name: str) -> bool:
        if name == "ort-cuda":
            return "CUDAExecutionProvider" in ort.get_available_providers()
        if name in ENGINE_MODULES:
            import torch

            return torch.cuda.is_available() and is_available(ENGINE_MODULES[name])
        return True

    return [name for name in RUNNER_FACTORIES if usable(name)]
