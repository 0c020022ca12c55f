"""The ``int8`` plan: explicit QuantizeLinear/DequantizeLinear pairs on the inputs of the matrix
products (the form TensorRT's explicit quantization and ONNX Runtime both read), calibrated on
real inputs.

Weights int8 per output channel, symmetric; activations int8 per tensor, symmetric, with ranges
calibrated on real inputs. Outputs and biases stay float (TensorRT refuses an int32 bias
``DequantizeLinear``, and quantizing an output only adds a rounding step before float ops).
Which nodes: ``int8_selection``; which of them go back to float to meet an agreement target:
``sensitivity``. The plan is written beside the fp32 graph like the fp16 plan.

Calibrator: ONNX Runtime's ``onnxruntime.quantization`` (``quantize_static``, min-max /
percentile / entropy calibrators), run once per plan. It ships with the onnxruntime the project already depends on
and writes standard QDQ. TensorRT Model Optimizer's ONNX PTQ writes the same form, but
``nvidia-modelopt[onnx]`` 0.47.0 requires ``onnxruntime-gpu~=1.24.2``, ``onnx~=1.21.0`` and
``cupy-cuda12x`` on Linux x86-64 (its wheel metadata, read 2026-11-24), against the CPU
onnxruntime 1.32 and onnx 1.23 this project runs on.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from deploykit._terminal import counter, quiet_logger
from deploykit.checks import Agreement, Reference
from deploykit.errors import ConfigError, ExportError, listed, unknown_choice
from deploykit.export import defaults, names, sensitivity
from deploykit.export.int8_selection import QUANTIZED_OP_TYPES, looks_untrained, quantized_word, select_nodes, with_plan_record
from deploykit.export.lint import check_scales

_log = logging.getLogger(__name__)

# ONNX Runtime's calibrators by the names the CLI shows: each is its CalibrationMethod member,
# lower-cased (minmax -> MinMax), so the list is kept in one place.
CALIBRATION_METHODS = defaults.CALIBRATION_METHODS
_CALIBRATION_BATCH = 8
# The sensitivity pass runs the graph once per quantized node on each of its inputs: about this
# many image passes in all (ViT-S/16: 49 nodes × 5 inputs), 2 to 16 inputs per node.
_SENSITIVITY_PASSES = 256
# Most sensitive nodes the plan reports.
_REPORTED = 5


class CalibrationSource(Protocol):
    """Where a plan's inputs come from: the caller hands them in (``deploykit.inputs.UserCalibration``
    for ``--calibration-data``, ``deploykit.inputs.builtin.DefaultCalibration`` otherwise)."""

    def check(self, model, shapes: Sequence[tuple[int, ...]]) -> None:
        """Refuse, before any work, inputs the model cannot take at ``shapes`` (``InputError``)."""
        ...

    def inputs(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """``(calibration inputs, held-out inputs, record)`` at ``shape``: the two disjoint, the
        record ``{"calibration": {...}, "held_out": {...}}`` with each one's source, count and sha256."""
        ...

    def held_out(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, dict]:
        """The held-out inputs ``inputs`` gives for the same arguments, and their record, without
        drawing the calibration inputs (``int8_check.recorded_target`` draws them again)."""
        ...


