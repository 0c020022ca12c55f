"""Precision plans: what ``--precision NAME`` writes beside the fp32 graph, and how it is judged.

``PLANS`` lists them. The cast plans (``fp16``, ``bf16``) are written by ``deploykit.graph.cast``; the INT8 plans by
``deploykit.export.int8_static`` and ``int8_dynamic`` (nodes chosen by ``int8_selection``); the fused-attention plans (``fp32-mha``, and ``int8-mha``: the
``int8`` plan with its float attention core fused) by ``deploykit.graph.fused_attention``.

TensorRT 11 (and TensorRT-RTX) build strongly typed networks only: there are no fp16/bf16
builder flags, every tensor runs in the type the graph gives it. So a "half-precision engine"
is an fp32 export rewritten with explicit ``Cast`` nodes, by these rules:

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
The rules above fit in one readable pass, written on onnx_ir (as the exporter's rewrites and the
fused-attention plan are): values know their producer, readers and type, and its tensors hold
bfloat16 through ml_dtypes (onnx-graphsurgeon keeps constants as plain numpy, which has none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto

from deploykit.checks import Bar, Tolerance, bar_of
from deploykit.errors import ConfigError, unknown_choice
from deploykit.export.defaults import PLAN_NAMES
from deploykit.export.metadata import GraphMetadata, copy_metadata
from deploykit.graph.cast import LOW_PRECISION_OPS, ONNX_DOMAINS, CastPass, converted_array


@dataclass(frozen=True)
class PrecisionPlan:
    """One ``--precision`` choice.

    Attributes:
        name: the flag value and the graph file suffix (``model_224_int8.onnx``).
        summary: one line for help texts.
        criteria: the bars a graph of this plan is held to against its reference, wherever it is
            judged (``checks.check_runner``): the export's check of a quantized plan against the
            fp32 graph, ``validate`` and ``profile`` against PyTorch.
        low: for cast plans, the ONNX type the matrix products run in.
        calibrated: activation ranges come from calibration inputs (static INT8).
        ort_only: non-empty when TensorRT cannot build the plan: the reason, for ``build``.
        write: writes the plan from an fp32 graph (a copy; the input is left as it is), given the
            ``PlanInputs`` it needs; from the ``base`` plan's graph when the plan has one.
        base: the plan whose graph this one rewrites (``int8-mha``: the ``int8`` graph with its
            float attention fused), so an export asking for both makes the base plan once.
        imported: the graph is made elsewhere and brought in (``deploykit import-plan``), never
            written by ``export``.
    """

    name: str
    summary: str
    criteria: tuple[Bar, ...]
    write: Callable[[onnx.ModelProto, PlanInputs], Planned] = field(repr=False, compare=False)
    low: int | None = None
    calibrated: bool = False
    ort_only: str = ""
    base: str = ""
    imported: bool = False

    @property
    def tolerance(self) -> Tolerance:
        """The plan's ``Tolerance`` among its criteria (what a validation record reports)."""
        return bar_of(self.criteria, Tolerance)

    def criteria_for(self, computes_in: str | None) -> tuple[Bar, ...]:
        """The bars for a runner that computes this plan's graph in plan ``computes_in`` (a runtime
        that lowers precision itself, OpenVINO's bf16 hint): each bar loosened to that plan's bar of
        the same kind, so the run is held to what either plan accepts; ``criteria`` when None."""
        if computes_in is None:
            return self.criteria
        lowered = {type(bar): bar for bar in PLANS[computes_in].criteria}
        return tuple(bar.looser(lowered[type(bar)]) if type(bar) in lowered else bar for bar in self.criteria)


@dataclass(frozen=True)
class Planned:
    """A plan's graph, and its output rows on the quality target's held-out inputs where the INT8
    fallback ran exactly that graph on all of them (None otherwise): the plan check judges those
    instead of running the same graph on the same inputs again."""

    graph: onnx.ModelProto
    held_out_outputs: Any = None


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


def _as_exported(proto: onnx.ModelProto, _: PlanInputs) -> Planned:
    return Planned(_copy(proto))


