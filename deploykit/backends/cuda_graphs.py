"""CUDA graphs for a TensorRT engine: the part of running engines deploykit keeps as its own.

Two flavours, two mechanisms:

* TensorRT-RTX compiles kernels lazily per input shape, so capturing its ``execute_async_v3``
  from outside may record a compilation; it captures graphs itself when the execution context is
  created with an ``IRuntimeConfig`` whose ``cuda_graph_strategy`` is ``WHOLE_GRAPH_CAPTURE``
  (``rtx_runtime.rtx_context``; ``rtx_graph_note`` reads back what it runs with). Polygraphy's
  runner then runs that context as any other. Whether an execution was captured is judged by the
  engine's builder flag (``REQUIRE_USER_ALLOCATION``, in its record: no allocation at run time,
  so capture is possible at every shape) and by the context's ``is_stream_capturable``
  (``rtx_capture_note``).
* TensorRT has no such strategy and no ``is_stream_capturable`` (only TensorRT-RTX's context has
  it): the application captures ``execute_async_v3`` into a CUDA graph itself, as TensorRT's
  developer guide describes and ``trtexec --useCudaGraph`` does. Polygraphy's ``TrtRunner``
  cannot: its output allocator lets TensorRT choose output addresses on every execution, and a
  graph replays fixed ones. ``CudaGraphExecutor`` keeps fixed device buffers per input shape,
  runs each new shape once plainly (TensorRT allocates lazily and must see the shape before a
  capture), then captures and replays. Whether the engine can be captured is learnt by trying:
  a capture whose ``execute_async_v3`` returns False, or that CUDA invalidates (engines with
  loops, conditionals or data-dependent shapes), is discarded, never replayed, and the executor
  runs without graphs from then on; ``note`` says why.

Device memory, streams and graph capture come from ``torch.cuda`` through ``TorchCudaDevice``;
the executor takes any object with its four methods, so its TensorRT calls are checked on a
machine without a GPU against TensorRT's real classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from deploykit.backends._polygraphy import import_trt
from deploykit.errors import DeployKitError, one_line

CAPTURE_REFUSED = "execute_async_v3 failed while being captured into a CUDA graph"


def io_names(engine) -> list[str]:
    """The engine's input and output tensor names, in TensorRT's order."""
    return [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]


def rtx_graph_note(context: Any, trt: Any) -> str:
    """Why a TensorRT-RTX context asked for CUDA graphs will not capture them ("" when it will): the
    strategy as the context's own runtime config holds it, not what was asked."""
    strategy = context.get_runtime_config().cuda_graph_strategy
    if strategy != trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE:
        return (
            f"TensorRT-RTX's execution context runs with cuda_graph_strategy {getattr(strategy, 'name', strategy)}, not WHOLE_GRAPH_CAPTURE"
        )
    return ""


def rtx_capture_note(context: Any, stream_ptr: int, shape: tuple[int, ...], guaranteed: bool = False) -> str:
    """Why TensorRT-RTX cannot capture the execution just run at ``shape`` on ``stream_ptr`` ("" when
    it can), judged by the engine's builder flag and the context's own answer together.

    ``guaranteed``: the engine was built with ``REQUIRE_USER_ALLOCATION`` (its record says so), which
    rules out allocation at run time for every shape (a layer that needs it fails the build), so a
    capture is refused only by the stream. Without the flag TensorRT-RTX allocates at run time where
    a shape exceeds its static allocation, and a capture needs ``is_stream_capturable`` (False then,
    and for data-dependent shapes or on-device control flow: TensorRT-RTX 1.2 release notes).
    """
    if context.is_stream_capturable(stream_ptr):
        return ""
    what = f"TensorRT-RTX cannot capture the execution at input shape {list(shape)} into a CUDA graph (is_stream_capturable is False"
    if guaranteed:
        return f"{what} on this stream, although the engine was built with REQUIRE_USER_ALLOCATION)"
    return f"{what}: the engine was built without REQUIRE_USER_ALLOCATION, so it may allocate at run time; deploykit build --require-user-allocation builds one that never does)"


class TorchCudaDevice:
    """Streams, buffers and graph capture on one CUDA device, through ``torch.cuda``."""

    def __init__(self, index: int) -> None:
        self.index = index

    def stream(self) -> Any:
        import torch

        return torch.cuda.Stream(device=self.index)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=self.index)

    @contextlib.contextmanager
    def capture(self, stream: Any) -> Iterator[Any]:
        """Capture what is enqueued on ``stream`` in the block; yields the graph (replayable
        after the block). CUDA's refusal raises ``RuntimeError``."""
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            yield graph

    def run_on(self, stream: Any) -> contextlib.AbstractContextManager:
        import torch

        return torch.cuda.stream(stream)


