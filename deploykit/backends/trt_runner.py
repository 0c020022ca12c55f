"""TensorRT / TensorRT-RTX engine runner on a CUDA GPU, on Polygraphy's ``TrtRunner``.

Polygraphy deserializes the engine (``EngineFromBytes``) and runs it (``TrtRunner``: device
buffers, stream, shapes, output allocation). Ours around it:

* the device check before anything is loaded: no CUDA GPU, or one the flavour does not support
  (TensorRT-RTX runs on a few compute capabilities only, ``deploykit.backends.devices``), is one
  line naming the backend to use instead, and so is a TensorRT wheel built for a newer CUDA than
  the driver runs (naming the wheel to install); then the fingerprint and plugin checks
  (``EngineFromPath``), and for TensorRT-RTX its own verdict on the engine's header;
* feeds of any batch size (a batch above the engine's profiles is split, one below every
  profile's is zero-padded and the padding dropped), each call run in the optimization profile
  that fits it (``deploykit.backends.profiles.choose_profile``: an engine may have several), one
  call at a time per runner (an execution context is not thread-safe);
* CUDA graphs, which Polygraphy's runner does not do (``deploykit.backends.cuda_graphs``):
  TensorRT-RTX captures them itself when its context is created for it (reported as used only
  while that context reads the strategy back and TensorRT-RTX says each execution run so far
  is capturable); for TensorRT our
  executor captures and replays (it needs a CUDA build of torch for its buffers; without one the
  runner runs plainly and ``cuda_graph_note`` says why);
* TensorRT-RTX's runtime cache (``deploykit.backends.rtx_runtime``): the kernels it compiles
  for the GPU, read from a file beside the engine and written back when the runner deactivates,
  so the next process does not compile them again;
* a weight-stripped engine (``deploykit build --strip-weights``) gets its weights back when it
  is deserialized (``refit_from_onnx``), before any call: from its refit graph, whose
  initializers are in the one weights file every resolution's stripped engine of the flavour
  shares (``deploykit.backends.shared_weights``; checked against the engine's record first);
* TensorRT's own messages: every call runs inside ``TrtMessages``, so an error TensorRT logs
  becomes the one-line ``DeployKitError`` of a failed call and its warnings reach the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deploykit.backends._polygraphy import TrtMessages, backend, import_trt
from deploykit.backends.cuda_graphs import CudaGraphExecutor, io_names, rtx_capture_note, rtx_graph_note
from deploykit.backends.devices import Device, check_cuda_build, check_device, check_rtx_engine, probe_device
from deploykit.backends.plugins import Plugins
from deploykit.backends.profiles import batch_range, choose_profile
from deploykit.backends.rtx_runtime import RuntimeCache, rtx_context
from deploykit.errors import DeployKitError, StaleEngineError, one_line
from deploykit.runners.base import CudaGraphUse, RunInfo, Runner
from deploykit.runners.table import flavour

EngineSource = bytes | Callable[[], bytes]

_log = logging.getLogger(__name__)


class TrtRunner(Runner):
    """Runs a serialized engine.

    Args:
        engine: the serialized engine, or a callable returning it (``EngineFromPath`` checks the
            fingerprint and loads the engine's plugins first).
        module: ``"tensorrt"`` or ``"tensorrt_rtx"``.
        cuda_graph: replay each input shape's execution as a CUDA graph, when the engine allows it.
        device: CUDA device index.
        device_info: what ``probe_device(device)`` reports; probed when None (tests pass one in).
        runtime_cache: portable flavours only (TensorRT-RTX): the file its runtime cache is kept in (read when the
            runner activates, written when it deactivates); None keeps none.
        refit_from: the ONNX graph a weight-stripped engine is refitted from when deserialized
            (its refit graph, ``shared_weights``); None for an engine that carries its weights.
        capture_guaranteed: TensorRT-RTX: the engine was built with ``REQUIRE_USER_ALLOCATION``
            (``EngineRecord.capture_guaranteed``), so no execution allocates at run time and the
            first execution's ``is_stream_capturable`` stands for every shape
            (``cuda_graphs.rtx_capture_note``); otherwise each execution is asked.
    """

    def __init__(
        self,
        engine: EngineSource,
        module: str = "tensorrt",
        cuda_graph: bool = False,
        device: int = 0,
        device_info: Device | None = None,
        runtime_cache: str | os.PathLike | None = None,
        refit_from: str | os.PathLike | None = None,
        capture_guaranteed: bool = False,
    ):
        super().__init__()
        self.refit_from, self.capture_guaranteed = refit_from, capture_guaranteed
        self.engine, self.module, self.cuda_graph, self.device, self.device_info = engine, module, cuda_graph, device, device_info
        self.flavour = flavour(module)
        self.runtime_cache = RuntimeCache(runtime_cache) if runtime_cache is not None and self.flavour.portable else None
        self.name = self.flavour.tag
        self._state: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _activate(self) -> None:
        check_device(self.module, self.device_info or probe_device(self.device))  # before anything is read or loaded
        check_cuda_build(self.module)  # a CUDA 13 wheel on an older driver fails on its first CUDA call, obscurely
        data = self.engine() if callable(self.engine) else self.engine
        trt, pg = import_trt(self.module), backend(self.module)
        runtime = trt.Runtime(pg.get_trt_logger())
        if self.flavour.portable:
            check_rtx_engine(runtime, data, f"the {self.name} engine")
        with self._tensorrt("cannot deserialize the engine"):
            engine = pg.EngineFromBytes(data, runtime=runtime)()
        if self.refit_from is not None:
            with self._tensorrt(f"cannot refit the weight-stripped engine from {os.path.basename(self.refit_from)}"):
                refit_from_onnx(trt, engine, self.refit_from, pg.get_trt_logger())
        inputs = [n for n in io_names(engine) if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        profiles = [tuple(tuple(s) for s in engine.get_tensor_profile_shape(inputs[0], i)) for i in range(engine.num_optimization_profiles)]
        executor, note = self._executor(engine, trt, pg)
        with self._tensorrt("cannot create an execution context"):
            executor.activate()
        self._state = dict(
            engine=engine,
            executor=executor,
            inputs=inputs,
            profiles=profiles,
            profile=0,  # the execution context starts in profile 0
            batch_range=batch_range(profiles),
            profiled_shapes=tuple(dict.fromkeys(s for p in profiles for s in p)),
            note=note,
        )

    def _executor(self, engine: Any, trt: Any, pg: Any) -> tuple[Any, str]:
        """What runs the engine, and why CUDA graphs are not used ("" when they are)."""
        note = "" if self.cuda_graph else "not requested"
        if self.flavour.captures_cuda_graphs and (self.cuda_graph or self.runtime_cache is not None):
            with self._tensorrt(f"cannot create an execution context{' with CUDA graphs' if self.cuda_graph else ''}"):
                context = rtx_context(engine, trt, self.cuda_graph, self.runtime_cache)
            return pg.TrtRunner(context), rtx_graph_note(context, trt) if self.cuda_graph else note
        if not self.cuda_graph:
            return pg.TrtRunner(engine), note
        import torch

        if not torch.cuda.is_available():
            return pg.TrtRunner(engine), "CUDA graphs need a CUDA build of torch for their buffers (torch.cuda.is_available() is False)"
        return CudaGraphExecutor(engine, self.module, self.device), ""

    @contextlib.contextmanager
    def _tensorrt(self, what: str) -> Iterator[None]:
        """A call into TensorRT: its errors become one ``DeployKitError`` line (``<runner>: what:
        <TensorRT's errors>``), its warnings go to the log."""
        with TrtMessages(f"{self.flavour.title} runtime", _log) as messages:
            with messages.failing_as(f"{self.name}: {what}", DeployKitError):
                try:
                    yield
                except DeployKitError as err:
                    if not messages.errors:
                        raise
                    raise DeployKitError(one_line(f"{err}: {'; '.join(messages.errors)}")) from err

    def input_names(self) -> list[str]:
        return self._state.get("inputs") or super().input_names()

    @property
    def provider(self) -> str:
        trt = import_trt(self.module)
        return f"{self.module} {trt.__version__}" + (" with CUDA graphs" if self.cuda_graphs else "")

    @property
    def info(self) -> RunInfo:
        return RunInfo(self.provider, cuda_graphs=CudaGraphUse(self.cuda_graphs, self.cuda_graph_note))

    @property
    def cuda_graphs(self) -> bool:
        """Whether executions replay CUDA graphs (requested, and the engine allows it)."""
        if not self.cuda_graph or self._state.get("note"):
            return False
        executor = self._state.get("executor")
        return not isinstance(executor, CudaGraphExecutor) or executor.capturable is not False

    @property
    def cuda_graph_note(self) -> str:
        """Why CUDA graphs are not used ("" when they are)."""
        executor = self._state.get("executor")
        if isinstance(executor, CudaGraphExecutor) and executor.note:
            return executor.note
        return self._state.get("note", "" if self.cuda_graph else "not requested")

    @property
    def batch_range(self) -> tuple[int, int]:
        """Smallest and largest batch of the engine's optimization profiles."""
        return self._state["batch_range"]

    @property
    def profiled_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self._state["profiled_shapes"]

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        hi = self.batch_range[1]
        total = len(next(iter(feed.values())))
        parts = []
        with self._lock:  # one execution context: callers on several threads (a server) take turns
            for start in range(0, total, hi):
                chunk = {k: np.ascontiguousarray(v[start : start + hi]) for k, v in feed.items()}
                n = len(next(iter(chunk.values())))
                padded = self._select_profile(tuple(next(iter(chunk.values())).shape))
                if n < padded:  # below the profile's batches (a static engine): pad, then drop the padded rows
                    chunk = {k: np.concatenate([v, np.zeros((padded - n, *v.shape[1:]), v.dtype)]) for k, v in chunk.items()}
                # Copies: Polygraphy returns views of host buffers it reuses on the next call.
                parts.append({k: np.array(v[:n], dtype=_host_dtype(v)) for k, v in self._run(chunk).items()})
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _select_profile(self, shape: tuple[int, ...]) -> int:
        """Switch the context to the profile that fits a call of ``shape`` (``choose_profile``);
        a batch below every profile's runs padded to the smallest batch that fits. Returns the
        batch the call runs at."""
        profiles = self._state["profiles"]
        batch = shape[0]
        if all(batch < p[0][0] for p in profiles):
            batch = min(p[0][0] for p in profiles)
        index = choose_profile(profiles, (batch, *shape[1:]))
        if index != self._state["profile"]:
            with self._tensorrt(f"cannot switch to optimization profile {index}"):
                self._state["executor"].set_profile(index)
            self._state["profile"] = index
        return batch

    def _run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._tensorrt("inference failed"):
            outputs = dict(self._state["executor"].infer(feed))
        if self.flavour.captures_cuda_graphs and self.cuda_graph and not self._state["note"] and not self._state.get("judged"):
            # TensorRT-RTX captures inside execute_async_v3 and says nothing of it: ask it whether it could
            # (Polygraphy's runner holds the context and the stream it ran on), per execution unless the
            # engine's builder flag rules out allocation at run time, when the first answer stands.
            executor, shape = self._state["executor"], tuple(next(iter(feed.values())).shape)
            self._state["note"] = rtx_capture_note(executor.context, executor.stream.ptr, shape, self.capture_guaranteed)
            self._state["judged"] = self.capture_guaranteed
        return outputs

    def layer_names(self) -> list[str]:
        """The engine's layers as its inspector lists them (fused layers named after the ONNX
        nodes they hold); each entry is a name, or a dict with ``Name`` at detailed verbosity."""
        engine = self._state.get("engine")
        if engine is None:
            return []
        trt = import_trt(self.module)
        info = json.loads(engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON))
        return [layer if isinstance(layer, str) else str(layer.get("Name", "")) for layer in info.get("Layers", [])]

    def _deactivate(self) -> None:
        executor = self._state.get("executor")
        if executor is not None and executor.is_active:
            executor.deactivate()
        self._state = {}
        if self.runtime_cache is not None:  # what this process compiled, for the next one
            self.runtime_cache.save()


def refit_from_onnx(trt: Any, engine: Any, onnx_path: str | os.PathLike, logger: Any) -> None:
    """Give a weight-stripped (``STRIP_PLAN``) engine the weights of the graph it was built from,
    through TensorRT's ONNX parser refitter (``OnnxParserRefitter.refit_from_file``, then
    ``Refitter.refit_cuda_engine``), as NVIDIA's developer guide describes for stripped engines.

    Raises:
        DeployKitError: the parser could not read the weights, or TensorRT did not refit the engine.
    """
    refitter = trt.Refitter(engine, logger)
    parser = trt.OnnxParserRefitter(refitter, logger)
    if not parser.refit_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "no detail"
        raise DeployKitError(f"TensorRT's parser could not read the weights of {os.path.basename(onnx_path)}: {errors}")
    if not refitter.refit_cuda_engine():
        raise DeployKitError(
            f"TensorRT did not refit the engine from {os.path.basename(onnx_path)} (weights missing: {refitter.get_missing_weights()})"
        )


def _host_dtype(array: np.ndarray) -> np.dtype:
    """float32 for a half-precision output (what callers compare in), else its own dtype."""
    return np.dtype(np.float32) if array.dtype == np.float16 else array.dtype


def engine_runner(
    onnx_path: str | os.PathLike, module: str, cuda_graph: bool = False, plugins: Plugins | None = None, device: Device | None = None
) -> TrtRunner:
    """A runner for the engine ``deploykit build`` wrote beside ``onnx_path`` (device, fingerprint
    and plugins checked, plugins loaded before the engine is deserialized; for TensorRT-RTX its
    runtime cache kept beside it). ``plugins`` None: the installed plugin packages the engine's
    fingerprint names (``EngineFromPath``).

    Raises:
        DeployKitError: no engine was built for ``onnx_path`` (at once; the rest when activated).
    """
    from deploykit.backends.engine_cache import EngineFromPath, read_fingerprint, require_engine, runtime_cache_path

    _, fp_path = require_engine(onnx_path, module)  # said first: whatever the machine, the engine is to be built
    source = EngineFromPath(onnx_path, module, device, plugins)
    try:
        record = read_fingerprint(fp_path)
    except StaleEngineError:  # EngineFromPath refuses it when the runner activates, in order with the device checks
        record = None
    refit_from = None
    if record is not None and record.weights_stripped:  # the flavour's one weight set, else (recorded before it) its own graph
        shared = record.shared_weights
        refit_from = Path(onnx_path).parent / shared.refit_graph if shared is not None else onnx_path
    cache = runtime_cache_path(onnx_path)
    return TrtRunner(
        source,
        module,
        cuda_graph,
        device_info=device,
        runtime_cache=cache,
        refit_from=refit_from,
        capture_guaranteed=record is not None and record.capture_guaranteed,
    )


def debug_engine_runner(
    onnx_path: str | os.PathLike, marked: bytes, module: str, plugins: Plugins | None = None, device: Device | None = None
) -> TrtRunner:
    """A runner for a debug engine: built from ``marked`` (the graph at ``onnx_path`` with more
    outputs marked, as ``polygraphy run --trt-outputs mark`` does) with the build settings and
    profile recorded for the engine beside ``onnx_path``, so it has the same precision and shapes.

    The engine is built when the runner activates (after the engine beside ``onnx_path`` passed
    its checks: that one must be valid for a debug build of it to mean anything).
    """
    from deploykit.backends.engine_cache import EngineFromPath, engine_paths, installed_plugins, read_fingerprint
    from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx

    def build() -> bytes:
        EngineFromPath(onnx_path, module, device, plugins)()  # refuses a stale engine
        record = read_fingerprint(engine_paths(onnx_path, module)[1])
        stored = record.fingerprint
        (shapes,) = stored.shapes.values()  # [min, opt, max] of the one input
        samples = tuple(tuple(s[1:]) for s in shapes)
        options = BuildOptions(module=module, **stored.build, sample_shapes=samples if len(set(samples)) > 1 else None)
        # With its weights: nothing refits a debug engine (and refit flags change no precision or shape).
        options = dataclasses.replace(options, refittable=False, strip_weights=False)
        return EngineFromOnnx(marked, options, plugins=plugins if plugins is not None else installed_plugins(record))()

    return TrtRunner(build, module=module, device_info=device)
