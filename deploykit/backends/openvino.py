"""OpenVINO runner (CPU): runs the exported ONNX graphs as they are, under an explicit precision hint.

OpenVINO's CPU plugin picks the type its float ops compute in from ``INFERENCE_PRECISION_HINT``;
left unset, it computes in bf16 on CPUs with AVX512-BF16 or AMX and in f32 elsewhere, so the same
call would mean two different things on two machines. deploykit always sets the hint and every
report records it (``details["precision_hint"]``):

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
concurrent ``infer`` calls run in parallel, each on its own stream (``deploykit.runtime.streams``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.errors import DeployKitError, one_line, unknown_choice
from deploykit.runtime.base import Runner
from deploykit.runtime.streams import ExecutorPool, check_streams

# The runtime-info key deploykit marks a node to keep in f32 with (a string entry: OpenVINO 2026.4's
# CPU plugin does not read it; ``with_typed_marks`` turns the marks into the attribute it reads).
KEEP_FP32 = "disable_fp16_compression_0"
HINTS = ("f32", "bf16")


def cpu_capabilities() -> list[str]:
    """What OpenVINO's CPU plugin reports it can compute in here (``FP32``, ``BF16``, ``INT8``, ...)."""
    ov = lazy_import("openvino")
    return list(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def best_hint() -> str:
    """``bf16`` where the CPU computes in it natively, else ``f32``."""
    return "bf16" if "BF16" in cpu_capabilities() else "f32"


class OpenvinoRunner(Runner):
    """Runs an ONNX model (path or serialized bytes) with OpenVINO on the CPU.

    Args:
        model: path to a ``.onnx`` file, or its bytes.
        precision_hint: ``"f32"``, ``"bf16"`` (refused on a CPU without BF16), or None for
            OpenVINO's own default (recorded as what it resolved to).
        threads: ``INFERENCE_NUM_THREADS``; 0 lets OpenVINO choose (one per physical core).
        streams: inference streams (module docstring); 1 is the latency hint.
    """

    name = "openvino"
    # Each call takes an infer request of its own from the pool (one per stream).
    thread_safe = True

    def __init__(self, model: str | os.PathLike | bytes, precision_hint: str | None = "f32", threads: int = 0, streams: int = 1):
        super().__init__()
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
            source = openvino_source(self.model, self.precision_hint, self.seven_bit_weights)
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
        self._requests = ExecutorPool([self._compiled.create_infer_request() for _ in range(max(1, count))])
        self._inputs = [port.get_any_name() for port in self._compiled.inputs]
        self._outputs = [port.get_any_name() for port in self._compiled.outputs]

    def _config(self) -> dict:
        config = {"PERFORMANCE_HINT": "LATENCY"} if self.streams == 1 else {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": self.streams}
        if self.precision_hint is not None:
            config["INFERENCE_PRECISION_HINT"] = self.precision_hint
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = self.threads
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
    def details(self) -> dict:
        return {
            "provider": self.provider,
            "precision_hint": self.resolved_hint,
            "streams": int(self._compiled.get_property("NUM_STREAMS")) if self._compiled else self.streams,
            "computes_in": self.computes_in,  # set: the runner lowers the graph's float remainder itself
            "kept_fp32": self.kept_fp32,
            "lowered_despite_mark": self.lowered_despite_mark,
            "lowered_elsewhere": self.lowered_elsewhere,
            "int8_weights": f"{self.narrowed_weights} narrowed to 7 bits (no VNNI: 8-bit products would saturate)"
            if self.narrowed_weights
            else "as exported",
        }

    def runtime_precisions(self) -> dict[str, str]:
        """Compiled node name → the precision the CPU plugin runs it in (its execution graph)."""
        return {
            op.get_friendly_name(): op.get_rt_info()["runtimePrecision"].astype(str) for op in self._compiled.get_runtime_model().get_ops()
        }

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {name: np.ascontiguousarray(feed[name]) for name in self._inputs}
        with self._requests.take() as request:
            # share_inputs: the request reads the caller's arrays in place instead of copying them in;
            # the outputs are copied out, as the request's own buffers serve its next call.
            request.infer(inputs, share_inputs=True)
            return {name: request.get_tensor(name).data.copy() for name in self._outputs}

    def _deactivate(self) -> None:
        self._compiled = self._requests = None


class OpenvinoBf16Runner(OpenvinoRunner):
    """OpenVINO with ``INFERENCE_PRECISION_HINT`` bf16 and the plan's fp32 nodes kept in f32."""

    name = "openvino-bf16"
    computes_in = "bf16"

    def __init__(self, model: str | os.PathLike | bytes, threads: int = 0, streams: int = 1):
        super().__init__(model, precision_hint="bf16", threads=threads, streams=streams)


def int8_saturates() -> bool:
    """Whether OpenVINO's int8 products saturate on this CPU: x86 without VNNI or AMX, where a
    pair of u8·s8 products is summed in 16 bits (OpenVINO's "saturation (overflow) issue")."""
    from deploykit._cpu import cpu_instruction_sets

    isa = set(cpu_instruction_sets())
    return "sse4_2" in isa and not isa & {"avx512_vnni", "avx_vnni", "amx_int8"}


class OpenvinoSource(NamedTuple):
    """What OpenVINO reads for an exported graph."""

    graph: str | bytes  # the file's path, or ONNX bytes prepared in memory
    fp32: set[str]  # under a bf16 hint, the tensors to keep in f32
    narrowed_weights: int  # int8 weights narrowed to 7 bits
    # the part of ``fp32`` whose lowering makes a run unfaithful (``fp32_tensors(...).encoding``)
    encoding_fp32: frozenset[str] = frozenset()


def openvino_source(
    model: str | os.PathLike | bytes, precision_hint: str | None = "f32", seven_bit_weights: bool = False
) -> OpenvinoSource:
    """What OpenVINO reads for an exported graph (its path, or ONNX bytes) and, under a bf16
    hint, the tensors to keep in f32 and the part of them that must stay there
    (``deploykit.export.precision.fp32_tensors``). The file is
    never changed; what OpenVINO needs is prepared in memory:

    * OpenVINO's ONNX frontend has no rule for a custom-domain node (``deploykit::SaPE2Bias``)
      even when its model-local function gives the body, so functions are inlined first (ONNX
      Runtime and TensorRT inline them themselves). A body's nodes are the custom op's: kept in
      f32 as the bf16 plan keeps the op.
    * An int8 plan's flattened linear layers are given back their token axis
      (``linear_layers_in_3d``).
    * Each attention's packed qkv product becomes three, one per tensor (``qkv_as_three_products``).
    * With ``seven_bit_weights`` (``OpenvinoRunner`` on a CPU where ``int8_saturates``), int8
      weights are narrowed to 7 bits (``weights_in_seven_bits``).
    """
    import onnx
    import onnx.inliner

    from deploykit.export.precision import Fp32Tensors, fp32_tensors

    label = "model bytes" if isinstance(model, bytes) else str(model)
    try:
        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model))
    except Exception as err:  # protobuf's DecodeError, a missing file, ...
        raise DeployKitError(one_line(f"openvino cannot load {label}: not a readable ONNX graph: {err}")) from err
    bf16 = precision_hint == "bf16"
    fp32, required = fp32_tensors(proto) if bf16 else Fp32Tensors(set(), set())
    changed = False
    if proto.functions:
        before = {name for node in proto.graph.node for name in node.output}
        proto = onnx.inliner.inline_local_functions(proto)
        body = {name for node in proto.graph.node for name in node.output if name not in before}
        if bf16:  # a body's nodes are the custom op's: kept as the bf16 plan keeps the op
            fp32 |= body
            required |= body
        changed = True
    changed |= linear_layers_in_3d(proto) > 0
    changed |= qkv_as_three_products(proto) > 0
    narrowed = weights_in_seven_bits(proto) if seven_bit_weights else 0
    graph = proto.SerializeToString() if changed or narrowed else model if isinstance(model, bytes) else str(model)
    return OpenvinoSource(graph, fp32, narrowed, frozenset(required))