@dataclass(frozen=True)
class CalibrationOptions:
    """How ``export`` calibrates and checks the ``int8`` plan.

    Attributes:
        samples: calibration inputs (``--calibration-samples``).
        method: a key of ``CALIBRATION_METHODS`` (``--calibration-method``).
        held_out: held-out inputs the plan is checked on (agreement target and tolerance).
        min_agreement: classifiers: top-1 agreement with the fp32 graph to aim for on the held-out
            inputs, falling back to float where missed (``sensitivity.QualityTarget``); None: no
            fallback. 99.5% so that 99% holds on inputs the plan never saw: at 1000 held-out inputs
            the agreement's standard error near 99% is 0.3 points, and a 99% target measured on
            the zoo's val split left test-split agreement at 98.6-98.8% on three models.
        attention: quantize the attention-score and attention-value products too; None: the
            measured choice for the encoding (``ATTENTION_INT8``: float for every encoding).
        keep_float: module-path patterns (``fnmatch``: ``blocks.*.mlp.fc2``) or ONNX node names
            kept float whatever the fallback finds (``--keep-float``).
        min_cosine: features models (no classes): mean cosine of each output row (every token,
            or the pooled feature) with fp32 to aim for; None: not judged.
        max_relative_error: features models: mean ``‖y − y_fp32‖ / ‖y_fp32‖`` per row to aim
            for; None: not judged.
        data: the inputs (``CalibrationSource``); None: ``deploykit.inputs.builtin.DefaultCalibration``.
    """

    samples: int = defaults.CALIBRATION_SAMPLES
    method: str = defaults.CALIBRATION_METHOD
    held_out: int = defaults.HELD_OUT
    min_agreement: float | None = defaults.MIN_AGREEMENT
    attention: bool | None = None
    keep_float: tuple[str, ...] = ()
    min_cosine: float | None = defaults.MIN_COSINE
    max_relative_error: float | None = None
    data: CalibrationSource | None = None

    def __post_init__(self):
        _check_method(self.method)
        if self.samples < 1 or self.held_out < 1:
            raise ConfigError(f"calibration needs at least one sample and one held-out input, got {self.samples} and {self.held_out}")
        for name in ("min_agreement", "min_cosine"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"the {name.replace('_', ' ')} target must be in (0, 1], got {value}")
        if self.max_relative_error is not None and not self.max_relative_error > 0:
            raise ConfigError(f"the relative error target must be > 0, got {self.max_relative_error}")

    def target(self, held_out: np.ndarray, reference: np.ndarray, logits: bool, batch: int = 32) -> sensitivity.QualityTarget | None:
        """The fallback's target on ``held_out`` (fp32 rows ``reference``, run ``batch`` inputs per
        call): top-1 agreement for logits, cosine / relative error for features; None when no
        target is set."""
        if logits:
            goal = dict(min_top1=self.min_agreement)
        else:
            goal = dict(min_cosine=self.min_cosine, max_relative_error=self.max_relative_error)
        if all(v is None for v in goal.values()):
            return None
        return sensitivity.QualityTarget(
            Reference(held_out, reference, num_real=len(held_out), top_k=logits), Agreement(**goal), batch=batch
        )


@dataclass(frozen=True)
class Calibration:
    """Inputs that calibrate activation ranges, and how.

    Attributes:
        inputs: ``[N, ...]`` float32 images (or int64 token ids) in the graph's input layout.
        source: where they came from (recorded in the graph and the manifest).
        method: a key of ``CALIBRATION_METHODS``.
        record: what the manifest says of the inputs (``CalibrationSource.inputs``' record).
        batch: at most this many inputs per calibration run, and never more than 8
            (``onnx_export.rows_per_call``: ONNX Runtime's calibrator runs the graph unoptimized
            with every calibrated tensor an output, so its memory grows with the inputs per run,
            while the min-max and percentile ranges do not depend on them).
    """

    inputs: np.ndarray
    source: str
    method: str = "minmax"
    record: dict = field(default_factory=dict)
    batch: int = _CALIBRATION_BATCH

    def __post_init__(self):
        _check_method(self.method)
        if len(self.inputs) == 0:
            raise ConfigError("calibration needs at least one input")


def _check_method(method: str) -> None:
    if method not in CALIBRATION_METHODS:
        raise ConfigError(unknown_choice("calibration method", method, CALIBRATION_METHODS))


