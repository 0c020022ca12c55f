"""Precision plans: what ``--precision NAME`` writes beside the fp32 graph, and how it is judged.

``PLANS`` lists them. The cast plans (``fp16``, ``bf16``) are written here; the INT8 plans by
``deploykit.export.int8_static`` and ``int8_dynamic`` (nodes chosen by ``int8_selection``); the fused-attention plans (``fp32-mha``, and ``int8-mha``: the
``int8`` plan with its float attention core fused) by ``deploykit.export.fused_attention``.

TensorRT 11 (and TensorRT-RTX) build strongly typed networks only: there are no fp16/bf16
builder flags, every tensor runs in the type the graph gives it. So a "half-precision engine"
is an fp32 export rewritten with explicit ``Cast`` nodes, and this module writes that plan:

* **low** (the plan's type): MatMul, Gemm and Conv, the ops where the time goes;
* **fp32** always: positional tables and every node that reads one, LayerNormalization,
  Softmax, any custom-domain node (``deploykit::SaPE2Bias``, model-local functions) and the
  nodes producing graph outputs (the logits);
* every other node **follows** its inputs: low when all its non-constant float inputs are low,
  fp32 otherwise (where the two meet, fp32 wins, so the residual stream stays fp32 while the
  GEMMs, bias adds and GELU between them run low).

A node only goes low when its ONNX schema at the graph's opset accepts the low type (opset 18
``Conv`` has no bfloat16, so a bf16 plan keeps the patch embedding in fp32). Weights read only by
low nodes are stored in the low type; the graph input and outputs stay fp32.

Why our own pass rather than a maintained converter (checked 2026-10):
ModelOpt's AutoCast does this well, but ``nvidia-modelopt[onnx]`` replaces the CPU onnxruntime
with onnxruntime-gpu and pulls cupy and a pinned onnx; onnxconverter-common's
``convert_float_to_float16`` has no bfloat16 and does not look inside model-local functions.
The rules above fit in one readable pass. It edits the protobuf directly rather than through
onnx-graphsurgeon because graphsurgeon stores constants as numpy arrays, and numpy has no
bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto, helper, numpy_helper

from deploykit.comparison import Tolerance
from deploykit.errors import ConfigError
from deploykit.export.defaults import PLAN_NAMES
from deploykit.export.lint import TABLE_PREFIXES
from deploykit.export.metadata import GraphMetadata


@dataclass(frozen=True)
class PrecisionPlan:
    """One ``--precision`` choice.

    Attributes:
        name: the flag value and the graph file suffix (``model_224_int8.onnx``).
        summary: one line for help texts.
        tolerance: what ``validate`` (and the exporter's check of an INT8 plan) accepts.
        low: for cast plans, the ONNX type the matrix products run in.
        calibrated: activation ranges come from calibration inputs (static INT8).
        ort_only: non-empty when TensorRT cannot build the plan: the reason, for ``build``.
        write: writes the plan from an fp32 graph (a copy; the input is left as it is), given the
            ``PlanInputs`` it needs.
    """

    name: str
    summary: str
    tolerance: Tolerance
    write: Callable[[onnx.ModelProto, PlanInputs], onnx.ModelProto] = field(repr=False, compare=False)
    low: int | None = None
    calibrated: bool = False
    ort_only: str = ""


@dataclass(frozen=True)
class PlanInputs:
    """What a plan's writer may need beyond the graph (see ``apply_precision``)."""

    calibration: Any = None
    target: Any = None
    progress: Callable[[str], None] | None = None
    attention: bool | None = None
    keep_float: tuple[str, ...] = ()


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


def _as_exported(proto: onnx.ModelProto, _: PlanInputs) -> onnx.ModelProto:
    return _copy(proto)


def _cast_plan(low: int) -> Callable[[onnx.ModelProto, PlanInputs], onnx.ModelProto]:
    def write(proto: onnx.ModelProto, _: PlanInputs) -> onnx.ModelProto:
        out = _copy(proto)
        _Plan(out, low).rewrite()
        return out

    return write


def _int8(proto: onnx.ModelProto, given: PlanInputs) -> onnx.ModelProto:
    from deploykit.export import int8_selection, int8_static

    attention = int8_selection.attention_int8(proto, given.attention)
    return int8_static.quantize_static_int8(proto, given.calibration, attention, given.target, given.progress, given.keep_float)


def _int8_mha(proto: onnx.ModelProto, given: PlanInputs) -> onnx.ModelProto:
    # the attention core is float in the int8 plan: fuse it as fp32-mha does
    return _fp32_mha(_int8(proto, given), given)


def _int8_dynamic(proto: onnx.ModelProto, _: PlanInputs) -> onnx.ModelProto:
    from deploykit.export import int8_dynamic

    return int8_dynamic.quantize_dynamic_int8(proto)


def _fp32_mha(proto: onnx.ModelProto, _: PlanInputs) -> onnx.ModelProto:
    from deploykit.export import fused_attention

    return fused_attention.fuse_attention(proto)


# fp32 graphs differ from the float64 reference by summation order only; half types by their
# 11 (fp16) or 8 (bf16) mantissa bits on every product. INT8 moves logits by design, so it is
# judged by direction and ranking on the real inputs (noise lies outside the calibrated ranges):
# mean cosine >= 0.99 (healthy plans measured >= 0.997 on every zoo model at 1x and 2x and >= 0.999
# on seeded ViT-T/ViT-S, 256 and 64 held-out inputs), every cosine >= 0 (no answer points the other
# way; a near-tie input of the weakest zoo model measured 0.44), top-1 >= 75% and top-5 overlap
# >= 75% (at most 2 of validate's 8 real images may change their answer; measured >= 95% and >= 94%).
INT8_TOLERANCE = Tolerance(max_abs=None, min_cosine=0.0, min_mean_cosine=0.99, min_top1=0.75, min_top5=0.75, real_only=True)
PLANS: dict[str, PrecisionPlan] = {
    plan.name: plan
    for plan in (
        PrecisionPlan("fp32", "as exported", Tolerance(max_abs=1e-4, min_cosine=0.99999), _as_exported),
        PrecisionPlan(
            "fp16",
            "matmuls fp16; tables, LayerNorm, Softmax, logits fp32",
            Tolerance(max_abs=5e-2, min_cosine=0.999),
            _cast_plan(TensorProto.FLOAT16),
            low=TensorProto.FLOAT16,
        ),
        PrecisionPlan(
            "bf16",
            "matmuls bf16; tables, LayerNorm, Softmax, logits fp32",
            Tolerance(max_abs=2e-1, min_cosine=0.995),
            _cast_plan(TensorProto.BFLOAT16),
            low=TensorProto.BFLOAT16,
        ),
        PrecisionPlan(
            "int8",
            "Q/DQ int8 matmuls, calibrated; tables, rotations, gates, logits float (ORT and TensorRT)",
            INT8_TOLERANCE,
            _int8,
            calibrated=True,
        ),
        PrecisionPlan(
            "int8-dynamic",
            "ONNX Runtime's dynamic int8 matmuls (MatMulInteger); no calibration",
            INT8_TOLERANCE,
            _int8_dynamic,
            ort_only="int8-dynamic uses ONNX Runtime's DynamicQuantizeLinear/MatMulInteger, which TensorRT does not "
            "build; export --precision int8 for engines",
        ),
        PrecisionPlan(
            "int8-mha",
            "int8, with the float attention core fused into ONNX Runtime's MultiHeadAttention (long sequences)",
            INT8_TOLERANCE,
            _int8_mha,
            calibrated=True,
            ort_only="int8-mha uses ONNX Runtime's com.microsoft.MultiHeadAttention, which TensorRT does not parse; "
            "export --precision int8 for engines (TensorRT fuses attention itself)",
        ),
        PrecisionPlan(
            "fp32-mha",
            "fp32 with attention fused into ONNX Runtime's MultiHeadAttention (long sequences)",
            Tolerance(max_abs=1e-4, min_cosine=0.99999),
            _fp32_mha,
            ort_only="fp32-mha uses ONNX Runtime's com.microsoft.MultiHeadAttention, which TensorRT does not parse; "
            "TensorRT fuses attention itself from the fp32 graph",
        ),
    )
}
if tuple(PLANS) != PLAN_NAMES:  # the CLI offers PLAN_NAMES without importing this module
    raise ImportError(f"PLAN_NAMES {PLAN_NAMES} of export/defaults.py differs from PLANS {tuple(PLANS)}")
# Plan name -> the ONNX type its matmuls run in (None: not a cast plan).
PRECISIONS: dict[str, int | None] = {name: plan.low for name, plan in PLANS.items()}
# Where the time goes: these run in the plan's type.
LOW_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Conv"})
# Reductions whose range or accumulation fp16 cannot hold: always fp32.
FP32_OPS = frozenset({"LayerNormalization", "Softmax"})
_STANDARD_DOMAINS = ("", "ai.onnx")
# Low type -> (short name for inserted tensors, ONNX schema type name).
_LOW_NAMES = {TensorProto.FLOAT16: ("fp16", "float16"), TensorProto.BFLOAT16: ("bf16", "bfloat16")}


def check_precision(precision: str) -> PrecisionPlan:
    """The plan of that name, or ``ConfigError`` listing the valid names."""
    if precision not in PLANS:
        raise ConfigError(f"unknown precision {precision!r}; choose one of: {', '.join(PLANS)}")
    return PLANS[precision]


def apply_precision(
    proto: onnx.ModelProto,
    precision: str,
    calibration=None,
    target=None,
    progress=None,
    attention: bool | None = None,
    keep_float: tuple[str, ...] = (),
) -> onnx.ModelProto:
    """Return a copy of an fp32 ``proto`` rewritten to the ``precision`` plan (``PLANS``).

    Args:
        proto: an fp32 graph from ``onnx_from_model``.
        precision: a key of ``PLANS``.
        calibration: ``deploykit.export.int8_static.Calibration``, for plans with ``calibrated``.
        target: optional ``deploykit.export.sensitivity.QualityTarget`` for the ``int8`` plan.
        progress: optional callable taking a status line (calibration can take minutes).
        attention: ``int8``: quantize the attention products too (None: the measured choice,
            ``deploykit.export.int8_selection.ATTENTION_INT8``).
        keep_float: ``int8``: module-path patterns kept float (``--keep-float``).

    Returns:
        The planned model, with ``deploykit.precision`` in its metadata.

    Raises:
        ConfigError: unknown precision, or a calibrated plan without calibration inputs.
        ExportError: the plan could not be written (e.g. a calibration that gave NaN scales).
    """
    plan = check_precision(precision)
    if plan.calibrated and calibration is None:
        raise ConfigError(f"the {precision} plan needs calibration inputs")
    out = plan.write(proto, PlanInputs(calibration, target, progress, attention, tuple(keep_float)))
    GraphMetadata.update(out, precision=precision)
    return out


def fp32_tensors(proto: onnx.ModelProto, low: int = TensorProto.BFLOAT16) -> set[str]:
    """Output tensors of the nodes a cast plan to ``low`` would keep in fp32 (tables and their
    readers, LayerNorm, Softmax, custom ops, the logits, and what follows them): for a runtime
    that lowers precision itself (OpenVINO's bf16 hint) to keep the same nodes in fp32.

    Args:
        proto: an exported graph, of any plan (its float nodes are classified as the cast plan would).
        low: ``TensorProto.BFLOAT16`` or ``FLOAT16``.
    """
    plan = _Plan(proto, low)
    low_nodes = plan._classify()
    return {name for i, node in enumerate(plan.graph.node) if i not in low_nodes for name in node.output if name in plan.float_tensors}


class _Plan:
    """One pass over a topologically sorted graph: classify each node, then insert the casts."""

    def __init__(self, proto: onnx.ModelProto, low: int):
        self.proto, self.graph, self.low = proto, proto.graph, low
        self.low_name = _LOW_NAMES[low][0]
        self.opset = next(o.version for o in proto.opset_import if o.domain in _STANDARD_DOMAINS)
        inferred = onnx.shape_inference.infer_shapes(proto)
        infos = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
        self.float_tensors = {vi.name for vi in infos if vi.type.tensor_type.elem_type == TensorProto.FLOAT}
        self.initializers = {i.name: i for i in self.graph.initializer}
        self.float_tensors |= {n for n, i in self.initializers.items() if i.data_type == TensorProto.FLOAT}
        self.outputs = {o.name for o in self.graph.output}

    def rewrite(self) -> None:
        low_nodes = self._classify()
        dtype = {name: TensorProto.FLOAT for name in self.float_tensors}  # tensor -> type it is stored in
        self._convert_initializers(low_nodes, dtype)
        nodes, casts = [], {}
        for i, node in enumerate(self.graph.node):
            want = self.low if i in low_nodes else TensorProto.FLOAT
            for k, name in enumerate(node.input):
                if name in dtype and dtype[name] != want:
                    node.input[k] = self._cast(name, want, casts, nodes)
            if i in low_nodes:
                self._lower_node(node, dtype)
            nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        del self.graph.value_info[:]  # stale types; the lint re-infers them

    def _classify(self) -> set[int]:
        """Indices of the nodes that run in the low type."""
        low_tensors: set[str] = set()
        low_nodes = set()
        for i, node in enumerate(self.graph.node):
            floats = [n for n in node.input if n in self.float_tensors]
            live = [n for n in floats if n not in self.initializers]
            if not self._may_lower(node, floats):
                continue
            if node.op_type in LOW_PRECISION_OPS or (live and all(n in low_tensors for n in live)):
                low_nodes.add(i)
                low_tensors.update(node.output)
        return low_nodes

    def _may_lower(self, node: onnx.NodeProto, floats: list[str]) -> bool:
        if not floats or node.domain not in _STANDARD_DOMAINS or node.op_type in FP32_OPS:
            return False
        if any(n.startswith(TABLE_PREFIXES) for n in floats) or self.outputs.intersection(node.output):
            return False
        return _schema_accepts(node.op_type, self.opset, self.low)

    def _convert_initializers(self, low_nodes: set[int], dtype: dict[str, int]) -> None:
        """Store in the low type the float weights that only low nodes read (tables never)."""
        readers: dict[str, set[bool]] = {}
        for i, node in enumerate(self.graph.node):
            for name in node.input:
                readers.setdefault(name, set()).add(i in low_nodes)
        for name, init in self.initializers.items():
            if init.data_type == TensorProto.FLOAT and readers.get(name) == {True} and not name.startswith(TABLE_PREFIXES):
                init.CopyFrom(_converted(numpy_helper.to_array(init), self.low, name))
                dtype[name] = self.low

    def _cast(self, name: str, to: int, casts: dict, nodes: list) -> str:
        """Name of ``name`` cast to ``to``; the Cast is emitted once, before its first reader."""
        key = (name, to)
        if key not in casts:
            casts[key] = cast = f"{name}.to_{'fp32' if to == TensorProto.FLOAT else self.low_name}"
            if name in self.initializers:  # a weight read in both types: store both (a Cast would be an unfolded constant)
                self.graph.initializer.append(_converted(numpy_helper.to_array(self.initializers[name]), to, cast))
            else:
                nodes.append(helper.make_node("Cast", [name], [cast], name=f"cast.{cast}", to=to))
        return casts[key]

    def _lower_node(self, node: onnx.NodeProto, dtype: dict[str, int]) -> None:
        for attr in node.attribute:  # ops that name their output type
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = self.low
            elif node.op_type == "Constant" and attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_converted(numpy_helper.to_array(attr.t), self.low, attr.t.name))
        for name in node.output:
            if name in self.float_tensors:
                dtype[name] = self.low


def _schema_accepts(op_type: str, opset: int, low: int) -> bool:
    """Whether every type constraint of ``op_type`` that admits float also admits ``low``."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    low_str = f"tensor({_LOW_NAMES[low][1]})"
    return all(low_str in c.allowed_type_strs for c in schema.type_constraints if "tensor(float)" in c.allowed_type_strs)


def _converted(array, to: int, name: str) -> TensorProto:
    """``array`` converted to ONNX type ``to`` (round-to-nearest-even, as a Cast would)."""
    return numpy_helper.from_array(array.astype(helper.tensor_dtype_to_np_dtype(to)), name)