def _readers(graph) -> dict[str, list]:
    """Tensor name -> the nodes reading it."""
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def linear_layers_in_3d(proto) -> int:
    """Rewrite, in place, each quantized linear layer exported flattened (``Reshape`` to
    ``[B·N, K]``, Q/DQ, ``Gemm``, ``Reshape`` back: the form ONNX Runtime runs fastest) as a
    ``MatMul`` over ``[B, N, K]`` plus its bias, the form other exporters write; returns how many.

    OpenVINO 2026.4's low-precision ``ReshapeTransformation`` moves a per-channel dequantization
    through the ``Reshape`` after the product as if channels were axis 1: with a dynamic batch and
    more tokens than channels on a layer without bias, it fails to compile (ViT-S at 384 px: 577
    tokens, 384 channels) or, with the tokens a whole multiple of the channels, scales tokens by
    channel scales. Without that ``Reshape`` the scale stays on the last axis. A reshape back to
    more axes (``qkv``'s ``[B, N, 3, h, d]``) changes no axis before the channels, so OpenVINO
    leaves the scale before it. Same values: the Q/DQ pairs between the
    reshape and the product are per-tensor, and every reshape reads the same row-major elements.
    """
    from onnx import helper, numpy_helper

    graph = proto.graph
    if not any(node.op_type == "DequantizeLinear" for node in graph.node):
        return 0
    producer = {out: node for node in graph.node for out in node.output}
    readers = _readers(graph)
    constants = {t.name: t for t in graph.initializer}
    shapes = {v.name: v.type.tensor_type.shape.dim for v in (*graph.value_info, *graph.input) if v.type.tensor_type.HasField("shape")}

    def constant(name: str):
        return numpy_helper.to_array(constants[name]).tolist() if name in constants else None

    def static_dims(name: str) -> list[int] | None:
        """[N, the axes after it...] of a [B, N, ...] tensor, when all are static."""
        dims = shapes.get(name, ())[1:]
        return [d.dim_value for d in dims] if len(dims) >= 2 and all(d.HasField("dim_value") for d in dims) else None

    def allows_zero(reshape) -> bool:  # Reshape's only attribute: a 0 in the shape is then a size, not "as input"
        return any(a.i for a in reshape.attribute)

    def columns(weight: str) -> int | None:
        source = producer[weight].input[0] if weight in producer and producer[weight].op_type == "DequantizeLinear" else weight
        return constants[source].dims[-1] if source in constants and len(constants[source].dims) == 2 else None

    dropped: set[str] = set()  # outputs of the reshapes that go
    replaced: dict[str, list] = {}  # a Gemm's output -> the nodes that replace it
    stale: set[str] = set()  # tensors whose recorded shapes no longer hold
    for gemm in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
        if (
            gemm.op_type != "Gemm"
            or attrs.get("transA", 0)
            or attrs.get("transB", 0)
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("beta", 1.0) != 1.0
        ):
            continue
        unflatten = readers.get(gemm.output[0], [])
        if len(unflatten) != 1 or unflatten[0].op_type != "Reshape":
            continue
        unflatten = unflatten[0]
        # Back from the Gemm's input through its per-tensor Q/DQ pair to the flattening Reshape.
        chain, value = [], gemm.input[0]
        while value in producer and producer[value].op_type in ("QuantizeLinear", "DequantizeLinear") and len(readers[value]) == 1:
            node = producer[value]
            scale = constant(node.input[1])
            if scale is None or np.size(scale) != 1:
                break
            chain.append(node)
            value = node.input[0]
        flatten = producer.get(value)
        if not chain or flatten is None or flatten.op_type != "Reshape" or len(readers[value]) != 1 or allows_zero(flatten):
            continue
        x, flat, back, width = flatten.input[0], constant(flatten.input[1]), constant(unflatten.input[1]), columns(gemm.input[1])
        dims = static_dims(x)
        if dims is None or flat is None or back is None or width is None or flat != [-1, int(np.prod(dims[1:]))]:
            continue
        tokens = dims[0]
        if back[1:2] != [tokens] or int(np.prod(back[2:])) != width or allows_zero(unflatten):
            continue  # the reshape back does not give [B, N, ...] rows of this layer's outputs
        if len(dims) == 2:  # x is [B, N, K] already
            chain[-1].input[0] = x
            dropped.add(flatten.output[0])
        else:
            keep_tokens = f"{flatten.output[0]}_tokens_kept"  # 0: the input's axis (batch, tokens)
            graph.initializer.append(numpy_helper.from_array(np.array([0, 0, flat[1]], np.int64), keep_tokens))
            flatten.input[1] = keep_tokens
            stale.add(flatten.output[0])
        if back == [-1, tokens, width]:  # nothing left to reshape
            out = unflatten.output[0]
            dropped.add(out)
        else:
            out = gemm.output[0]
        stale |= {gemm.output[0], *(node.output[0] for node in chain)}
        product = f"{gemm.output[0]}_matmul" if len(gemm.input) == 3 else out
        replaced[gemm.output[0]] = [helper.make_node("MatMul", list(gemm.input[:2]), [product], name=gemm.name)]
        if len(gemm.input) == 3:
            replaced[gemm.output[0]].append(helper.make_node("Add", [product, gemm.input[2]], [out], name=f"{gemm.name}_bias"))
    if replaced:
        nodes = []
        for node in graph.node:
            if node.op_type == "Reshape" and node.output[0] in dropped:
                continue
            for new in replaced.get(node.output[0], [node]) if node.op_type == "Gemm" else [node]:
                copy = type(new)()  # the graph's own nodes are cleared below
                copy.CopyFrom(new)
                nodes.append(copy)
        del graph.node[:]
        graph.node.extend(nodes)
        infos = [info for info in graph.value_info if info.name not in stale]
        del graph.value_info[:]
        graph.value_info.extend(infos)
    return len(replaced)


