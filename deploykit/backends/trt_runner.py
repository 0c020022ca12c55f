"""TensorRT / TensorRT-RTX engine runner on a CUDA GPU.

Device buffers are torch CUDA tensors (torch is a dependency already, and a CUDA build of it is
what a GPU user has); inference is ``execute_async_v3`` on a dedicated CUDA stream, optionally
captured once per input shape into a CUDA graph and replayed. Feeds of any batch size work: a
batch above the engine's profile is split, one below it (a static engine) is zero-padded and the
padding dropped from the outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deploykit.backends.base import Runner
from deploykit.backends.tensorrt import _make_logger, _one_line, import_trt
from deploykit.errors import DeployKitError

EngineSource = bytes | Callable[[], bytes]


def _torch_dtype(trt: Any, dtype: Any):
    import torch

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
             "int64": torch.int64, "int8": torch.int8, "bool": torch.bool}
    for name, torch_dtype in table.items():
        if getattr(trt, name, None) == dtype:
            return torch_dtype
    raise DeployKitError(f"engine tensor type {dtype} has no torch equivalent")


class TrtRunner(Runner):
    """Runs a serialized engine.

    Args:
        engine: the serialized engine, or a callable returning it (``EngineFromPath`` checks the
            fingerprint first).
        module: ``"tensorrt"`` or ``"tensorrt_rtx"``.
        cuda_graph: capture each input shape's execution into a CUDA graph and replay it.
        device: CUDA device index.
    """

    def __init__(self, engine: EngineSource, module: str = "tensorrt", cuda_graph: bool = False, device: int = 0):
        super().__init__()
        self.engine, self.module, self.cuda_graph, self.device = engine, module, cuda_graph, device
        self.name = {"tensorrt": "trt", "tensorrt_rtx": "rtx"}[module]
        self._state: dict[str, Any] = {}

    def _activate(self) -> None:
        import torch

        trt = import_trt(self.module)
        data = self.engine() if callable(self.engine) else self.engine  # a stale engine is refused first, GPU or not
        if not torch.cuda.is_available():
            raise DeployKitError(
                f"the {self.name} runner needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False); "
                "on this machine use --backend ort"
            )
        logger = _make_logger(trt)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(data)
        logger.drain()
        if engine is None:
            raise DeployKitError(_one_line(f"{self.name}: cannot deserialize the engine: {'; '.join(logger.errors) or 'no error reported'}"))
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        lo, opt, hi = engine.get_tensor_profile_shape(inputs[0], 0)
        self._state = dict(
            trt=trt, logger=logger, runtime=runtime, engine=engine, context=engine.create_execution_context(),
            stream=torch.cuda.Stream(device=self.device), inputs=inputs, outputs=[n for n in names if n not in inputs],
            dtypes={n: _torch_dtype(trt, engine.get_tensor_dtype(n)) for n in names},
            batch_range=(lo[0], hi[0]), profiled_shapes=tuple(dict.fromkeys(tuple(s) for s in (lo, opt, hi))), buffers={}, graphs={},
        )

    def input_names(self) -> list[str]:
        return self._state.get("inputs") or super().input_names()

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
        for start in range(0, total, hi):
            chunk = {k: np.ascontiguousarray(v[start : start + hi]) for k, v in feed.items()}
            n = len(next(iter(chunk.values())))
            if n < lo:  # a static engine: pad, then drop the padded rows
                chunk = {k: np.concatenate([v, np.zeros((lo - n, *v.shape[1:]), v.dtype)]) for k, v in chunk.items()}
            parts.append({k: v[:n] for k, v in self._run(chunk).items()})
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        s = self._state
        shape = tuple(feed[s["inputs"][0]].shape)
        inputs, outputs = self._buffers(shape)
        with torch.cuda.stream(s["stream"]):
            for name in s["inputs"]:
                inputs[name].copy_(torch.from_numpy(feed[name]), non_blocking=True)
            self._execute(shape, inputs, outputs)
            host = {name: t.to("cpu", non_blocking=True) for name, t in outputs.items()}
        s["stream"].synchronize()
        return {name: t.float().numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.numpy() for name, t in host.items()}

    def _buffers(self, shape: tuple[int, ...]):
        """Device tensors for one input shape, allocated once (CUDA graphs replay fixed addresses)."""
        import torch

        s = self._state
        if shape not in s["buffers"]:
            context = s["context"]
            for name in s["inputs"]:  # the first input's shape is the feed's (height/width may be dynamic)
                context.set_input_shape(name, shape if name == s["inputs"][0] else (shape[0], *s["engine"].get_tensor_shape(name)[1:]))
            make = lambda name: torch.empty(tuple(context.get_tensor_shape(name)), dtype=s["dtypes"][name], device=self.device)  # noqa: E731
            s["buffers"][shape] = ({n: make(n) for n in s["inputs"]}, {n: make(n) for n in s["outputs"]})
        return s["buffers"][shape]

    def _execute(self, shape, inputs, outputs) -> None:
        import torch

        s = self._state
        context, stream = s["context"], s["stream"]
        for name, tensor in inputs.items():  # the context may last have run another shape
            context.set_input_shape(name, tuple(tensor.shape))
        for name, tensor in {**inputs, **outputs}.items():
            context.set_tensor_address(name, tensor.data_ptr())
        graph = s["graphs"].get(shape)
        if graph is not None:
            graph.replay()
            return
        if not context.execute_async_v3(stream.cuda_stream):
            s["logger"].drain()
            raise DeployKitError(_one_line(f"{self.name}: execute_async_v3 failed: {'; '.join(s['logger'].errors) or 'no error reported'}"))
        if self.cuda_graph:  # after one plain run (TensorRT allocates lazily on the first), capture this shape
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                context.execute_async_v3(stream.cuda_stream)
            s["graphs"][shape] = graph

    def _deactivate(self) -> None:
        self._state = {}


def engine_runner(onnx_path: str | os.PathLike, module: str, cuda_graph: bool = False) -> TrtRunner:
    """A runner for the engine ``deploykit build`` wrote beside ``onnx_path`` (fingerprint checked)."""
    from deploykit.backends.engine_cache import EngineFromPath

    return TrtRunner(EngineFromPath(onnx_path, module), module=module, cuda_graph=cuda_graph)