def _half_plan(name: str, low: int, tolerance: Tolerance) -> PrecisionPlan:
    """The plan ``name`` whose matrix products run in ``low`` (``CastPass`` says what stays fp32)."""

    def write(proto: onnx.ModelProto, given: PlanInputs) -> Planned:
        kept = kept_fp32(proto, given.keep_float) if given.keep_float else frozenset()
        return Planned(CastPass(proto, low, keep_fp32=kept).rewrite())  # a new model: onnx_ir reads ``proto`` without changing it

    return PrecisionPlan(name, f"matmuls {name}; tables, LayerNorm, Softmax, logits fp32", (tolerance,), write, low=low)


def _int8(proto: onnx.ModelProto, given: PlanInputs) -> Planned:
    from deploykit.export import int8_selection, int8_static

    attention = int8_selection.attention_int8(proto, given.attention)
    return Planned(*int8_static.quantize_static_int8(proto, given.calibration, attention, given.target, given.progress, given.keep_float))


def _int8_dynamic(proto: onnx.ModelProto, _: PlanInputs) -> Planned:
    from deploykit.export import int8_dynamic

    return Planned(int8_dynamic.quantize_dynamic_int8(proto))


def _gpu_plan(name: str, qdq: str, low: int) -> PrecisionPlan:
    """``qdq`` (``int8``/``fp8``) Q/DQ on the matmuls and attention products over a ``low``
    remainder (``deploykit.export.gpu_plans``)."""
    low_name = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}[low]

    def write(proto: onnx.ModelProto, given: PlanInputs) -> Planned:
        from deploykit.export import gpu_plans, int8_static

        attention = True if given.attention is None else given.attention  # TensorRT fuses quantized attention
        rewrite = (lambda out: gpu_plans.int8_to_fp8(out, proto)) if qdq == "fp8" else gpu_plans.at_opset
        quantized, _ = int8_static.quantize_static_int8(
            proto, given.calibration, attention, given.target, given.progress, given.keep_float, plan=name, rewrite=rewrite
        )
        record = GraphMetadata.of(quantized).quantization
        out = with_remainder(quantized, low)
        copy_metadata(quantized, out)
        qdq_name = "float8e4m3fn" if qdq == "fp8" else "int8"
        GraphMetadata.update(out, quantization=dataclasses.replace(record, qdq_type=qdq_name, remainder=low_name))
        # the fallback's outputs were the fp32-remainder graph's: the plan check runs this one
        return Planned(out)

    what = "FP8 E4M3" if qdq == "fp8" else "int8"
    return PrecisionPlan(
        name,
        f"Q/DQ {what} matmuls and attention products, calibrated, over an {low_name} remainder; tables, rotations, gates, "
        "LayerNorm, Softmax, logits fp32 (TensorRT; ONNX Runtime checks it on CPU)",
        INT8_CRITERIA,
        write,
        calibrated=True,
    )


def _brought_in(proto: onnx.ModelProto, _: PlanInputs) -> Planned:
    raise ConfigError("the imported plan is a Q/DQ graph made elsewhere: bring it with deploykit import-plan EXPORT_DIR GRAPH")


def _fp32_mha(proto: onnx.ModelProto, _: PlanInputs) -> Planned:
    from deploykit.graph.fused_attention import fuse_attention

    fused, count = fuse_attention(proto)
    GraphMetadata.update(fused, fused_attention=count)
    return Planned(fused)