def qkv_as_three_products(proto) -> int:
    """Rewrite, in place, each attention's packed ``qkv`` (one product to ``3·h·d`` channels,
    reshaped to ``[B, N, 3, h, d]``, permuted to ``[3, B, h, N, d]`` and unbound by three
    ``Slice`` + ``Squeeze``: timm's ``Attention`` as exported) as three products of ``h·d``
    channels, each reshaped to ``[B, N, h, d]`` and transposed to ``[B, h, N, d]``; returns how
    many. The same q, k and v (by their names): each output channel is the same dot product
    over the same weights, and an int8 weight keeps its per-channel scales.

    OpenVINO 2026.4 runs the 5-D permute as a standalone ``Transpose`` (9-10% of ViT-S/16's time at
    384 px, batch 8, in every OpenVINO lane) but folds a per-tensor ``[0, 2, 1, 3]`` transpose into
    its fused attention (``benchmarks/openvino_qkv.py``: 0.90-0.99x on ViT-S/16 at batch 8, in
    every lane). Matched on the form deploykit exports, a flattened ``Gemm`` or (after
    ``linear_layers_in_3d``) a ``MatMul`` plus bias, with float or per-channel int8 weights;
    anything else is left as it is.
    """
    from onnx import helper, numpy_helper

    graph = proto.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers = _readers(graph)
    constants = {t.name: t for t in graph.initializer}

    def constant(name: str):
        return numpy_helper.to_array(constants[name]) if name in constants else None

    def attrs(node) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def only_reader(name: str):
        found = readers.get(name, [])
        return found[0] if len(found) == 1 else None

    def unbound(permuted: str) -> dict[int, tuple] | None:
        """Index -> (Slice, Squeeze) taking part i of axis 0, when those are the only readers."""
        parts = {}
        for node in readers.get(permuted, []):
            if node.op_type != "Slice" or len(node.input) > 4:
                return None
            start, end = constant(node.input[1]), constant(node.input[2])
            axes = constant(node.input[3]) if len(node.input) == 4 else np.array([0])
            squeeze = only_reader(node.output[0])
            if start is None or end is None or axes is None or axes.tolist() != [0] or start.size != 1 or end.tolist() != [start[0] + 1]:
                return None
            if squeeze is None or squeeze.op_type != "Squeeze" or len(squeeze.input) != 2 or constant(squeeze.input[1]) is None:
                return None
            if constant(squeeze.input[1]).tolist() != [0]:
                return None
            parts[int(start[0])] = (node, squeeze)
        return parts if sorted(parts) == [0, 1, 2] else None

    def product_of(packed: str):
        """(product node, bias name or None, the bias Add or None) computing ``packed``."""
        node, add = producer.get(packed), None
        if node is not None and node.op_type == "Add" and node.input[1] in constants:
            add, node = node, producer.get(node.input[0])
        if node is None or only_reader(node.output[0]) is None:
            return None
        if node.op_type == "MatMul":
            return node, add.input[1] if add else None, add
        a = attrs(node)
        if (
            node.op_type == "Gemm"
            and add is None
            and not (a.get("transA", 0) or a.get("transB", 0))
            and a.get("alpha", 1.0) == a.get("beta", 1.0) == 1.0
        ):
            return node, node.input[2] if len(node.input) == 3 else None, None
        return None

    def split_weight(name: str, channels: int):
        """Per part: the nodes to add and the name of its weight, or None."""
        if name in constants:
            weight = constant(name)
            if weight.ndim != 2 or weight.shape[1] != channels:
                return None
            return [([], _part(graph, name, i, weight, channels)) for i in range(3)]
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or attrs(dq).get("axis", 1) != 1 or not all(i in constants for i in dq.input):
            return None
        values = [constant(i) for i in dq.input]
        if values[0].ndim != 2 or values[0].shape[1] != channels or any(v.shape != (channels,) for v in values[1:]):
            return None
        parts = []
        for i in range(3):
            inputs = [_part(graph, source, i, value, channels) for source, value in zip(dq.input, values)]
            parts.append(
                ([helper.make_node("DequantizeLinear", inputs, [f"{name}_part{i}"], name=f"{dq.name}_part{i}", axis=1)], f"{name}_part{i}")
            )
        return parts

    replaced: dict[str, list] = {}  # the packed product's output -> the nodes that replace the pattern
    dropped: set[str] = set()  # outputs of the pattern's other nodes
    stale: set[str] = set()  # what the pattern read: dropped below where nothing else does
    for permute in graph.node:
        if permute.op_type != "Transpose" or attrs(permute).get("perm") != [2, 0, 3, 1, 4]:
            continue
        reshape = producer.get(permute.input[0])
        if reshape is None or reshape.op_type != "Reshape" or only_reader(reshape.output[0]) is None or attrs(reshape).get("allowzero", 0):
            continue
        shape = constant(reshape.input[1])
        if shape is None or shape.shape != (5,) or shape[2] != 3 or 0 in shape.tolist() or (shape[3:] < 1).any():
            continue
        parts, found = unbound(permute.output[0]), product_of(reshape.input[0])
        if parts is None or found is None:
            continue
        product, bias_name, bias_add = found
        channels = int(shape[3] * shape[4])
        bias = constant(bias_name) if bias_name else None
        weights = split_weight(product.input[1], 3 * channels)
        if weights is None or (bias_name and (bias is None or bias.shape != (3 * channels,))):
            continue
        heads = f"{reshape.output[0]}_per_part"
        graph.initializer.append(numpy_helper.from_array(np.array([shape[0], shape[1], shape[3], shape[4]], np.int64), heads))
        nodes = []
        for i, (dequantize, weight) in enumerate(weights):
            tag = f"{product.name or product.output[0]}_part{i}"
            part_bias = _part(graph, bias_name, i, bias, 3 * channels) if bias_name else None
            nodes += dequantize
            if product.op_type == "Gemm":
                nodes.append(helper.make_node("Gemm", [product.input[0], weight, *([part_bias] if part_bias else [])], [tag], name=tag))
                out = tag
            else:
                nodes.append(helper.make_node("MatMul", [product.input[0], weight], [f"{tag}_product"], name=tag))
                out = f"{tag}_product"
                if part_bias:
                    nodes.append(helper.make_node("Add", [out, part_bias], [tag], name=f"{tag}_bias"))
                    out = tag
            nodes.append(helper.make_node("Reshape", [out, heads], [f"{tag}_heads"], name=f"{tag}_reshape"))
            squeeze = parts[i][1]
            nodes.append(
                helper.make_node(
                    "Transpose", [f"{tag}_heads"], [squeeze.output[0]], name=squeeze.name or f"{tag}_transpose", perm=[0, 2, 1, 3]
                )
            )
        replaced[product.output[0]] = nodes
        dropped |= {reshape.output[0], permute.output[0], *(node.output[0] for pair in parts.values() for node in pair)}
        if bias_add is not None:
            dropped.add(bias_add.output[0])
        dequantized = producer.get(product.input[1])  # an int8 weight's DequantizeLinear: it goes if nothing else reads it
        stale |= {product.input[1], *(dequantized.input if dequantized is not None else ()), *(n for n in (bias_name,) if n)}
        stale |= {reshape.input[1], *(name for pair in parts.values() for node in pair for name in node.input[1:])}
    if replaced:
        kept = []
        for node in graph.node:
            if node.output[0] in dropped:
                continue
            for new in replaced.get(node.output[0], [node]):
                copy = type(new)()  # the graph's own nodes are cleared below
                copy.CopyFrom(new)
                kept.append(copy)
        del graph.node[:]
        graph.node.extend(kept)
        _drop_unread(graph, stale)
        infos = [info for info in graph.value_info if info.name not in dropped and info.name not in replaced]
        del graph.value_info[:]
        graph.value_info.extend(infos)
    return len(replaced)