def quantize_static_int8(
    proto: onnx.ModelProto,
    calibration: Calibration,
    attention: bool = False,
    target: sensitivity.QualityTarget | None = None,
    progress: Callable[[str], None] | None = None,
    keep_float: Sequence[str] = (),
    plan: str = "int8",
    rewrite: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
) -> tuple[onnx.ModelProto, np.ndarray | None]:
    """The ``int8`` plan of an fp32 graph: QDQ on the selected nodes' inputs, calibrated.

    Calibration runs once. Each quantized node's error at the output, with it alone int8, is then
    measured for all nodes in one pass (``sensitivity.node_sensitivity``); with a ``target``, when the plan misses it on the
    held-out inputs, the most sensitive nodes go back to float, as few as bisection over the
    ranking finds (``sensitivity.bisect_fallback``: ``O(log n)`` checks), up to
    ``target.max_float_share`` of them. The nodes moved are recorded with reason ``sensitivity``.

    Args:
        proto: fp32 graph from ``onnx_from_model``.
        calibration: the inputs and method.
        attention: quantize the attention MatMuls too (``int8_selection.ATTENTION_INT8`` holds the measured
            choice per encoding).
        target: held-out inputs and what to aim for; None: quantize every selected node.
        progress: optional callable taking a status line.
        keep_float: module-path patterns kept float (``select_nodes``).
        plan: the plan's name in its record (``gpu_plans``' plans are written here too).
        rewrite: applied to the quantizer's Q/DQ graph before the sensitivity pass and fallback
            (``gpu_plans.int8_to_fp8``: the same pairs in FP8), which then judge its pairs.

    Returns:
        The quantized graph, with ``deploykit.quantization`` in its metadata, and its output rows
        on the target's held-out inputs when the fallback ran exactly that graph on all of them
        (else None): the plan check judges those rather than running the graph again.

    Raises:
        ConfigError: a ``keep_float`` pattern that matches no node.
        ExportError: the calibration gave a scale that is NaN, infinite or not positive (the
            nodes are named), or the quantizer failed.
    """
    selection = select_nodes(proto, attention, keep_float)
    modules = names.module_paths(proto)
    held_out_outputs = None
    details = {
        "plan": plan,
        "calibration": calibration.method,
        "samples": len(calibration.inputs),
        "calibration_data": calibration.source,
        **({"inputs": calibration.record} if calibration.record else {}),
        "attention_int8": attention,
    }
    if looks_untrained(proto):
        details["untrained_weights"] = True
        _log.warning(
            "the model's weights look untrained (every LayerNorm at scale 1 and shift 0, every bias 0): agreement "
            "with fp32 on random weights says nothing about a trained model's int8 accuracy"
        )
    # The quantizer logs "consider pre-processing" advice on the root logger.
    with tempfile.TemporaryDirectory(prefix="deploykit-int8-") as tmp, quiet_logger(""):
        tick = counter(progress, f"calibrating on {calibration.source} ({calibration.method})", len(calibration.inputs), "inputs")
        out = _StaticQuantizer(proto, calibration, Path(tmp), tick).quantize(selection.quantize)
    if rewrite is not None:
        out = rewrite(out)
    noise = {}
    if selection.quantize:
        count = min(len(calibration.inputs), 16, max(2, _SENSITIVITY_PASSES // len(selection.quantize)))
        what = f"output error of each of {len(selection.quantize)} matmuls {quantized_word(plan)} alone, one pass on {count} inputs"
        tick = counter(progress, what, len(selection.quantize), "matmuls")
        tick(0)  # said before the pass starts: it is the export's longest step
        noise = sensitivity.node_sensitivity(proto, out, selection.quantize, calibration.inputs[:count], done=tick)
        ranked = sorted(noise, key=noise.get, reverse=True)
        details["sensitivity"] = {
            "measure": "relative squared error of the graph's output with the node alone int8",
            "inputs": count,
            "most_sensitive": [{"module": modules.get(n, ""), "onnx": n, "output_error": noise[n]} for n in ranked[:_REPORTED]],
        }
        if target is not None:
            fallback = sensitivity.fall_back(proto, out, ranked, target, progress)
            out, details["agreement"], held_out_outputs = fallback.graph, fallback.record, fallback.outputs
            for node in ranked[: fallback.float_count]:
                selection.quantize.remove(node)
                selection.keep_float[node] = "sensitivity"
    return with_plan_record(out, proto, selection.record(modules, noise, **details)), held_out_outputs


def _float_nodes_read_float(out: onnx.ModelProto, fp32: onnx.ModelProto, quantized: Sequence[str]) -> onnx.ModelProto:
    """``out`` with every node outside ``quantized`` reading float tensors again.

    ONNX Runtime's quantizer gives each reader of a quantized activation its ``DequantizeLinear``,
    float nodes included: EGA's gate reads the LayerNorm output that qkv, quantized, reads too, so
    it would compute on int8-rounded inputs although the plan keeps it float."""
    import onnx_ir as ir

    from deploykit.graph.edits import QDQ, back_to_float

    model, kept = ir.from_proto(out), set(quantized)
    readers = {
        use.node.name
        for node in model.graph
        if node.op_type == "DequantizeLinear"
        for use in node.outputs[0].uses()
        if use.node.op_type not in QDQ and use.node.name not in kept
    }
    if not readers:
        return out
    back_to_float(model, ir.from_proto(fp32), readers, QUANTIZED_OP_TYPES)
    return ir.to_proto(model)


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
        reader = None  # ranges cached by the first call
        if not self.cache.is_file():
            _refuse_histograms_beyond_memory(self.proto, self.calibration)
            batch = max(1, min(_CALIBRATION_BATCH, self.calibration.batch))
            reader = _Reader(self.proto.graph.input[0].name, self.calibration.inputs, batch, self.done)
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
                    calibrate_method=next(m for m in CalibrationMethod if m.name.lower() == self.calibration.method),
                    extra_options=extra,
                    calibration_cache_path=str(self.cache),
                )
        # The quantizer asserts on a NaN range (quant_utils.compute_scale_zp) rather than raising.
        except (ValueError, RuntimeError, AssertionError, onnx.checker.ValidationError) as err:
            self._refuse_bad_ranges()
            raise ExportError(f"INT8 calibration failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
        out = _float_nodes_read_float(onnx.load_model(str(target)), self.proto, nodes)
        check_scales(out)
        return out

    def _refuse_bad_ranges(self) -> None:
        """Name the nodes reading a tensor whose calibrated range is NaN or infinite, if any."""
        from onnxruntime.quantization.calibrate import load_tensors_data

        if not self.cache.is_file():
            return
        bad = {name for name, data in load_tensors_data(self.cache).items() if not np.all(np.isfinite(np.asarray(data.range_value, float)))}
        modules = names.module_paths(self.proto)
        nodes = [names.describe(n.name, modules) for n in self.proto.graph.node if n.name in self.candidates and bad.intersection(n.input)]
        if bad:
            raise ExportError(
                f"INT8 calibration gave NaN/Inf ranges at {listed(nodes or sorted(bad))}; check the calibration data for NaN/Inf"
            )


def _calibrated_bytes_per_input(proto: onnx.ModelProto) -> int:
    """What ONNX Runtime's calibrator makes an output of, per input: every float tensor a
    ``QUANTIZED_OP_TYPES`` node reads or writes (attention's scores included), at batch 1."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    constants = {t.name for t in proto.graph.initializer}
    names = {
        name
        for n in proto.graph.node
        if n.op_type in QUANTIZED_OP_TYPES
        for name in (*n.input, *n.output)
        if name and name not in constants
    }
    total = 0
    for name in names:
        kind = types.get(name)
        if kind is None or not kind.HasField("shape") or kind.elem_type != onnx.TensorProto.FLOAT:
            continue
        total += 4 * int(np.prod([d.dim_value if d.HasField("dim_value") else 1 for d in kind.shape.dim]))
    return total


def _refuse_histograms_beyond_memory(proto: onnx.ModelProto, calibration: Calibration) -> None:
    """ONNX Runtime's histogram calibrators (every method but min-max) keep every calibrated
    tensor of every input until the last one has run, many GB for a few dozen inputs of a model at
    384 px. Where that cannot fit, say so rather than be killed mid-export."""
    from deploykit.runners.cpu import available_memory

    if calibration.method == "minmax":
        return
    free = available_memory()
    if free is None:
        return
    need = _calibrated_bytes_per_input(proto) * len(calibration.inputs)
    if need > free:
        raise ConfigError(
            f"--calibration-method {calibration.method} keeps every calibrated tensor of all {len(calibration.inputs)} inputs "
            f"in memory (ONNX Runtime's histogram calibrators): at least {need / 1e9:.1f} GB here, {free / 1e9:.1f} GB available; "
            "use --calibration-method minmax, or fewer --calibration-samples"
        )


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader``: the inputs in batches of ``batch``
    (``done(rows)`` as each is handed out: the calibrator runs the graph on it next)."""

    def __init__(self, input_name: str, inputs: np.ndarray, batch: int, done: Callable[[int], None] | None = None):
        self._batches: Iterator[dict] = iter(
            {input_name: np.ascontiguousarray(inputs[i : i + batch])} for i in range(0, len(inputs), batch)
        )
        self._rows, self._done = 0, done

    def get_next(self) -> dict | None:
        batch = next(self._batches, None)
        if batch is not None and self._done:
            self._rows += len(next(iter(batch.values())))
            self._done(self._rows)
        return batch