# fp32 graphs differ from the float64 reference by summation order only; half types by their
# 11 (fp16) or 8 (bf16) mantissa bits on every product. INT8 moves logits by design, so it is
# judged by direction and ranking on the real inputs (noise lies outside the calibrated ranges):
# mean cosine >= 0.99 (healthy plans measured >= 0.997 on every zoo model at 1x and 2x and >= 0.999
# on seeded ViT-T/ViT-S, 256 and 64 held-out inputs), every cosine >= 0 (no answer points the other
# way; a near-tie input of the weakest zoo model measured 0.44), top-1 >= 75% and top-5 overlap
# >= 75% (at most 2 of validate's 8 real images may change their answer; measured >= 95% and >= 94%).
#
# One set of bars per plan, the same at export (the planned graph against the fp32 graph on the
# held-out inputs), in validate and in profile (against PyTorch on validate's inputs). The INT8
# fallback's agreement target (``--min-agreement``, 99.5% by default) is not one of them: it is
# what the fallback searches for, per export, on a thousand held-out inputs, and a plan that misses
# it with the most float allowed is written with a warning; a pass/fail bar of 99.5% on validate's
# 8 real images would refuse any plan that changes one answer.
INT8_TOLERANCE = Tolerance(max_abs=None, min_cosine=0.0, min_mean_cosine=0.99, min_top1=0.75, min_top5=0.75, real_only=True)
INT8_CRITERIA: tuple[Bar, ...] = (INT8_TOLERANCE,)
FP32_CRITERIA: tuple[Bar, ...] = (Tolerance(max_abs=1e-4, min_cosine=0.99999),)
PLANS: dict[str, PrecisionPlan] = {
    plan.name: plan
    for plan in (
        PrecisionPlan("fp32", "as exported", FP32_CRITERIA, _as_exported),
        _half_plan("fp16", TensorProto.FLOAT16, Tolerance(max_abs=5e-2, min_cosine=0.999)),
        _half_plan("bf16", TensorProto.BFLOAT16, Tolerance(max_abs=2e-1, min_cosine=0.995)),
        PrecisionPlan(
            "int8",
            "Q/DQ int8 matmuls, calibrated; tables, rotations, gates, logits float (ORT and TensorRT)",
            INT8_CRITERIA,
            _int8,
            calibrated=True,
        ),
        PrecisionPlan(
            "int8-dynamic",
            "ONNX Runtime's dynamic int8 matmuls (MatMulInteger); no calibration",
            INT8_CRITERIA,
            _int8_dynamic,
            ort_only="int8-dynamic uses ONNX Runtime's DynamicQuantizeLinear/MatMulInteger, which TensorRT does not "
            "build; export --precision int8 for engines",
        ),
        PrecisionPlan(
            "int8-mha",
            "int8, with the float attention core fused into ONNX Runtime's MultiHeadAttention (long sequences)",
            INT8_CRITERIA,
            _fp32_mha,  # the attention core is float in the int8 plan: fused as fp32-mha fuses it
            calibrated=True,
            base="int8",
            ort_only="int8-mha uses ONNX Runtime's com.microsoft.MultiHeadAttention, which TensorRT does not parse; "
            "export --precision int8 for engines (TensorRT fuses attention itself)",
        ),
        PrecisionPlan(
            "fp32-mha",
            "fp32 with attention fused into ONNX Runtime's MultiHeadAttention (long sequences)",
            FP32_CRITERIA,  # the same float graph, its attention fused
            _fp32_mha,
            ort_only="fp32-mha uses ONNX Runtime's com.microsoft.MultiHeadAttention, which TensorRT does not parse; "
            "TensorRT fuses attention itself from the fp32 graph",
        ),
        _gpu_plan("fp8", "fp8", TensorProto.FLOAT16),
        _gpu_plan("int8-fp16", "int8", TensorProto.FLOAT16),
        PrecisionPlan(
            "imported",
            "a Q/DQ graph made elsewhere (ModelOpt, QAT), brought in by deploykit import-plan and checked against the checkpoint",
            INT8_CRITERIA,  # judged like the INT8 plans: direction and ranking on real inputs
            _brought_in,
            imported=True,
        ),
    )
}
if tuple(PLANS) != PLAN_NAMES:  # the CLI offers PLAN_NAMES without importing this module
    raise ImportError(f"PLAN_NAMES {PLAN_NAMES} of export/defaults.py differs from PLANS {tuple(PLANS)}")
# Plan name -> the ONNX type its matmuls run in (None: not a cast plan).
PRECISIONS: dict[str, int | None] = {name: plan.low for name, plan in PLANS.items()}