def _part(graph, name: str, index: int, values: np.ndarray, channels: int) -> str:
    """Part ``index`` of three of a constant's last axis (``channels`` long), added as an initializer."""
    from onnx import numpy_helper

    width = channels // 3
    part = f"{name}_part{index}"
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(values[..., index * width : (index + 1) * width]), part))
    return part


def _drop_unread(graph, names: set[str]) -> None:
    """Remove the nodes and initializers among ``names`` (tensors) that nothing reads any more."""
    read = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
    unread = names - read
    nodes = [node for node in graph.node if node.output[0] not in unread]
    read = {name for node in nodes for name in node.input} | {out.name for out in graph.output}
    unread |= names - read  # a removed node's constants
    del graph.node[:]
    graph.node.extend(nodes)
    initializers = [t for t in graph.initializer if t.name not in unread]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def weights_in_seven_bits(proto) -> int:
    """Requantize, in place, every symmetric int8 weight of the graph to 7 bits (values halved and
    rounded to [-64, 63], scales doubled); returns how many weights.

    Without VNNI, OpenVINO's CPU plugin computes int8 products with AVX2/AVX-512 instructions that
    add two u8·s8 products in 16 bits: 255·127·2 overflows it, 255·64·2 does not. The saturated
    sums made OpenVINO's int8 ViT-S/16 at 224 px (seeded) reach cosine 0.915 with fp32 on an AVX2
    CPU, where ONNX Runtime reached 0.996 on the same file (0.996 with 7-bit weights). 7-bit
    weights are OpenVINO's documented workaround (NNCF's ``overflow_fix``); they cost one bit of
    weight resolution.
    """
    from onnx import TensorProto, numpy_helper

    graph = proto.graph
    constants = {t.name: t for t in graph.initializer}
    readers = _readers(graph)
    narrowed = 0
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) < 3 or not all(name in constants for name in node.input[:3]):
            continue
        weights, scale, zero = (constants[name] for name in node.input[:3])
        if weights.data_type != TensorProto.INT8 or numpy_helper.to_array(zero).any():
            continue
        values = numpy_helper.to_array(weights)
        if values.min() >= -64 and values.max() <= 63:
            continue  # already 7-bit
        factors = numpy_helper.to_array(scale)
        for index, (tensor, array) in enumerate(((weights, np.clip(np.rint(values / 2.0), -64, 63).astype(np.int8)), (scale, factors * 2))):
            if len(readers[tensor.name]) == 1:
                tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
            else:  # shared with another node: this node gets its own copy
                node.input[index] = f"{tensor.name}_7bit_{node.output[0]}"
                graph.initializer.append(numpy_helper.from_array(array, node.input[index]))
        narrowed += 1
    return narrowed


