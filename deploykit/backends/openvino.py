"""OpenVINO runner (CPU): runs the exported ONNX graphs as they are, under an explicit precision hint.

OpenVINO's CPU plugin picks the type its float ops compute in from ``INFERENCE_PRECISION_HINT``;
left unset, it computes in bf16 on CPUs with AVX512-BF16 or AMX and in f32 elsewhere, so the same
call would mean two different things on two machines. deploykit always sets the hint and every
report records it (the runner's ``info.precision``):

* ``f32``: what the graph says (an fp16/bf16 plan's casts and an int8 plan's Q/DQ pairs stay as
  written); judged by the graph's own plan tolerance.
* ``bf16``: only on a CPU that has it (``OPTIMIZATION_CAPABILITIES`` lists ``BF16``). The
  products run in bf16, but the nodes the project's own bf16 plan keeps in fp32 (positional
  tables and every node reading one, i.e. the rotations, LayerNorm, Softmax, custom-op bodies,
  the logits) are marked to stay in f32 (``with_typed_marks``: the attribute the CPU plugin
  reads; marked ``Add`` nodes are also exempted from the low-precision pass that would rebuild an
  int8 plan's residual ``Add`` without the mark). OpenVINO drops a mark where one of its passes
  replaces the op, so the runner reads the compiled graph back: ``lowered_despite_mark`` counts encoding ops (tables' readers, rotations,
  LayerNorm, Softmax, encoding bodies) that run below f32, and ``profile`` never chooses such a
  run by default; ``lowered_elsewhere`` reports the plan's other fp32 nodes (the logits).
  Judged by the bf16 plan's tolerance.
* ``None`` (benchmarks only): OpenVINO's own default, recorded as the precision it resolved to.

``PERFORMANCE_HINT`` is ``LATENCY`` (one stream over all cores) by default. With ``streams`` > 1 it
is ``THROUGHPUT`` with that many ``NUM_STREAMS`` (OpenVINO caps it at the cores it has), and the
runner keeps one infer request per stream (``OPTIMAL_NUMBER_OF_INFER_REQUESTS``) in a pool, so
concurrent ``infer`` calls run in parallel, each on its own stream (``deploykit.runners.streams``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.backends.openvino_audit import lowered_below_f32
from deploykit.backends.openvino_marks import exempt_adds_from_low_precision_passes, keep_fp32, ops_computing, with_typed_marks
from deploykit.errors import DeployKitError, one_line, unknown_choice
from deploykit.runners.base import CpuPrecision, RunInfo, Runner
from deploykit.runners.cpu import int8_saturates
from deploykit.runners.streams import ExecutorPool, check_streams

HINTS = ("f32", "bf16")


def cpu_capabilities() -> list[str]:
    """What OpenVINO's CPU plugin reports it can compute in here (``FP32``, ``BF16``, ``INT8``, ...)."""
    ov = lazy_import("openvino")
    return list(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def best_hint() -> str:
    """``bf16`` where the CPU computes in it natively, else ``f32``."""
    return "bf16" if "BF16" in cpu_capabilities() else "f32"


@dataclass
class _Request:
    """One infer request of the pool and the input shapes it has run (``OpenvinoRunner._infer``)."""

    request: Any  # openvino.InferRequest
    shapes: set[tuple[tuple[int, ...], ...]] = field(default_factory=set)


class OpenvinoRunner(Runner):
    """Runs an ONNX model (path or serialized bytes) with OpenVINO on the CPU.

    Args:
        model: path to a ``.onnx`` file, or its bytes.
        precision_hint: ``"f32"``, ``"bf16"`` (refused on a CPU without BF16), or None for
            OpenVINO's own default (recorded as what it resolved to).
        threads: ``INFERENCE_NUM_THREADS``; 0 lets OpenVINO choose (one per physical core). A runner
            given its threads leaves them unpinned (``ENABLE_CPU_PINNING`` off), as others run beside it.
        streams: inference streams (module docstring); 1 is the latency hint.
        compiled_kernels: under an f32 hint, run SaPE²'s distances in deploykit's compiled
            extension (``deploykit.kernels``) instead of the function body. Off by
            default: OpenVINO runs an extension op through its reference ``evaluate`` path, and in
            ``benchmarks/results/sape2-floor.json`` it is no faster than the body beyond 224 px.
    """

    name = "openvino"
    # Each call takes an infer request of its own from the pool (one per stream).
    thread_safe = True

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        precision_hint: str | None = "f32",
        threads: int = 0,
        streams: int = 1,
        compiled_kernels: bool = False,
    ):
        super().__init__()
        self.compiled_kernels = compiled_kernels
        self.kernels = ""  # what computed deploykit's custom ops (RunInfo.kernels), once active
        self._why_body = ""  # why SaPE²'s op runs its function body, where it does
        if precision_hint is not None and precision_hint not in HINTS:
            raise DeployKitError(unknown_choice("OpenVINO precision hint", precision_hint, HINTS))
        self.model, self.precision_hint, self.threads, self.streams = model, precision_hint, threads, check_streams(streams)
        self._compiled = self._requests = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self.kept_fp32 = 0  # nodes marked to stay in f32 under a bf16 hint
        # layer type -> compiled nodes running an encoding op (tables, rotations, LayerNorm, Softmax)
        # below f32 though marked: the run is not faithful (``lowered_despite_mark``)
        self.lowered_despite_mark: dict[str, int] = {}
        self.lowered_elsewhere: dict[str, int] = {}  # the same for the plan's other fp32 nodes (the logits)
        self.seven_bit_weights = int8_saturates()  # on this CPU, int8 weights are narrowed to 7 bits
        self.narrowed_weights = 0  # how many the loaded graph had

    def _activate(self) -> None:
        ov = lazy_import("openvino")
        if self.precision_hint == "bf16" and "BF16" not in cpu_capabilities():
            raise DeployKitError(
                "openvino-bf16: this CPU has no native bf16 (OpenVINO reports "
                f"{', '.join(cpu_capabilities())}); use --backend openvino (f32)"
            )
        core = ov.Core()
        try:
            kernel_threads = self._kernels(core)
            source = openvino_source(self.model, self.precision_hint, self.seven_bit_weights, kernel_threads)
            if kernel_threads is None and ("deploykit", "SaPE2Bias") in source.custom_ops:
                self.kernels = f"deploykit::SaPE2Bias: ONNX function body ({self._why_body or 'no extension'})"
            self.narrowed_weights = source.narrowed_weights
            model = core.read_model(source.graph)
            if self.precision_hint == "bf16":
                kept = keep_fp32(model, source.fp32)
                self.kept_fp32 = len(kept)
                marked = {op.get_friendly_name() for op in kept}
                encoding_ops = {op.get_friendly_name(): op.get_type_name() for op in ops_computing(model, source.encoding_fp32)}
                model = with_typed_marks(core, model, marked)
                exempt_adds_from_low_precision_passes(model, marked)
            self._compiled = core.compile_model(model, "CPU", self._config())
            if self.precision_hint == "bf16":
                self.lowered_despite_mark, self.lowered_elsewhere = lowered_below_f32(marked, encoding_ops, self._compiled)
        except RuntimeError as err:  # OpenVINO raises RuntimeError (its ov::Exception) for unreadable or unsupported graphs
            raise DeployKitError(one_line(f"openvino cannot load {self._label()}: {err}")) from err
        count = int(self._compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        self._requests = ExecutorPool([_Request(self._compiled.create_infer_request()) for _ in range(max(1, count))])
        self._first_calls = threading.Lock()
        self._inputs = [port.get_any_name() for port in self._compiled.inputs]
        self._outputs = [port.get_any_name() for port in self._compiled.outputs]

    def _kernels(self, core) -> int | None:
        """Load the compiled extension into ``core`` where it is wanted (``compiled_kernels``, an
        f32 hint: a bf16 plan keeps the op's body, marked f32) and the graph has deploykit's ops;
        the threads its op is to use, else None, with ``self._why_body`` saying why for a graph
        that turns out to have them. ``self.kernels`` says which form runs."""
        from deploykit.kernels import compiled_library
        from deploykit.runners.onnxrt import _mentions

        self.kernels = ""
        self._why_body = (
            "compiled_kernels=False"
            if not self.compiled_kernels
            else "a bf16 hint keeps the op's body, marked f32"
            if self.precision_hint == "bf16"
            else ""
        )
        if self._why_body or not _mentions(self.model if isinstance(self.model, bytes) else str(self.model), ["SaPE2Bias"]):
            return None  # the default: the graph is read once, by openvino_source
        library = compiled_library("openvino")
        if library.path is None:
            self._why_body = library.reason
            return None
        core.add_extension(str(library.path))
        self.kernels = "deploykit::SaPE2Bias: signatures and distances in deploykit's compiled extension (deploykit::SaPE2Signatures, deploykit::SaPE2Distance)"
        cores = os.cpu_count() or 1
        return self.threads or max(1, cores // self.streams)

    def _config(self) -> dict:
        config = {"PERFORMANCE_HINT": "LATENCY"} if self.streams == 1 else {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": self.streams}
        if self.precision_hint is not None:
            config["INFERENCE_PRECISION_HINT"] = self.precision_hint
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = self.threads
            # A share of the cores is one of several runners side by side (a server's model
            # instances, each a process). OpenVINO pins a process's inference threads from core 0
            # up, so two processes of one thread each would both run on core 0 at half speed.
            config["ENABLE_CPU_PINNING"] = False
        return config

    def _label(self) -> str:
        return "model bytes" if isinstance(self.model, bytes) else str(self.model)

    def input_names(self) -> list[str]:
        return self._inputs if self._compiled else super().input_names()

    @property
    def resolved_hint(self) -> str:
        """The precision OpenVINO computes float ops in (what the hint resolved to); meaningful once active."""
        return self._compiled.get_property("INFERENCE_PRECISION_HINT").to_string() if self._compiled else "not active"

    @property
    def provider(self) -> str:
        if not self._compiled:
            return "not active"
        ov = lazy_import("openvino")
        return f"OpenVINO {ov.get_version().split('-')[0]} CPU, INFERENCE_PRECISION_HINT {self.resolved_hint}"

    @property
    def parallel_calls(self) -> int:
        """How many ``infer`` calls run at once (its infer requests); 1 before activation."""
        return self._requests.size if self._requests else 1

    @property
    def info(self) -> RunInfo:
        weights = (
            f"{self.narrowed_weights} narrowed to 7 bits (no VNNI: 8-bit products would saturate)"
            if self.narrowed_weights
            else "as exported"
        )
        streams = int(self._compiled.get_property("NUM_STREAMS")) if self._compiled else self.streams
        precision = CpuPrecision(
            self.resolved_hint, streams, self.computes_in, self.kept_fp32, self.lowered_despite_mark, self.lowered_elsewhere, weights
        )
        return RunInfo(self.provider, precision=precision, kernels=self.kernels)

    def runtime_precisions(self) -> dict[str, str]:
        """Compiled node name → the precision the CPU plugin runs it in (its execution graph)."""
        return {
            op.get_friendly_name(): op.get_rt_info()["runtimePrecision"].astype(str) for op in self._compiled.get_runtime_model().get_ops()
        }

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {name: np.ascontiguousarray(feed[name]) for name in self._inputs}
        shapes = tuple(inputs[name].shape for name in self._inputs)
        with self._requests.take() as slot:
            # A request's first call at an input shape specializes the graph for it (allocation,
            # shape inference, kernel choice). Several requests doing that at once contend inside
            # the CPU plugin's thread pools, which can deadlock on few cores (ultralytics#25923),
            # so first calls take turns; calls at a shape the request has run go in parallel.
            with contextlib.nullcontext() if shapes in slot.shapes else self._first_calls:
                # share_inputs: the request reads the caller's arrays in place instead of copying them
                # in; the outputs are copied out, as the request's own buffers serve its next call.
                slot.request.infer(inputs, share_inputs=True)
            slot.shapes.add(shapes)
            return {name: slot.request.get_tensor(name).data.copy() for name in self._outputs}

    def _deactivate(self) -> None:
        self._compiled = self._requests = None


class OpenvinoBf16Runner(OpenvinoRunner):
    """OpenVINO with ``INFERENCE_PRECISION_HINT`` bf16 and the plan's fp32 nodes kept in f32."""

    name = "openvino-bf16"
    computes_in = "bf16"

    def __init__(self, model: str | os.PathLike | bytes, threads: int = 0, streams: int = 1):
        super().__init__(model, precision_hint="bf16", threads=threads, streams=streams)


class OpenvinoSource(NamedTuple):
    """What OpenVINO reads for an exported graph."""

    graph: str | bytes  # the file's path, or ONNX bytes prepared in memory
    fp32: set[str]  # under a bf16 hint, the tensors to keep in f32
    narrowed_weights: int  # int8 weights narrowed to 7 bits
    # the part of ``fp32`` whose lowering makes a run unfaithful (``fp32_tensors(...).encoding``)
    encoding_fp32: frozenset[str] = frozenset()
    custom_ops: frozenset[tuple[str, str]] = frozenset()  # (domain, op type) outside ONNX's, as exported


def openvino_source(
    model: str | os.PathLike | bytes, precision_hint: str | None = "f32", seven_bit_weights: bool = False, kernel_threads: int | None = None
) -> OpenvinoSource:
    """What OpenVINO reads for an exported graph (its path, or ONNX bytes) and, under a bf16
    hint, the tensors to keep in f32 and the part of them that must stay there
    (``deploykit.graph.cast.fp32_tensors``). The file is never changed: OpenVINO's rule set
    (``deploykit.graph.openvino.prepare_for_openvino``) is applied in memory. A model-local
    function's inlined body is the custom op's: kept in f32 as the bf16 plan keeps the op. With
    ``seven_bit_weights`` (``OpenvinoRunner`` on a CPU where ``int8_saturates``), int8 weights are
    narrowed to 7 bits. With ``kernel_threads`` (the extension of ``deploykit.kernels``
    is loaded), each ``deploykit::SaPE2Bias`` is split as TensorRT's plugin form is: its signature
    stage inlined, its distances the extension's ``SaPE2Distance`` on that many threads.
    """
    import onnx

    from deploykit.graph.cast import Fp32Tensors, fp32_tensors
    from deploykit.graph.openvino import prepare_for_openvino
    from deploykit.graph.plugin_nodes import custom_ops

    label = "model bytes" if isinstance(model, bytes) else str(model)
    try:
        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
    except Exception as err:  # protobuf's DecodeError, a missing file, ...
        raise DeployKitError(one_line(f"openvino cannot load {label}: not a readable ONNX graph: {err}")) from err
    exported_ops = frozenset(custom_ops(proto))
    fp32, required = fp32_tensors(proto) if precision_hint == "bf16" else Fp32Tensors(set(), set())
    split = kernel_threads is not None and _split_for_kernels(proto, kernel_threads)
    prepared = prepare_for_openvino(proto, seven_bit_weights)
    if precision_hint == "bf16":
        fp32 |= prepared.inlined
        required |= prepared.inlined
    graph = prepared.proto.SerializeToString() if prepared.changed or split else model if isinstance(model, bytes) else str(model)
    return OpenvinoSource(graph, fp32, prepared.narrowed_weights, frozenset(required), exported_ops)


def _split_for_kernels(proto, threads: int) -> bool:
    """Split every ``deploykit::SaPE2Bias`` of ``proto`` (in place) for the compiled extension,
    its distance nodes told their threads; False where the graph has none (or predates the
    signature stage's own function)."""
    from onnx import helper

    from deploykit.graph.plugin_nodes import COMPILED_SIGNATURES, for_cpu_kernels, has_companions, plugin_ops
    from deploykit.kernels import OPS

    if not plugin_ops(proto, OPS) or not has_companions(proto):
        return False
    for_cpu_kernels(proto, OPS)
    for node in proto.graph.node:
        if (node.domain, node.op_type) in OPS | {COMPILED_SIGNATURES}:
            node.attribute.append(helper.make_attribute("threads", threads))
    return True
