"""TensorRT / TensorRT-RTX engine runner on a CUDA GPU, on Polygraphy's ``TrtRunner``.

Polygraphy deserializes the engine (``EngineFromBytes``) and runs it (``TrtRunner``: device
buffers, stream, shapes, output allocation). Ours around it: the fingerprint and plugin checks
before anything is loaded (``EngineFromPath``), feeds of any batch size (a batch above the
engine's profile is split, one below a static engine's is zero-padded and the padding dropped),
one call at a time per runner (an execution context is not thread-safe), and CUDA graphs, which
Polygraphy's runner does not do (``deploykit.backends.cuda_graphs``): with ``cuda_graph=True``
the runner uses that executor instead, and ``cuda_graphs``/``cuda_graph_note`` say whether the
engine allowed capture.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deploykit.backends._polygraphy import FLAVOUR_NAMES, TrtMessages, backend, import_trt
from deploykit.backends.base import Runner
from deploykit.backends.cuda_graphs import CudaGraphExecutor, io_names
from deploykit.backends.plugins import Plugins
from deploykit.errors import DeployKitError

EngineSource = bytes | Callable[[], bytes]

_log = logging.getLogger(__name__)


class TrtRunner(Runner):
    """Runs a serialized engine.

    Args:
        engine: the serialized engine, or a callable returning it (``EngineFromPath`` checks the
            fingerprint and loads the engine's plugins first).
        module: ``"tensorrt"`` or ``"tensorrt_rtx"``.
        cuda_graph: capture each input shape's execution into a CUDA graph and replay it, when
            the engine allows it.
        device: CUDA device index.
    """

    def __init__(self, engine: EngineSource, module: str = "tensorrt", cuda_graph: bool = False, device: int = 0):
        super().__init__()
        self.engine, self.module, self.cuda_graph, self.device = engine, module, cuda_graph, device
        self.name = {"tensorrt": "trt", "tensorrt_rtx": "rtx"}[module]
        self._state: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _activate(self) -> None:
        import torch

        data = self.engine() if callable(self.engine) else self.engine  # a stale engine is refused first, GPU or not
        if not torch.cuda.is_available():
            raise DeployKitError(
                f"the {self.name} runner needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False); "
                "on this machine use --backend ort"
            )
        engine = self._deserialize(data)
        inputs = [n for n in io_names(engine) if engine.get_tensor_mode(n) == import_trt(self.module).TensorIOMode.INPUT]
        lo, opt, hi = (tuple(s) for s in engine.get_tensor_profile_shape(inputs[0], 0))
        executor = CudaGraphExecutor(engine, self.module, self.device) if self.cuda_graph else backend(self.module).TrtRunner(engine)
        executor.activate()
        self._state = dict(
            engine=engine, executor=executor, inputs=inputs, batch_range=(lo[0], hi[0]), profiled_shapes=tuple(dict.fromkeys((lo, opt, hi)))
        )

    def _deserialize(self, data: bytes) -> Any:
        """The engine, by Polygraphy's ``EngineFromBytes`` (its plugins are loaded already)."""
        pg = backend(self.module)
        with TrtMessages(f"{FLAVOUR_NAMES[self.module]} runtime", _log) as messages:
            with messages.failing_as(f"{self.name}: cannot deserialize the engine", DeployKitError):
                return pg.EngineFromBytes(data)()

    def input_names(self) -> list[str]:
        return self._state.get("inputs") or super().input_names()

    @property
    def provider(self) -> str:
        trt = import_trt(self.module)
        return f"{self.module} {trt.__version__}" + (" with CUDA graphs" if self.cuda_graphs else "")

    @property
    def details(self) -> dict:
        return {**super().details, "cuda_graph": self.cuda_graphs, "cuda_graph_note": self.cuda_graph_note}

    @property
    def cuda_graphs(self) -> bool:
        """Whether executions replay CUDA graphs (requested, and the engine allows it)."""
        executor = self._state.get("executor")
        return isinstance(executor, CudaGraphExecutor) and executor.capturable is not False

    @property
    def cuda_graph_note(self) -> str:
        """Why CUDA graphs are not used ("" when they are)."""
        if not self.cuda_graph:
            return "not requested"
        executor = self._state.get("executor")
        return executor.note if isinstance(executor, CudaGraphExecutor) else ""

    @property
    def batch_range(self) -> tuple[int, int]:
        """Smallest and largest batch of the engine's optimization profile."""
        return self._state["batch_range"]

    @property
    def profiled_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self._state["profiled_shapes"]

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        lo, hi = self.batch_range
        total = len(next(iter(feed.values())))
        parts = []
        with self._lock:  # one execution context: callers on several threads (a server) take turns
            for start in range(0, total, hi):
                chunk = {k: np.ascontiguousarray(v[start : start + hi]) for k, v in feed.items()}
                n = len(next(iter(chunk.values())))
                if n < lo:  # a static engine: pad, then drop the padded rows
                    chunk = {k: np.concatenate([v, np.zeros((lo - n, *v.shape[1:]), v.dtype)]) for k, v in chunk.items()}
                # Copies: Polygraphy returns views of host buffers it reuses on the next call.
                parts.append({k: np.array(v[:n], dtype=_host_dtype(v)) for k, v in self._run(chunk).items()})
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(self._state["executor"].infer(feed))

    def _deactivate(self) -> None:
        executor = self._state.get("executor")
        if executor is not None and executor.is_active:
            executor.deactivate()
        self._state = {}


def _host_dtype(array: np.ndarray) -> np.dtype:
    """float32 for a half-precision output (what callers compare in), else its own dtype."""
    return np.dtype(np.float32) if array.dtype == np.float16 else array.dtype


def engine_runner(onnx_path: str | os.PathLike, module: str, cuda_graph: bool = False, plugins: Plugins = Plugins()) -> TrtRunner:
    """A runner for the engine ``deploykit build`` wrote beside ``onnx_path`` (fingerprint and
    plugins checked, plugins loaded before the engine is deserialized)."""
    from deploykit.backends.engine_cache import EngineFromPath

    return TrtRunner(EngineFromPath(onnx_path, module, plugins=plugins), module=module, cuda_graph=cuda_graph)


def debug_engine_runner(onnx_path: str | os.PathLike, marked: bytes, module: str, plugins: Plugins = Plugins()) -> TrtRunner:
    """A runner for a debug engine: built from ``marked`` (the graph at ``onnx_path`` with more
    outputs marked, as ``polygraphy run --trt-outputs mark`` does) with the build settings and
    profile recorded for the engine beside ``onnx_path``, so it has the same precision and shapes.

    The engine is built when the runner activates (after the engine beside ``onnx_path`` passed
    its checks: that one must be valid for a debug build of it to mean anything).
    """
    from deploykit.backends.engine_cache import EngineFromPath, engine_paths, read_fingerprint
    from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx

    def build() -> bytes:
        EngineFromPath(onnx_path, module, plugins=plugins)()  # refuses a stale engine; loads the plugins
        stored, _, _ = read_fingerprint(engine_paths(onnx_path, module)[1])
        (shapes,) = stored.shapes.values()  # [min, opt, max] of the one input
        samples = tuple(tuple(s[1:]) for s in shapes)
        options = BuildOptions(
            module=module, **stored.build, plugin_libraries=plugins.libraries, sample_shapes=samples if len(set(samples)) > 1 else None
        )
        return EngineFromOnnx(marked, options)()

    return TrtRunner(build, module=module)