def ops_computing(model, tensors: set[str]) -> list:
    """Every op of an OpenVINO ``model`` read from ONNX that computes one of ``tensors`` (ONNX
    output names).

    One ONNX node may become several ops (LayerNormalization becomes MVN, Multiply, Add): only
    the last carries the ONNX tensor name, so the walk goes back from it through the ops whose
    outputs have no ONNX name (the node's own decomposition) and takes those too.
    """
    ops = {op.get_name(): op for op in model.get_ops()}
    named = {key: {n for out in op.outputs() for n in out.get_names()} for key, op in ops.items()}
    found: set[str] = set()
    stack = [key for key, names in named.items() if names & tensors]
    while stack:
        key = stack.pop()
        if key in found or ops[key].get_type_name() in ("Parameter", "Constant", "Result"):
            continue
        found.add(key)
        sources = (inp.get_source_output().get_node().get_name() for inp in ops[key].inputs())
        stack += [source for source in sources if not named[source]]
    return [ops[key] for key in found]


def keep_fp32(model, tensors: set[str]) -> list:
    """Mark every op of ``model`` computing one of ``tensors`` (``ops_computing``) as kept in f32;
    returns the marked ops."""
    computing = ops_computing(model, tensors)
    for op in computing:
        op.get_rt_info()[KEEP_FP32] = ""
    return computing


