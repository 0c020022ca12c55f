"""Backend name → runner for one exported graph: the one lookup ``validate``, ``profile`` and
``serve`` share, over the table of backends (``deploykit.runners.table``).

Each factory takes its descriptor, the path of an exported ONNX graph and the ``RunnerOptions``
a command was given (each backend reads the ones it has). ONNX Runtime runs the graph directly; the TensorRT
backends run the engine ``deploykit build`` wrote beside it, after checking its fingerprint and
the plugins given (``deploykit.backends.engine_cache``).

Bisect factories give the same backend running a graph with more outputs (the block outputs
``validate`` bisects over): ONNX Runtime with the same providers, or for an engine backend a
debug engine built from that graph with the engine's own build settings, so a divergence is
located in the backend where it happened.

The availability checks say why a backend cannot run here (``Backend.why_unavailable``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from deploykit.backends.openvino import OpenvinoBf16Runner, OpenvinoRunner, best_hint
from deploykit.backends.plugins import Plugins
from deploykit.errors import ConfigError, unknown_choice
from deploykit.runners import table
from deploykit.runners.base import Runner


@dataclass(frozen=True)
class RunnerOptions:
    """What a command may ask of the runner it creates; each backend reads the fields it has.

    Attributes:
        plugins: for engine backends, the plugins the engine was built with; None: the installed
            plugin packages its fingerprint names.
        cuda_graph: for engine backends, replay CUDA graphs where the engine allows it.
        allow_cpu_fallback: for ``ort-cuda``, accept nodes ONNX Runtime runs on the CPU.
        streams: for the backends that have them (``Backend.streams``), the inference streams.
        threads: for the CPU backends, the threads each call computes on; 0: the runtime's own
            choice (every core). A server running several processes of one runner splits the cores.
    """

    plugins: Plugins | None = None
    cuda_graph: bool = False
    allow_cpu_fallback: bool = False
    streams: int = 1
    threads: int = 0


def check_backend(name: str, choices: list[str] | None = None) -> str:
    """``name`` if it is one of ``choices`` (by default every backend that runs a graph or an
    engine; a command passes its own: build the engine backends, profile ``torch`` too, serve
    ``auto`` too).

    Raises:
        ConfigError: any other name, listing the valid ones.
    """
    choices = list(choices if choices is not None else table.names((table.GRAPH, table.ENGINE)))
    if name not in choices:
        raise ConfigError(unknown_choice("backend", name, choices))
    return name


def _descriptor(name: str) -> table.Backend:
    check_backend(name)
    return table.find(name)


def create_runner(
    backend: str,
    onnx_path: str | os.PathLike,
    *,
    plugins: Plugins | None = None,
    cuda_graph: bool = False,
    allow_cpu_fallback: bool = False,
    streams: int = 1,
    threads: int = 0,
) -> Runner:
    """The runner for ``backend`` on one exported graph (not yet activated).

    Args:
        backend: a graph or engine backend of the table.
        onnx_path: the exported graph (an engine backend runs the engine built beside it).
        plugins, cuda_graph, allow_cpu_fallback, streams, threads: as ``RunnerOptions``.

    Raises:
        ConfigError: unknown backend name.
    """
    options = RunnerOptions(plugins, cuda_graph, allow_cpu_fallback, streams, threads)
    found = _descriptor(backend)
    return table.resolve(found.runner)(found, onnx_path, options)


def create_bisect_runner(backend: str, onnx_path: str | os.PathLike, marked: bytes, *, plugins: Plugins | None = None) -> Runner | None:
    """``backend`` running ``marked`` (the graph at ``onnx_path`` with more outputs), or None when
    the backend has no bisect factory."""
    found = _descriptor(backend)
    return None if found.bisect is None else table.resolve(found.bisect)(found, onnx_path, marked, RunnerOptions(plugins))


def available_backends() -> list[str]:
    """The graph and engine backends whose prerequisites are present here, in table order
    (``Backend.why_unavailable``)."""
    return [b.name for b in table.backends((table.GRAPH, table.ENGINE)) if b.why_unavailable() is None]


def range_low(onnx_path: str | os.PathLike) -> tuple[int, ...] | None:
    """The smallest resolution of a resolution-range graph (its export metadata), None for others."""
    from deploykit.export.metadata import GraphMetadata

    span = GraphMetadata.of_file(onnx_path).resolution_range
    return tuple(span[0]) if span else None


# The table's factories: (backend, onnx_path, options) -> Runner; bisect: (backend, onnx_path, marked, options) -> Runner.


def onnxrt_runner(backend: table.Backend, onnx_path, options: RunnerOptions) -> Runner:
    from deploykit.runners.onnxrt import OnnxrtRunner

    return OnnxrtRunner(onnx_path, intra_op_threads=options.threads, range_low=range_low(onnx_path), streams=options.streams)


def onnxrt_bisect_runner(backend: table.Backend, onnx_path, marked: bytes, options: RunnerOptions) -> Runner:
    from deploykit.runners.onnxrt import OnnxrtRunner

    return OnnxrtRunner(marked)


def onnxrt_cuda_runner(backend: table.Backend, onnx_path, options: RunnerOptions) -> Runner:
    from deploykit.runners.onnxrt import OnnxrtCudaRunner

    return OnnxrtCudaRunner(onnx_path, allow_cpu_fallback=options.allow_cpu_fallback, range_low=range_low(onnx_path))


def onnxrt_cuda_bisect_runner(backend: table.Backend, onnx_path, marked: bytes, options: RunnerOptions) -> Runner:
    from deploykit.runners.onnxrt import OnnxrtCudaRunner

    # The graph's own runner passed (or was allowed) the CPU-fallback check; bisecting only locates.
    return OnnxrtCudaRunner(marked, allow_cpu_fallback=True, range_low=range_low(onnx_path))


def openvino_runner(backend: table.Backend, onnx_path, options: RunnerOptions) -> Runner:
    return OpenvinoRunner(onnx_path, threads=options.threads, streams=options.streams)


def openvino_bisect_runner(backend: table.Backend, onnx_path, marked: bytes, options: RunnerOptions) -> Runner:
    return OpenvinoRunner(marked)


def openvino_bf16_runner(backend: table.Backend, onnx_path, options: RunnerOptions) -> Runner:
    return OpenvinoBf16Runner(onnx_path, threads=options.threads, streams=options.streams)


def openvino_bf16_bisect_runner(backend: table.Backend, onnx_path, marked: bytes, options: RunnerOptions) -> Runner:
    return OpenvinoBf16Runner(marked)


def engine_runner(backend: table.Backend, onnx_path, options: RunnerOptions) -> Runner:
    """Raises ``DeployKitError`` at once when no engine was built beside ``onnx_path``."""
    from deploykit.backends import trt_runner

    return trt_runner.engine_runner(onnx_path, backend.flavour.module, options.cuda_graph, options.plugins)


def engine_bisect_runner(backend: table.Backend, onnx_path, marked: bytes, options: RunnerOptions) -> Runner:
    from deploykit.backends import trt_runner

    return trt_runner.debug_engine_runner(onnx_path, marked, backend.flavour.module, options.plugins)


# The table's availability checks: (backend) -> why it cannot run here, or None.


def no_cuda_provider(backend: table.Backend) -> str | None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return None
    return "this onnxruntime has no CUDA provider; pip install 'deploykit[gpu]'"


def no_openvino(backend: table.Backend) -> str | None:
    from deploykit._lazy import is_available

    return None if is_available("openvino") else "openvino is not installed; pip install 'deploykit[openvino]'"


def no_bf16(backend: table.Backend) -> str | None:
    return no_openvino(backend) or (None if best_hint() == "bf16" else "this CPU has no native bf16")


def engine_unusable(backend: table.Backend) -> str | None:
    """No GPU the flavour supports, the flavour not installed, or a wheel for a newer CUDA than
    the driver runs (``deploykit.backends.devices``)."""
    from deploykit._lazy import is_available
    from deploykit.backends.devices import cuda_build_problem, device_problem, probe_device

    module = backend.flavour.module
    if not is_available(module):
        return f"{module} is not installed; pip install 'deploykit[{backend.flavour.tag}]'"
    return device_problem(module, probe_device()) or cuda_build_problem(module)