def kept_fp32(proto: onnx.ModelProto, patterns) -> frozenset[str]:
    """The products (MatMul, Gemm, Conv) a cast plan keeps in fp32 for ``--keep-float`` patterns
    (module paths with wildcards, or ONNX names; ``names.matching_nodes``).

    Raises:
        ConfigError: a pattern that matches no product.
    """
    from deploykit.export import names

    products = [n.name for n in proto.graph.node if n.op_type in LOW_PRECISION_OPS and n.domain in ONNX_DOMAINS]
    return frozenset(names.matching_nodes(patterns, products, names.module_paths(proto)))


def is_quantized(precision: str) -> bool:
    """Whether the plan quantizes (its graph is checked against fp32 on held-out inputs, and a
    calibrated one reads calibration inputs): the INT8 plans and the GPU plans (``gpu_plans``)."""
    return precision.startswith("int8") or check_precision(precision).calibrated


def check_precision(precision: str) -> PrecisionPlan:
    """The plan of that name, or ``ConfigError`` listing the valid names."""
    if precision not in PLANS:
        raise ConfigError(unknown_choice("precision", precision, PLANS))
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
    return plan_graph(proto, precision, PlanInputs(calibration, target, progress, attention, tuple(keep_float))).graph


def plan_graph(proto: onnx.ModelProto, precision: str, given: PlanInputs) -> Planned:
    """``apply_precision``, with the planned graph's outputs on the target's held-out inputs where
    the INT8 fallback computed them (``Planned``).

    Raises:
        ConfigError: unknown precision, or a calibrated plan without calibration inputs.
    """
    plan = check_precision(precision)
    if plan.calibrated and given.calibration is None:
        raise ConfigError(f"the {precision} plan needs calibration inputs")
    planned = plan.write(PLANS[plan.base].write(proto, given).graph, given) if plan.base else plan.write(proto, given)
    GraphMetadata.update(planned.graph, precision=precision)
    return planned


def apply_precision_to_base(planned: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """The ``precision`` plan written from the graph of the plan it builds on (``PrecisionPlan.base``),
    which ``apply_precision`` would otherwise make again: ``int8-mha`` from an ``int8`` graph,
    same calibration and float nodes, its attention fused.

    Raises:
        ConfigError: ``precision`` has no base plan, or ``planned`` is not a graph of that plan.
    """
    plan = check_precision(precision)
    given = GraphMetadata.of(planned).precision
    if not plan.base or given != plan.base:
        raise ConfigError(f"the {precision} plan is not written from a {given or 'fp32'} graph")
    out = plan.write(planned, PlanInputs()).graph
    GraphMetadata.update(out, precision=precision)
    return out


def scales_in(proto: onnx.ModelProto, low: int) -> onnx.ModelProto:
    """``proto`` (in place) with every Q/DQ scale rounded to a value ``low`` holds exactly, so a
    pair whose Q stays fp32 and whose DQ gives ``low`` reads the same scale on both sides."""
    import numpy as np
    from onnx import numpy_helper

    from deploykit.export.gpu_plans import _QDQ

    weights = {t.name: t for t in proto.graph.initializer}
    done = set()
    for node in proto.graph.node:
        if node.op_type in _QDQ and len(node.input) > 1 and node.input[1] in weights and node.input[1] not in done:
            tensor = weights[node.input[1]]
            rounded = converted_array(numpy_helper.to_array(tensor), low).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(rounded, tensor.name))
            done.add(node.input[1])
    return proto


def with_remainder(qdq: onnx.ModelProto, low: int) -> onnx.ModelProto:
    """The Q/DQ graph ``qdq`` with its remainder in ``low`` (``TensorProto.FLOAT16``/``BFLOAT16``)
    by the cast plans' rules (``precision.CastPass``), each DQ feeding only low products in ``low``."""
    proto = onnx.ModelProto()
    proto.CopyFrom(qdq)
    from deploykit.export.gpu_plans import at_opset

    return CastPass(scales_in(at_opset(proto), low), low, qdq=True).rewrite()