def with_typed_marks(core, model, marked: set[str]):
    """``model`` with each op named in ``marked`` carrying the attribute OpenVINO's CPU plugin
    reads to keep an op out of a reduced inference precision.

    A runtime-info entry set from Python is a string, and OpenVINO 2026.4's CPU plugin reads a
    typed ``DisablePrecisionConversion`` that Python cannot create. Its IR reader creates it from
    ``<attribute name="precise" version="0"/>`` (``DisableFP16Compression``'s RTTI), so the model
    goes through an IR in memory with that attribute on each marked layer. Measured on a Xeon with
    AMX (default model, bf16 hint): every LayerNorm then ran in f32, where the string mark left
    them all in bf16."""
    import html
    import re
    import tempfile
    from pathlib import Path

    ov = lazy_import("openvino")

    def mark(match: re.Match) -> str:
        return match.group(0) + PRECISE_IR if html.unescape(match.group(1)) in marked else match.group(0)

    with tempfile.TemporaryDirectory(prefix="deploykit-openvino-") as tmp:
        xml = Path(tmp) / "model.xml"
        ov.save_model(model, xml, compress_to_fp16=False)
        text = re.sub(r'<layer id="[^"]*" name="([^"]*)" type="[^"]*" version="[^"]*">', mark, xml.read_text())
        weights = np.fromfile(xml.with_suffix(".bin"), dtype=np.uint8)
    return core.read_model(text, ov.Tensor(weights))


