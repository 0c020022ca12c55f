"""Backend name → runner for one exported graph: the one mapping ``validate`` and ``profile`` share.

Each factory takes the path of an exported ONNX graph. ONNX Runtime runs it directly; the
TensorRT backends run the engine ``deploykit build`` wrote beside it, after checking its
fingerprint and the plugins given (``deploykit.backends.engine_cache``).

``BISECT_FACTORIES`` give the same backend running a graph with more outputs (the block outputs
``validate`` bisects over): ONNX Runtime with the same providers, or for an engine backend a
debug engine built from that graph with the engine's own build settings, so a divergence is
located in the backend where it happened.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial

from deploykit.backends.base import Runner
from deploykit.backends.engine_cache import ENGINE_MODULES
from deploykit.backends.onnxrt import OnnxrtCudaRunner, OnnxrtRunner
from deploykit.backends.openvino import OpenvinoBf16Runner, OpenvinoRunner, best_hint
from deploykit.backends.plugins import Plugins
from deploykit.backends.trt_runner import debug_engine_runner, engine_runner
from deploykit.errors import ConfigError, unknown_choice

RUNNER_FACTORIES: dict[str, Callable[..., Runner]] = {
    "ort": OnnxrtRunner,
    "ort-cuda": OnnxrtCudaRunner,
    "openvino": OpenvinoRunner,
    "openvino-bf16": OpenvinoBf16Runner,
    **{tag: partial(engine_runner, module=module) for tag, module in ENGINE_MODULES.items()},
}

# Backend name -> factory(onnx path, marked graph bytes, **engine options) -> Runner on the marked graph.
BISECT_FACTORIES: dict[str, Callable[..., Runner]] = {
    "ort": lambda onnx_path, marked: OnnxrtRunner(marked),
    # The graph's own runner passed (or was allowed) the CPU-fallback check; bisecting only locates.
    "ort-cuda": lambda onnx_path, marked: OnnxrtCudaRunner(marked, allow_cpu_fallback=True, range_low=range_low(onnx_path)),
    "openvino": lambda onnx_path, marked: OpenvinoRunner(marked),
    "openvino-bf16": lambda onnx_path, marked: OpenvinoBf16Runner(marked),
    **{tag: partial(debug_engine_runner, module=module) for tag, module in ENGINE_MODULES.items()},
}


def check_backend(name: str, choices: Iterable[str] = RUNNER_FACTORIES) -> str:
    """``name`` if it is one of ``choices`` (by default every registered backend; a command passes
    its own: build the engine backends, profile ``torch`` too, serve ``auto`` too).

    Raises:
        ConfigError: any other name, listing the valid ones.
    """
    choices = list(choices)
    if name not in choices:
        raise ConfigError(unknown_choice("backend", name, choices))
    return name


def create_runner(
    backend: str,
    onnx_path: str | os.PathLike,
    *,
    plugins: Plugins | None = None,
    cuda_graph: bool = False,
    allow_cpu_fallback: bool = False,
) -> Runner:
    """The runner for ``backend`` on one exported graph (not yet activated).

    Args:
        backend: a name from ``RUNNER_FACTORIES``.
        onnx_path: the exported graph (an engine backend runs the engine built beside it).
        plugins: for engine backends, the plugins the engine was built with; None: the installed
            plugin packages its fingerprint names.
        cuda_graph: for engine backends, replay CUDA graphs where the engine allows it.
        allow_cpu_fallback: for ``ort-cuda``, accept nodes ONNX Runtime runs on the CPU.

    Raises:
        ConfigError: unknown backend name.
    """
    check_backend(backend)
    if backend in ENGINE_MODULES:
        return RUNNER_FACTORIES[backend](onnx_path, plugins=plugins, cuda_graph=cuda_graph)
    if backend == "ort-cuda":
        return RUNNER_FACTORIES[backend](onnx_path, allow_cpu_fallback=allow_cpu_fallback, range_low=range_low(onnx_path))
    if backend == "ort":
        return RUNNER_FACTORIES[backend](onnx_path, range_low=range_low(onnx_path))
    return RUNNER_FACTORIES[backend](onnx_path)


def range_low(onnx_path: str | os.PathLike) -> tuple[int, ...] | None:
    """The smallest resolution of a resolution-range graph (its export metadata), None for others."""
    from deploykit.export.metadata import GraphMetadata

    span = GraphMetadata.of_file(onnx_path).resolution_range
    return tuple(span[0]) if span else None


def create_bisect_runner(backend: str, onnx_path: str | os.PathLike, marked: bytes, *, plugins: Plugins | None = None) -> Runner | None:
    """``backend`` running ``marked`` (the graph at ``onnx_path`` with more outputs), or None when
    the backend has no such factory."""
    factory = BISECT_FACTORIES.get(backend)
    if factory is None:
        return None
    return factory(onnx_path, marked, plugins=plugins) if backend in ENGINE_MODULES else factory(onnx_path, marked)


def available_backends() -> list[str]:
    """The registered backends whose prerequisites are present here: ``ort`` always; ``ort-cuda``
    when onnxruntime has its CUDA provider; ``openvino`` when it imports, ``openvino-bf16`` when
    the CPU also computes in bf16; ``trt``/``rtx`` when their package imports and the CUDA driver
    reports a GPU the flavour supports, with a driver that runs the installed wheel's CUDA
    (``deploykit.backends.devices``)."""
    import onnxruntime as ort

    from deploykit._lazy import is_available
    from deploykit.backends.devices import cuda_build_problem, probe_device, supports

    device = probe_device()

    def usable(name: str) -> bool:
        if name == "ort-cuda":
            return "CUDAExecutionProvider" in ort.get_available_providers()
        if name in ENGINE_MODULES:
            cc = device.compute_capability
            module = ENGINE_MODULES[name]
            return cc is not None and supports(module, cc) and is_available(module) and cuda_build_problem(module) is None
        if name in ("openvino", "openvino-bf16"):
            return is_available("openvino") and (name == "openvino" or best_hint() == "bf16")
        return True

    return [name for name in RUNNER_FACTORIES if usable(name)]