class CudaGraphExecutor:
    """Fixed device buffers per input shape, each shape's execution captured into a CUDA graph
    after one plain run and replayed (TensorRT; see the module docstring).

    Args:
        engine: a deserialized TensorRT engine.
        module: its TensorRT flavour (``"tensorrt"``).
        device: CUDA device index, or an object with ``TorchCudaDevice``'s methods.
    """

    def __init__(self, engine: Any, module: str, device: int | Any = 0) -> None:
        self.engine, self.trt = engine, import_trt(module)
        self.device = TorchCudaDevice(device) if isinstance(device, int) else device
        self.is_active, self.capturable, self.note = False, None, ""

    def activate(self) -> None:
        self.context = self.engine.create_execution_context()
        if not self.context:
            raise DeployKitError("TensorRT could not create an execution context (TensorRT's errors are in the debug log)")
        self.stream = self.device.stream()
        names = io_names(self.engine)
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == self.trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.buffers: dict[tuple, tuple[dict, dict]] = {}
        self.graphs: dict[tuple, Any] = {}
        self.is_active = True

    def set_profile(self, index: int) -> None:
        """Run in optimization profile ``index`` from now on (as Polygraphy's ``TrtRunner.set_profile``);
        the buffers and graphs of the previous profile are dropped, since shapes were bound in it."""
        if not self.context.set_optimization_profile_async(index, self.stream.cuda_stream):
            raise DeployKitError(f"TensorRT could not switch the execution context to optimization profile {index}")
        self.buffers, self.graphs = {}, {}

    def deactivate(self) -> None:
        self.graphs, self.buffers, self.context, self.stream = {}, {}, None, None
        self.is_active = False

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        shape = tuple(feed[self.inputs[0]].shape)
        inputs, outputs = self._buffers(shape)
        with self.device.run_on(self.stream):
            for name in self.inputs:
                inputs[name].copy_(torch.from_numpy(np.ascontiguousarray(feed[name])), non_blocking=True)
            self._execute(shape, inputs, outputs)
            host = {name: t.to("cpu", non_blocking=True) for name, t in outputs.items()}
        self.stream.synchronize()
        return {name: t.float().numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.numpy() for name, t in host.items()}

    def _buffers(self, shape: tuple[int, ...]):
        """Device tensors for one input shape, allocated once (a CUDA graph replays fixed addresses)."""
        if shape not in self.buffers:
            context = self.context
            for name in self.inputs:  # the first input's shape is the feed's (height/width may be dynamic)
                if not context.set_input_shape(
                    name, shape if name == self.inputs[0] else (shape[0], *self.engine.get_tensor_shape(name)[1:])
                ):
                    raise DeployKitError(f"the engine does not take input shape {list(shape)} (outside its optimization profile)")

            def make(name):
                return self.device.empty(
                    tuple(context.get_tensor_shape(name)), _TORCH_DTYPES[self.engine.get_tensor_dtype(name).name.lower()]
                )

            self.buffers[shape] = ({n: make(n) for n in self.inputs}, {n: make(n) for n in self.outputs})
        return self.buffers[shape]

    def _execute(self, shape, inputs, outputs) -> None:
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
        if self.capturable is not False:
            self._capture(shape)

    def _capture(self, shape) -> None:
        """Capture this shape's execution (its outputs are already computed by the plain run);
        keep the graph only when TensorRT enqueued the whole execution into it."""
        try:
            with self.device.capture(self.stream) as graph:
                enqueued = self.context.execute_async_v3(self.stream.cuda_stream)
        except RuntimeError as err:  # CUDA invalidated the capture
            self.capturable, self.note = False, one_line(f"CUDA graph capture failed: {err}")
            return
        if not enqueued:  # the graph holds part of an execution, or none: replaying it would give stale outputs
            self.capturable, self.note = False, CAPTURE_REFUSED
            return
        self.capturable, self.graphs[shape] = True, graph


# TensorRT DataType name (lowercase) -> torch dtype attribute.
_TORCH_DTYPES = {
    "float": "float32",
    "half": "float16",
    "bf16": "bfloat16",
    "int32": "int32",
    "int64": "int64",
    "int8": "int8",
    "bool": "bool",
    "uint8": "uint8",
}
