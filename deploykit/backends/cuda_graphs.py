"""CUDA graphs for a TensorRT engine: the part of running engines deploykit keeps as its own.

Polygraphy's ``TrtRunner`` does not capture CUDA graphs, and cannot be made to: its output
allocator lets TensorRT choose output addresses during each execution, and a captured graph
replays fixed addresses. ``CudaGraphExecutor`` keeps fixed device buffers (torch CUDA tensors)
per input shape, runs each shape once plainly (TensorRT allocates lazily on the first run), then
captures the execution into a CUDA graph when the execution context says the engine allows it
(``is_stream_capturable``) and replays it; otherwise it runs without one and ``note`` says why.
It has the activate/infer/deactivate shape of Polygraphy's runner, so ``TrtRunner`` uses either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deploykit.backends._polygraphy import import_trt
from deploykit.errors import DeployKitError, one_line


def io_names(engine) -> list[str]:
    """The engine's input and output tensor names, in TensorRT's order."""
    return [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]


class CudaGraphExecutor:
    """Fixed device buffers per input shape, each shape's execution captured into a CUDA graph
    after one plain run and replayed (see the module docstring).

    Args:
        engine: a deserialized engine.
        module: its TensorRT flavour.
        device: CUDA device index.
    """

    def __init__(self, engine: Any, module: str, device: int) -> None:
        self.engine, self.trt, self.device = engine, import_trt(module), device
        self.is_active, self.capturable, self.note = False, None, ""

    def activate(self) -> None:
        import torch

        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(device=self.device)
        names = io_names(self.engine)
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