PRECISE_IR = '<rt_info><attribute name="precise" version="0" /></rt_info>'
# The runtime-info key of OpenVINO's low-precision ``BiasAttribute`` (``LowPrecision::Bias`` with an
# empty version): the CPU plugin looks it up by key alone, so a string entry set from Python counts.
LPT_BIAS = "LowPrecision::Bias_"


def exempt_adds_from_low_precision_passes(model, marked: set[str]) -> int:
    """Mark each ``Add`` named in ``marked`` so that OpenVINO's low-precision passes leave it in
    place; returns how many.

    After an int8 product, the low-precision ``AddTransformation`` moves the product's
    dequantization scale through the residual ``Add`` and rebuilds it as new nodes, which do not
    carry the keep-f32 mark (it is not copyable): an int8 plan's residual stream then ran in bf16
    (24 compiled nodes on a seeded ViT-S/16). The CPU plugin skips that pass for an ``Add`` marked
    as a bias; so marked, the ``Add`` stays the graph's own node, keeps its mark and runs in f32,
    and the product's scale is applied before it (``test_bf16_hint_keeps_an_int8_plan_s_residual_stream_in_f32``).
    """
    adds = [op for op in model.get_ops() if op.get_type_name() == "Add" and op.get_friendly_name() in marked]
    for op in adds:
        op.get_rt_info()[LPT_BIAS] = ""
    return len(adds)


