"""INT8 plans: which nodes of an fp32 graph are quantized, and the quantized graph itself.

Two plans, both written beside the fp32 graph like the fp16 plan:

* ``int8`` — explicit QuantizeLinear/DequantizeLinear pairs on the inputs of the matrix
  products (the form TensorRT's explicit quantization and ONNX Runtime both read): weights
  int8 per output channel, symmetric; activations int8 per tensor, symmetric, with ranges
  calibrated on real inputs. Outputs and biases stay float (TensorRT refuses an int32 bias
  ``DequantizeLinear``, and quantizing an output only adds a rounding step before float ops).
* ``int8-dynamic`` — ONNX Runtime's dynamic form (``DynamicQuantizeLinear`` + ``MatMulInteger``,
  fused to ``DynamicQuantizeMatMul`` on CPU): weights int8 per channel, activation ranges taken
  per call, so no calibration. ONNX Runtime only (TensorRT has no such ops).

Encoding-aware selection (``select_nodes``): only MatMul, Gemm and Conv are candidates, so
LayerNorm, Softmax, the rotations and every other elementwise op stay float by construction.
Among the candidates these stay float too, each for a reason recorded in the graph:
``logits`` (the head: its output is the answer), ``table`` (a node reading a positional table),
``float-module`` (inside a module that declares ``KeepsFloat``: positional encodings and MoPE's
EGA gate, whose projection becomes a multiplicative gate on attention) and ``attention`` (the
q·kᵀ and attention·v products, unless the plan quantizes them; see ``ATTENTION_INT8``). Custom
ops (``deploykit::SaPE2Bias``) are model-local functions the quantizer never enters.

Calibrator: ONNX Runtime's ``onnxruntime.quantization`` (``quantize_static``, min-max /
percentile / entropy calibrators). It ships with the onnxruntime the project already depends on
and writes standard QDQ. TensorRT Model Optimizer's ONNX PTQ writes the same form, but
``nvidia-modelopt[onnx]`` 0.47.0 requires ``onnxruntime-gpu~=1.24.2``, ``onnx~=1.21.0`` and
``cupy-cuda12x`` on Linux x86-64 (its wheel metadata, read 2026-11-24), against the CPU
onnxruntime 1.32 and onnx 1.23 this project runs on.

Over 400 lines: selection, calibration, the agreement check that moves nodes back to float, and
the recorded plan are the steps of one plan and share its node names; apart, each would need
the others' internals.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from deploykit._terminal import counter
from deploykit.comparison import Tolerance, compare_logits, row_cosines
from deploykit.errors import ConfigError, ExportError
from deploykit.export.lint import TABLE_PREFIXES
from deploykit.export.manifest import QUANTIZATION_METADATA_KEY
from deploykit.export.onnx_export import quiet_logger

QUANTIZED_OP_TYPES = ("MatMul", "Gemm", "Conv")
# User-facing method name -> onnxruntime.quantization.CalibrationMethod member.
CALIBRATION_METHODS = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}
# Whether the static plan quantizes the attention-score and attention-value MatMuls, per
# encoding, measured on the zoo (`python benchmarks/int8_plans.py attention`,
# results/int8-attention.json, 2000 test images): quantizing them lowered top-1 agreement with
# fp32 at 2x the training resolution for every encoding (ape 0.980 -> 0.878, rope-axial 0.994 ->
# 0.934, rope-mixed 0.991 -> 0.959, gridpe 0.992 -> 0.910, geope 0.987 -> 0.850, wepe 1.000 ->
# 0.996, mope 0.992 -> 0.973, sape2 0.987 -> 0.937, sape2+ape 0.993 -> 0.986), so all keep them
# float. What quantizing them would gain is the int8+attn column of the speed benchmark.
ATTENTION_INT8: dict[str, bool] = {
    "ape": False,
    "rope-axial": False,
    "rope-mixed": False,
    "gridpe": False,
    "geope": False,
    "wepe": False,
    "mope": False,
    "sape2": False,
    "sape2+ape": False,
}
# Ops between the head's product and the logits output that only move values around.
_SHAPE_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Transpose"})
_CALIBRATION_BATCH = 8
# Held-out inputs each node's sensitivity is measured on (a forward pass per quantizable node).
_RANKING_INPUTS = 128


@dataclass(frozen=True)
class CalibrationOptions:
    """How ``export`` calibrates and checks the ``int8`` plan.

    Attributes:
        samples: calibration inputs (``--calibration-samples``).
        method: a key of ``CALIBRATION_METHODS`` (``--calibration-method``).
        held_out: held-out inputs the plan is checked on (agreement target and tolerance).
        min_agreement: top-1 agreement with the fp32 graph to aim for on the held-out inputs,
            falling back to float where missed (``AgreementTarget``); None: no fallback. 99.5%
            so that 99% holds on inputs the plan never saw: at 1000 held-out inputs the
            agreement's standard error near 99% is 0.3 points, and a 99% target measured on
            the zoo's val split left test-split agreement at 98.6-98.8% on three models.
        attention: quantize the attention-score and attention-value products too; None: the
            measured choice for the encoding (``ATTENTION_INT8``: float for every encoding).
    """

    samples: int = 128
    method: str = "minmax"
    held_out: int = 1000
    min_agreement: float | None = 0.995
    attention: bool | None = None

    def __post_init__(self):
        _check_method(self.method)
        if self.samples < 1 or self.held_out < 1:
            raise ConfigError(f"calibration needs at least one sample and one held-out input, got {self.samples} and {self.held_out}")
        if self.min_agreement is not None and not 0 < self.min_agreement <= 1:
            raise ConfigError(f"the agreement target must be in (0, 1], got {self.min_agreement}")


@dataclass(frozen=True)
class Calibration:
    """Inputs that calibrate activation ranges, and how.

    Attributes:
        inputs: ``[N, ...]`` float32 images (or int64 token ids) in the graph's input layout.
        source: where they came from (recorded in the graph and the manifest).
        method: a key of ``CALIBRATION_METHODS``.
    """

    inputs: np.ndarray
    source: str
    method: str = "minmax"

    def __post_init__(self):
        _check_method(self.method)
        if len(self.inputs) == 0:
            raise ConfigError("calibration needs at least one input")


def _check_method(method: str) -> None:
    if method not in CALIBRATION_METHODS:
        raise ConfigError(f"unknown calibration method {method!r}; choose one of: {', '.join(CALIBRATION_METHODS)}")


@dataclass
class NodeSelection:
    """The candidate nodes of an fp32 graph: those to quantize, and those kept float with why."""

    quantize: list[str] = field(default_factory=list)
    keep_float: dict[str, str] = field(default_factory=dict)  # node name -> reason

    def summary(self) -> dict:
        reasons: dict[str, list[str]] = {}
        for name, reason in self.keep_float.items():
            reasons.setdefault(reason, []).append(name)
        return {"quantized_nodes": len(self.quantize), "float_nodes": reasons}


def select_nodes(proto: onnx.ModelProto, attention: bool) -> NodeSelection:
    """Split the graph's MatMul/Gemm/Conv nodes into quantized and float (module docstring).

    Args:
        proto: an fp32 graph written by ``onnx_from_model`` (names every node; records
            ``deploykit.float_modules``).
        attention: quantize the products of two activations (q·kᵀ, attention·v) too.
    """
    graph = proto.graph
    meta = {p.key: p.value for p in proto.metadata_props}
    float_modules = tuple(json.loads(meta.get("deploykit.float_modules", "[]")))
    weights = {i.name for i in graph.initializer}
    head = _head_nodes(graph)
    selection = NodeSelection()
    for node in graph.node:
        if node.op_type not in QUANTIZED_OP_TYPES or node.domain not in ("", "ai.onnx"):
            continue
        if node.name in head:
            reason = "logits"
        elif any(name.startswith(TABLE_PREFIXES) for name in node.input):
            reason = "table"
        elif any(scope == m or scope.startswith(m + ".") for scope in _scopes(node) for m in float_modules):
            reason = "float-module"
        elif not attention and not any(name in weights for name in node.input):
            reason = "attention"
        else:
            selection.quantize.append(node.name)
            continue
        selection.keep_float[node.name] = reason
    return selection


def attention_int8(proto: onnx.ModelProto, override: bool | None = None) -> bool:
    """``override``, else the measured choice for the graph's encoding (``ATTENTION_INT8``;
    float when unmeasured)."""
    if override is not None:
        return override
    encoding = next((p.value for p in proto.metadata_props if p.key == "deploykit.encoding"), "")
    return ATTENTION_INT8.get(encoding, False)


def _head_nodes(graph: onnx.GraphProto) -> set[str]:
    """Nodes whose output reaches a graph output through shape ops only (the head's product)."""
    producer = {out: node for node in graph.node for out in node.output}
    found, frontier = set(), [o.name for o in graph.output]
    while frontier:
        node = producer.get(frontier.pop())
        if node is None or node.name in found:
            continue
        found.add(node.name)
        if node.op_type in _SHAPE_OPS:
            frontier.append(node.input[0])
    return found


def _scopes(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            return ast.literal_eval(prop.value)
    return []


@dataclass(frozen=True)
class AgreementTarget:
    """What the static plan aims for on held-out inputs, falling back to float where it misses.

    Attributes:
        inputs: held-out real inputs (not the calibration ones; never a test split).
        reference: the fp32 graph's outputs on them (``run_graph`` rows).
        min_agreement: share of held-out predictions whose arg-max matches the fp32 graph's.
        max_float_share: at most this share of the quantizable nodes falls back to float.
    """

    inputs: np.ndarray
    reference: np.ndarray
    min_agreement: float = CalibrationOptions.min_agreement
    max_float_share: float = 0.25


def quantize_static_int8(
    proto: onnx.ModelProto,
    calibration: Calibration,
    attention: bool = False,
    target: AgreementTarget | None = None,
    progress: Callable[[str], None] | None = None,
) -> onnx.ModelProto:
    """The ``int8`` plan of an fp32 graph: QDQ on the selected nodes' inputs, calibrated.

    With a ``target``, the plan is measured on held-out inputs against the fp32 graph; when top-1
    agreement misses it, nodes move back to float one at a time, most sensitive first (each
    node quantized alone, ranked by flipped predictions, then by mean ``1 - cosine``), until it
    is met or ``max_float_share`` is used up. Calibration runs once; every trial reuses its
    ranges. The nodes moved are recorded with reason ``sensitivity``.

    Args:
        proto: fp32 graph from ``onnx_from_model``.
        calibration: the inputs and method.
        attention: quantize the attention MatMuls too (``ATTENTION_INT8`` holds the measured
            choice per encoding).
        target: held-out inputs and the agreement to aim for; None: quantize every selected node.
        progress: optional callable taking a status line.

    Returns:
        The quantized graph, with ``deploykit.quantization`` in its metadata.

    Raises:
        ExportError: the calibration gave a scale that is NaN, infinite or not positive (the
            nodes are named), or the quantizer failed.
    """
    selection = select_nodes(proto, attention)
    details = {
        "plan": "int8",
        "calibration": calibration.method,
        "samples": len(calibration.inputs),
        "calibration_data": calibration.source,
        "attention_int8": attention,
    }
    # The quantizer logs "consider pre-processing" advice on the root logger.
    with tempfile.TemporaryDirectory(prefix="deploykit-int8-") as tmp, quiet_logger(""):
        tick = counter(progress, f"calibrating ({calibration.method})", len(calibration.inputs), "inputs")
        quantizer = _StaticQuantizer(proto, calibration, Path(tmp), tick)
        out = quantizer.quantize(selection.quantize)
        if target is not None:
            out, details["agreement"] = _fall_back(quantizer, selection, out, target, progress)
    return _with_metadata(out, proto, {**details, **selection.summary()})


class _StaticQuantizer:
    """``quantize_static`` on one fp32 graph with one calibration, any subset of nodes: the first
    call calibrates and caches the ranges, later calls reuse them."""

    def __init__(self, proto: onnx.ModelProto, calibration: Calibration, workdir: Path, done: Callable[[int], None] | None = None):
        self.proto, self.calibration, self.workdir, self.done = proto, calibration, workdir, done
        self.source, self.cache = workdir / "fp32.onnx", workdir / "ranges.json"
        onnx.save_model(proto, str(self.source))
        self.candidates = [n.name for n in proto.graph.node if n.op_type in QUANTIZED_OP_TYPES]

    def quantize(self, nodes: list[str]) -> onnx.ModelProto:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

        target = self.workdir / "int8.onnx"
        extra = {
            "ActivationSymmetric": True,  # zero point 0: what TensorRT's explicit quantization takes
            "WeightSymmetric": True,
            "QuantizeBias": False,  # TensorRT refuses an int32-input DequantizeLinear
            "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OP_TYPES),
        }
        reader = None if self.cache.is_file() else _Reader(self.proto.graph.input[0].name, self.calibration.inputs, self.done)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the histogram calibrators print progress
                quantize_static(
                    str(self.source),
                    str(target),
                    reader,
                    quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=list(QUANTIZED_OP_TYPES),
                    nodes_to_quantize=nodes,
                    nodes_to_exclude=[n for n in self.candidates if n not in set(nodes)],
                    per_channel=True,
                    activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, CALIBRATION_METHODS[self.calibration.method]),
                    extra_options=extra,
                    calibration_cache_path=str(self.cache),
                )
        # The quantizer asserts on a NaN range (quant_utils.compute_scale_zp) rather than raising.
        except (ValueError, RuntimeError, AssertionError, onnx.checker.ValidationError) as err:
            self._refuse_bad_ranges()
            raise ExportError(f"INT8 calibration failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
        out = onnx.load_model(str(target))
        check_scales(out)
        return out

    def _refuse_bad_ranges(self) -> None:
        """Name the nodes reading a tensor whose calibrated range is NaN or infinite, if any."""
        from onnxruntime.quantization.calibrate import load_tensors_data

        if not self.cache.is_file():
            return
        bad = {name for name, data in load_tensors_data(self.cache).items() if not np.all(np.isfinite(np.asarray(data.range_value, float)))}
        nodes = [n.name for n in self.proto.graph.node if n.name in self.candidates and bad.intersection(n.input)]
        if bad:
            raise ExportError(
                f"INT8 calibration gave NaN/Inf ranges at {_listed(nodes or sorted(bad))}; check the calibration data for NaN/Inf"
            )


def _fall_back(quantizer, selection: NodeSelection, out, target: AgreementTarget, progress) -> tuple[onnx.ModelProto, dict]:
    """Move the most sensitive nodes to float until ``target`` is met (``quantize_static_int8``).

    Sensitivity: each node quantized alone, on the first ``_RANKING_INPUTS`` held-out inputs,
    ranked by the mean ``1 - cosine`` of its outputs against fp32 (a continuous measure, where
    flipped answers are rare events on a few inputs); agreement is then measured on all of them.
    """
    reference, inputs = target.reference, target.inputs
    first = agreement = top1_agreement(reference, run_graph(out, inputs))
    record = {"held_out": len(inputs), "target": target.min_agreement, "quantized_all": first}
    if agreement >= target.min_agreement:
        return out, {**record, "final": agreement}
    budget = int(len(selection.quantize) * target.max_float_share)
    ranking_inputs = inputs[:_RANKING_INPUTS]
    ranking_reference = reference[: len(reference) // len(inputs) * len(ranking_inputs)]  # rows of those inputs
    errors = {}
    for i, node in enumerate(selection.quantize):
        if progress:
            progress(f"top-1 agreement {agreement:.2%} < {target.min_agreement:.0%}: sensitivity of node {i + 1}/{len(selection.quantize)}")
        errors[node] = _mean_cosine_error(ranking_reference, run_graph(quantizer.quantize([node]), ranking_inputs))
    for node in sorted(errors, key=errors.get, reverse=True)[:budget]:
        selection.quantize.remove(node)
        selection.keep_float[node] = "sensitivity"
        out = quantizer.quantize(selection.quantize)
        agreement = top1_agreement(reference, run_graph(out, inputs))
        if progress:
            progress(f"{node} kept float: top-1 agreement {agreement:.2%}")
        if agreement >= target.min_agreement:
            break
    return out, {**record, "final": agreement}


def check_plan(
    fp32: onnx.ModelProto,
    planned: onnx.ModelProto,
    inputs: np.ndarray,
    tolerance: Tolerance,
    label: str,
    top_k: bool = True,
    reference: np.ndarray | None = None,
) -> dict:
    """Judge a quantized graph against its fp32 graph on held-out real inputs (``top_k``: the
    outputs are logits; a headless backbone's features are judged by cosine only; ``reference``:
    the fp32 graph's outputs on them, when already computed).

    Returns:
        ``compare_logits``' metrics.

    Raises:
        ExportError: the plan fails ``tolerance``; the message names the first block whose
            output leaves it and the quantized nodes in that block.
    """
    reference = run_graph(fp32, inputs) if reference is None else reference
    actual = run_graph(planned, inputs)
    metrics = compare_logits(reference, actual, len(reference), tolerance, top_k=top_k)
    if not metrics["passed"]:
        block = _first_divergent_block(fp32, planned, inputs[:16], tolerance)
        nodes = [
            n.name
            for n in planned.graph.node
            if block
            and n.op_type in QUANTIZED_OP_TYPES
            and _quantized_input(planned, n)
            and any(s == block or s.startswith(block + ".") for s in _scopes(n))
        ]
        where = f"; first divergent block {block} (quantized there: {', '.join(nodes) or 'none'})" if block else ""
        raise ExportError(f"{label} fails its tolerance on {len(inputs)} held-out inputs ({'; '.join(metrics['failures'])}){where}")
    return metrics


def _quantized_input(proto: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    dequantized = {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    return any(name in dequantized for name in node.input)


def _first_divergent_block(fp32: onnx.ModelProto, planned: onnx.ModelProto, inputs: np.ndarray, tolerance: Tolerance) -> str:
    """``model.blocks.<i>`` whose output first leaves ``tolerance.min_mean_cosine`` (the block
    outputs recorded at export, marked as outputs of both graphs), or ``""``."""
    names = json.loads(next((p.value for p in fp32.metadata_props if p.key == "deploykit.block_outputs"), "[]"))
    outputs = [_with_outputs(g, names) for g in (fp32, planned)]
    reference, actual = (run_graph(g, inputs, outputs=names) for g in outputs)
    for i, (ref, act) in enumerate(zip(reference, actual)):
        if float(row_cosines(ref, act).mean()) < tolerance.min_mean_cosine:
            return f"model.blocks.{i}"
    return ""


def _with_outputs(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    out.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    return out


def run_graph(
    proto: onnx.ModelProto, inputs: np.ndarray, batch: int = 32, outputs: list[str] | None = None, done: Callable[[int], None] | None = None
):
    """Logits of a graph on ONNX Runtime's CPU provider, as ``[rows, classes]`` float64 (a
    sequence model's every position is a row); with ``outputs``, those tensors as a list of
    ``[N, ...]`` float64 arrays instead (``done(rows)`` after each batch)."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    runs = []
    for i in range(0, len(inputs), batch):
        runs.append(session.run(outputs, {name: inputs[i : i + batch]}))
        if done:
            done(min(i + batch, len(inputs)))
    arrays = [np.concatenate(parts).astype(np.float64) for parts in zip(*runs)]
    if outputs is not None:
        return arrays
    return arrays[0].reshape(-1, arrays[0].shape[-1])


def top1_agreement(reference: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(reference.argmax(-1) == actual.argmax(-1)))


def _mean_cosine_error(reference: np.ndarray, actual: np.ndarray) -> float:
    dots = (reference * actual).sum(-1)
    norms = np.linalg.norm(reference, axis=-1) * np.linalg.norm(actual, axis=-1)
    return float(np.mean(1 - dots / np.maximum(norms, 1e-300)))


def quantize_dynamic_int8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The ``int8-dynamic`` plan: the selected weight products as ``MatMul`` + bias ``Add``
    (ONNX Runtime's dynamic quantizer takes MatMul, not Gemm), then dynamically quantized.

    Attention products stay float: both inputs are activations, and a per-call range for each
    is what ``DynamicQuantizeLinear`` costs twice over.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    selection = select_nodes(proto, attention=False)
    unfolded = _gemm_as_matmul(proto, set(selection.quantize))
    # The quantizer logs "consider pre-processing" advice on the root logger.
    with tempfile.TemporaryDirectory(prefix="deploykit-int8-") as tmp, quiet_logger(""):
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save_model(unfolded, str(source))
        try:
            quantize_dynamic(
                str(source),
                str(target),
                op_types_to_quantize=["MatMul"],
                per_channel=True,
                weight_type=QuantType.QInt8,
                nodes_to_quantize=selection.quantize or None,
                nodes_to_exclude=list(selection.keep_float),
                extra_options={"MatMulConstBOnly": True},
            )
        except (ValueError, RuntimeError, onnx.checker.ValidationError) as err:
            raise ExportError(f"dynamic INT8 quantization failed: {str(err).splitlines()[0]}") from err
        out = onnx.load_model(str(target))
    check_scales(out)
    return _with_metadata(out, proto, {"plan": "int8-dynamic", "attention_int8": False, **selection.summary()})


def _gemm_as_matmul(proto: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """Each named ``Gemm(a, W, b)`` (no transposes, unit alpha/beta) → ``MatMul(a, W)`` + ``Add(·, b)``,
    keeping the node's name on the MatMul so the selection still finds it."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(proto)
    for node in [n for n in graph.nodes if n.op == "Gemm" and n.name in names]:
        if any(node.attrs.get(k, d) != d for k, d in (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0))):
            continue  # our exporter writes plain Gemms; anything else stays as it is
        a, w, *bias = node.inputs
        out = node.outputs[0]
        node.outputs.clear()
        product = gs.Variable(f"{out.name}.matmul", dtype=out.dtype)
        graph.nodes.append(gs.Node("MatMul", node.name, inputs=[a, w], outputs=[product if bias else out]))
        if bias:
            graph.nodes.append(gs.Node("Add", f"{node.name}.bias", inputs=[product, bias[0]], outputs=[out]))
        node.inputs.clear()
    graph.cleanup().toposort()
    return gs.export_onnx(graph)  # model-local functions (SaPE2Bias) come along


def check_scales(proto: onnx.ModelProto) -> None:
    """Refuse a quantized graph with a NaN, infinite or non-positive scale, naming its nodes."""
    weights = {i.name: i for i in proto.graph.initializer}
    bad = []
    for node in proto.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 1 and node.input[1] in weights:
            scale = numpy_helper.to_array(weights[node.input[1]]).astype(np.float64)
            if not np.all(np.isfinite(scale) & (scale > 0)):
                bad.append(node.name or node.output[0])
    if bad:
        raise ExportError(
            f"INT8 calibration gave NaN/Inf or zero scales at {_listed(bad)}; check the calibration data for NaN/Inf or constant inputs"
        )


def _listed(names: list[str], shown: int = 5) -> str:
    """``a, b, c, d, e and 7 more``: at most ``shown`` names in a one-line message."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _with_metadata(out: onnx.ModelProto, original: onnx.ModelProto, details: dict) -> onnx.ModelProto:
    """The quantizer keeps the graph's metadata only partly; restore it and add ``details``."""
    props = {p.key: p.value for p in original.metadata_props}
    props[QUANTIZATION_METADATA_KEY] = json.dumps(details)
    del out.metadata_props[:]
    onnx.helper.set_model_props(out, props)
    out.producer_name, out.producer_version = original.producer_name, original.producer_version
    return out


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader``: the inputs in batches of 8 (``done(rows)``
    as each is handed out: the calibrator runs the graph on it next)."""

    def __init__(self, input_name: str, inputs: np.ndarray, done: Callable[[int], None] | None = None):
        self._batches: Iterator[dict] = iter(
            {input_name: np.ascontiguousarray(inputs[i : i + _CALIBRATION_BATCH])} for i in range(0, len(inputs), _CALIBRATION_BATCH)
        )
        self._rows, self._done = 0, done

    def get_next(self) -> dict | None:
        batch = next(self._batches, None)
        if batch is not None and self._done:
            self._rows += len(next(iter(batch.values())))
            self._done(self._rows)
        return batch
