"""TensorRT / TensorRT-RTX engine runner on a CUDA GPU, on Polygraphy's ``TrtRunner``.

Polygraphy deserializes the engine (``EngineFromBytes``) and runs it (``TrtRunner``: device
buffers, stream, shapes, output allocation). Ours around it: the fingerprint and plugin checks
before anything is loaded (``EngineFromPath``), feeds of any batch size (a batch above the
engine's profile is split, one below a static engine's is zero-padded and the padding dropped),
one call at a time per runner (an execution context is not thread-safe), and CUDA graphs, which
Polygraphy's runner does not do: its output allocator lets TensorRT choose output addresses
during each execution, which a captured graph cannot replay. With ``cuda_graph=True`` the
runner keeps fixed device buffers per input shape instead and captures the execution into a
CUDA graph when the execution context says the engine allows it (``is_stream_capturable``);
otherwise it runs without one, and ``cuda_graphs``/``cuda_graph_note`` say so.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deploykit.backends._polygraphy import FLAVOUR_NAMES, TrtMessages, backend
from deploykit.backends.base import Runner
from deploykit.backends.plugins import Plugins
from deploykit.backends.tensorrt import import_trt
from deploykit.errors import DeployKitError, one_line

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
        inputs = [n for n in _io_names(engine) if engine.get_tensor_mode(n) == import_trt(self.module).TensorIOMode.INPUT]
        lo, opt, hi = (tuple(s) for s in engine.get_tensor_profile_shape(inputs[0], 0))
        executor = _GraphExecutor(engine, self.module, self.device) if self.cuda_graph else backend(self.module).TrtRunner(engine)
        executor.activate()
        self._state = dict(engine=engine, executor=executor, inputs=inputs, batch_range=(lo[0], hi[0]),
                           profiled_shapes=tuple(dict.fromkeys((lo, opt, hi))))  # fmt: skip

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
        return isinstance(executor, _GraphExecutor) and executor.capturable is not False

    @property
    def cuda_graph_note(self) -> str:
        """Why CUDA graphs are not used ("" when they are)."""
        if not self.cuda_graph:
            return "not requested"
        executor = self._state.get("executor")
        return executor.note if isinstance(executor, _GraphExecutor) else ""

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
                parts.append({k: np.array(v[:n], dtype=np.float32 if v.dtype == np.float16 else v.dtype) for k, v in self._run(chunk).items()})
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(self._state["executor"].infer(feed))

    def _deactivate(self) -> None:
        executor = self._state.get("executor")
        if executor is not None and executor.is_active:
            executor.deactivate()
        self._state = {}


def _io_names(engine) -> list[str]:
    return [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]


class _GraphExecutor:
    """Our own part: fixed device buffers per input shape, each shape's execution captured into
    a CUDA graph after one plain run (TensorRT allocates lazily on the first) and replayed."""

    def __init__(self, engine: Any, module: str, device: int) -> None:
        self.engine, self.trt, self.device = engine, import_trt(module), device
        self.is_active, self.capturable, self.note = False, None, ""

    def activate(self) -> None:
        import torch

        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(device=self.device)
        names = _io_names(self.engine)
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == self.trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.buffers: dict[tuple, tuple[dict, dict]] = {}
        self.graphs: dict[tuple, Any] = {}
        self.is_active = True

    def deactivate(self) -> None:
        self.graphs, self.buffers, self.context, self.stream = {}, {}, None, None
        self.is_active = False

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        shape = tuple(feed[self.inputs[0]].shape)
        inputs, outputs = self._buffers(shape)
        with torch.cuda.stream(self.stream):
            for name in self.inputs:
                inputs[name].copy_(torch.from_numpy(np.ascontiguousarray(feed[name])), non_blocking=True)
            self._execute(shape, inputs, outputs)
            host = {name: t.to("cpu", non_blocking=True) for name, t in outputs.items()}
        self.stream.synchronize()
        return {name: t.float().numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.numpy() for name, t in host.items()}

    def _buffers(self, shape: tuple[int, ...]):
        """Device tensors for one input shape, allocated once (a CUDA graph replays fixed addresses)."""
        import torch

        if shape not in self.buffers:
            context = self.context
            for name in self.inputs:  # the first input's shape is the feed's (height/width may be dynamic)
                context.set_input_shape(name, shape if name == self.inputs[0] else (shape[0], *self.engine.get_tensor_shape(name)[1:]))

            def make(name):
                dtype = _TORCH_DTYPES[self.engine.get_tensor_dtype(name).name.lower()]
                return torch.empty(tuple(context.get_tensor_shape(name)), dtype=getattr(torch, dtype), device=self.device)

            self.buffers[shape] = ({n: make(n) for n in self.inputs}, {n: make(n) for n in self.outputs})
        return self.buffers[shape]

    def _execute(self, shape, inputs, outputs) -> None:
        import torch

        context, stream = self.context, self.stream
        for name, tensor in inputs.items():  # the context may last have run another shape
            context.set_input_shape(name, tuple(tensor.shape))
        for name, tensor in {**inputs, **outputs}.items():
            context.set_tensor_address(name, tensor.data_ptr())
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
            return
        if not context.execute_async_v3(stream.cuda_stream):
            raise DeployKitError(f"execute_async_v3 failed at input shape {list(shape)} (TensorRT's errors are in the debug log)")
        if self.capturable is None:
            self.capturable = bool(context.is_stream_capturable(stream.cuda_stream))
            self.note = "" if self.capturable else "the engine's execution cannot be captured (is_stream_capturable is False)"
        if self.capturable:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=stream):
                    context.execute_async_v3(stream.cuda_stream)
            except RuntimeError as err:  # CUDA refused the capture: run without graphs, and say why
                self.capturable, self.note = False, one_line(f"CUDA graph capture failed: {err}")
                return
            self.graphs[shape] = graph


# TensorRT DataType name (lowercase) -> torch dtype attribute.
_TORCH_DTYPES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "int32": "int32", "int64": "int64",
                 "int8": "int8", "bool": "bool", "uint8": "uint8"}  # fmt: skip


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
        options = BuildOptions(module=module, **stored.build, plugin_libraries=plugins.libraries,
                               sample_shapes=samples if len(set(samples)) > 1 else None)  # fmt: skip
        return EngineFromOnnx(marked, options)()

    return TrtRunner(build, module=module)