# Compiled layer types (the CPU plugin's ``layerType``) that move or copy values without computing:
# one running in bf16 holds values rounded where they were converted, not rounded again.
_LAYOUT_LAYERS = frozenset(
    {"Reshape", "Transpose", "Concatenation", "Gather", "Split", "StridedSlice", "Pad", "Broadcast", "Tile", "Reorder"}
)
_PRODUCT_LAYERS = frozenset({"FullyConnected", "MatMul", "Convolution"})
_LOW_FLOATS = frozenset({"bf16", "f16"})


class Lowered(NamedTuple):
    """Layer type -> how many compiled nodes run marked ops below f32, in two kinds."""

    encoding: dict[str, int]  # an encoding op: the run is not faithful (``lowered_despite_mark``)
    elsewhere: dict[str, int]  # only the plan's other fp32 nodes (``lowered_elsewhere``)


def lowered_below_f32(marked: set[str], encoding_ops: dict[str, str], compiled) -> Lowered:
    """What OpenVINO compiled below f32 though marked (names are friendly names; ``encoding_ops``
    maps those of ``fp32_tensors(...).encoding`` to their op type). OpenVINO 2026.4 drops our mark
    where one of its passes replaces the op, so the runner reports what was compiled, not what it
    asked for.

    ``encoding``: nodes running an encoding op (tables' readers, rotations, LayerNorm, Softmax,
    encoding bodies, the residual stream). Two kinds of compiled node are not counted, each for a
    reason a test pins down:

    * a Softmax inside a fused attention ``Subgraph``: the Subgraph reports bf16 because its two
      products take bf16 inputs, and it computes the Softmax between them in f32 (OpenVINO's
      snippets lower Brgemm inputs only; ``test_fused_attention_keeps_its_softmax_in_f32``);
    * a layout node (``_LAYOUT_LAYERS``) whose values reach only products: they would be rounded
      for the product anyway (a rotated key transposed in bf16 is the rotated key rounded).

    ``elsewhere``: nodes holding marked ops outside ``encoding_ops`` only (the logits' product, the
    class token's batch expand on OpenVINO 2026.4): the bf16 plan keeps them in fp32, a run that
    rounds them rounds them as it rounds every product. Reported, not judged.
    """
    nodes = list(compiled.get_runtime_model().get_ops())
    layer = {id(op): op.get_rt_info()["layerType"].astype(str) for op in nodes}
    origins = {id(op): set(op.get_rt_info()["originalLayersNames"].astype(str).split(",")) for op in nodes}

    def held(op) -> set[str]:
        """The encoding ops a compiled node holds, less a fused attention's Softmax."""
        names = origins[id(op)] & encoding_ops.keys()
        if layer[id(op)] == "Subgraph":
            names = {n for n in names if encoding_ops[n] != "Softmax"}
        return names

    def feeds_products_only(op) -> bool:
        readers = [target.get_node() for out in op.outputs() for target in out.get_target_inputs()]
        return bool(readers) and all(
            layer[id(r)] in _PRODUCT_LAYERS
            or (layer[id(r)] == "Subgraph" and not held(r))
            or (layer[id(r)] in _LAYOUT_LAYERS and feeds_products_only(r))
            for r in readers
        )

    lowered = Lowered({}, {})
    for op in nodes:
        kind = layer[id(op)]
        if op.get_rt_info()["runtimePrecision"].astype(str) not in _LOW_FLOATS:
            continue
        if held(op):
            if not (kind in _LAYOUT_LAYERS and feeds_products_only(op)):
                lowered.encoding[kind] = lowered.encoding.get(kind, 0) + 1
        elif origins[id(op)] & marked and not origins[id(op)] & encoding_ops.keys():
            lowered.elsewhere[kind] = lowered.elsewhere.get(kind, 0) + 1
    return lowered
