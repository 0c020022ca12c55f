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

Pinned (``--keep-float PATTERN``, module paths with wildcards) nodes stay float too, reason
``pinned``; nodes the agreement fallback moves back have reason ``sensitivity``
(``deploykit.export.sensitivity``: one pass to measure, bisection to decide). Every node the plan
reports is named by its PyTorch module path with its ONNX name beside it
(``deploykit.export.names``: ``blocks.7.mlp.fc2 (node_Gemm_346)``).

Calibrator: ONNX Runtime's ``onnxruntime.quantization`` (``quantize_static``, min-max /
percentile / entropy calibrators), run once per plan. It ships with the onnxruntime the project already depends on
and writes standard QDQ. TensorRT Model Optimizer's ONNX PTQ writes the same form, but
``nvidia-modelopt[onnx]`` 0.47.0 requires ``onnxruntime-gpu~=1.24.2``, ``onnx~=1.21.0`` and
``cupy-cuda12x`` on Linux x86-64 (its wheel metadata, read 2026-11-24), against the CPU
onnxruntime 1.32 and onnx 1.23 this project runs on.

Over 400 lines: selection, calibration, the plan check and the recorded plan are the steps of
one plan and share its node names; apart, each would need the others' internals.
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
from onnx import numpy_helper

from deploykit._terminal import counter
from deploykit.comparison import Tolerance, compare_logits, first_divergent
from deploykit.errors import ConfigError, ExportError
from deploykit.export import defaults, names, sensitivity
from deploykit.export.lint import TABLE_PREFIXES
from deploykit.export.metadata import GraphMetadata, copy_metadata
from deploykit.export.onnx_export import quiet_logger
from deploykit.runtime import cpu_runner, run_graph, run_rows

_log = logging.getLogger(__name__)

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
# The sensitivity pass runs the graph once per quantized node on each of its inputs: about this
# many image passes in all (ViT-S/16: 49 nodes × 5 inputs), 2 to 16 inputs per node.
_SENSITIVITY_PASSES = 256
# Most sensitive nodes the plan reports.
_REPORTED = 5


class CalibrationSource(Protocol):
    """Where a plan's inputs come from: the caller hands them in (``deploykit.inputs.UserCalibration``
    for ``--calibration-data``, ``deploykit.data.DefaultCalibration`` otherwise)."""

    def check(self, model, shapes: Sequence[tuple[int, ...]]) -> None:
        """Refuse, before any work, inputs the model cannot take at ``shapes`` (``InputError``)."""
        ...

    def inputs(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """``(calibration inputs, held-out inputs, record)`` at ``shape``: the two disjoint, the
        record ``{"calibration": {...}, "held_out": {...}}`` with each one's source, count and sha256."""
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
        data: the inputs (``CalibrationSource``); None: ``deploykit.data.DefaultCalibration``.
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

    def target(self, held_out: np.ndarray, reference: np.ndarray, logits: bool) -> sensitivity.QualityTarget | None:
        """The fallback's target on ``held_out`` (fp32 rows ``reference``): top-1 agreement for
        logits, cosine / relative error for features; None when no target is set."""
        if logits:
            goal = dict(min_agreement=self.min_agreement)
        else:
            goal = dict(min_cosine=self.min_cosine, max_relative_error=self.max_relative_error)
        if all(v is None for v in goal.values()):
            return None
        return sensitivity.QualityTarget(held_out, reference, **goal)


@dataclass(frozen=True)
class Calibration:
    """Inputs that calibrate activation ranges, and how.

    Attributes:
        inputs: ``[N, ...]`` float32 images (or int64 token ids) in the graph's input layout.
        source: where they came from (recorded in the graph and the manifest).
        method: a key of ``CALIBRATION_METHODS``.
        record: what the manifest says of the inputs (``CalibrationSource.inputs``' record).
    """

    inputs: np.ndarray
    source: str
    method: str = "minmax"
    record: dict = field(default_factory=dict)

    def __post_init__(self):
        _check_method(self.method)
        if len(self.inputs) == 0:
            raise ConfigError("calibration needs at least one input")


def _check_method(method: str) -> None:
    if method not in CALIBRATION_METHODS:
        raise ConfigError(f"unknown calibration method {method!r}; choose one of: {', '.join(CALIBRATION_METHODS)}")


@dataclass
class NodeSelection:
    """The candidate nodes of an fp32 graph: those to quantize, and those kept float with why
    (a policy reason, ``pinned`` or ``sensitivity``), plus what ``--keep-float`` pinned them with."""

    quantize: list[str] = field(default_factory=list)
    keep_float: dict[str, str] = field(default_factory=dict)  # node name -> reason
    pinned_by: dict[str, str] = field(default_factory=dict)  # node name -> the --keep-float pattern

    def summary(self, modules: dict[str, str], noise: dict[str, float] | None = None) -> dict:
        """The record of the plan: counts, ``float_nodes`` (reason → ``module (onnx)``) and
        ``kept_float`` (one entry per float node: module, ONNX name, reason and why)."""
        reasons: dict[str, list[str]] = {}
        kept = []
        for name, reason in self.keep_float.items():
            reasons.setdefault(reason, []).append(names.describe(name, modules))
            entry = {"module": modules.get(name, ""), "onnx": name}
            if reason == "pinned":
                entry.update(reason="pinned", why=f"--keep-float {self.pinned_by[name]}")
            elif reason == "sensitivity":
                entry.update(reason="sensitivity", why=f"output error {noise[name]:.2e} when int8 alone" if noise else "")
            else:
                entry.update(reason="policy", why=reason)
            kept.append(entry)
        return {"quantized_nodes": len(self.quantize), "float_nodes": reasons, "kept_float": kept}


def select_nodes(proto: onnx.ModelProto, attention: bool, keep_float: Sequence[str] = ()) -> NodeSelection:
    """Split the graph's MatMul/Gemm/Conv nodes into quantized and float (module docstring).

    Args:
        proto: an fp32 graph written by ``onnx_from_model`` (names every node; records
            ``deploykit.float_modules``).
        attention: quantize the products of two activations (q·kᵀ, attention·v) too.
        keep_float: ``--keep-float`` patterns: module paths (wildcards) or ONNX names kept float.

    Raises:
        ConfigError: a ``keep_float`` pattern that matches no MatMul/Gemm/Conv node.
    """
    graph = proto.graph
    float_modules = GraphMetadata.of(proto).float_modules
    weights = {i.name for i in graph.initializer}
    head = _head_nodes(graph)
    selection = NodeSelection()
    candidates = [n for n in graph.node if n.op_type in QUANTIZED_OP_TYPES and n.domain in ("", "ai.onnx")]
    pinned = names.matching_nodes(keep_float, [n.name for n in candidates], names.module_paths(proto))
    for node in candidates:
        if node.name in head:
            reason = "logits"
        elif any(name.startswith(TABLE_PREFIXES) for name in node.input):
            reason = "table"
        elif any(scope == m or scope.startswith(m + ".") for scope in names.node_scopes(node) for m in float_modules):
            reason = "float-module"
        elif not attention and not any(name in weights for name in node.input):
            reason = "attention"
        elif node.name in pinned:
            reason = "pinned"
            selection.pinned_by[node.name] = pinned[node.name]
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
    return ATTENTION_INT8.get(GraphMetadata.of(proto).encoding or "", False)


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


def looks_untrained(proto: onnx.ModelProto) -> bool:
    """Whether the graph's weights are still at their initial values where training always moves
    them: every LayerNormalization at scale 1 and shift 0, and every Gemm bias 0 (deploykit's,
    timm's and PyTorch's initialisation). A plan checked on such weights proves nothing."""
    weights = {i.name: i for i in proto.graph.initializer}

    def constant(name: str, value: float) -> bool | None:
        return bool(np.all(numpy_helper.to_array(weights[name]) == value)) if name in weights else None

    checks = []
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization":
            checks += [constant(node.input[1], 1.0), constant(node.input[2], 0.0) if len(node.input) > 2 else None]
        elif node.op_type == "Gemm" and len(node.input) > 2:
            checks.append(constant(node.input[2], 0.0))
    checks = [c for c in checks if c is not None]
    return bool(checks) and all(checks)


def quantize_static_int8(
    proto: onnx.ModelProto,
    calibration: Calibration,
    attention: bool = False,
    target: sensitivity.QualityTarget | None = None,
    progress: Callable[[str], None] | None = None,
    keep_float: Sequence[str] = (),
) -> onnx.ModelProto:
    """The ``int8`` plan of an fp32 graph: QDQ on the selected nodes' inputs, calibrated.

    Calibration runs once. Each quantized node's error at the output, with it alone int8, is then
    measured for all nodes in one pass (``sensitivity.node_sensitivity``); with a ``target``, when the plan misses it on the
    held-out inputs, the most sensitive nodes go back to float, as few as bisection over the
    ranking finds (``sensitivity.bisect_fallback``: ``O(log n)`` checks), up to
    ``target.max_float_share`` of them. The nodes moved are recorded with reason ``sensitivity``.

    Args:
        proto: fp32 graph from ``onnx_from_model``.
        calibration: the inputs and method.
        attention: quantize the attention MatMuls too (``ATTENTION_INT8`` holds the measured
            choice per encoding).
        target: held-out inputs and what to aim for; None: quantize every selected node.
        progress: optional callable taking a status line.
        keep_float: module-path patterns kept float (``select_nodes``).

    Returns:
        The quantized graph, with ``deploykit.quantization`` in its metadata.

    Raises:
        ConfigError: a ``keep_float`` pattern that matches no node.
        ExportError: the calibration gave a scale that is NaN, infinite or not positive (the
            nodes are named), or the quantizer failed.
    """
    selection = select_nodes(proto, attention, keep_float)
    modules = names.module_paths(proto)
    details = {
        "plan": "int8",
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
    noise = {}
    if selection.quantize:
        count = min(len(calibration.inputs), 16, max(2, _SENSITIVITY_PASSES // len(selection.quantize)))
        if progress:
            progress(f"output error of each of {len(selection.quantize)} matmuls int8 alone, one pass on {count} inputs")
        noise = sensitivity.node_sensitivity(proto, out, selection.quantize, calibration.inputs[:count])
        ranked = sorted(noise, key=noise.get, reverse=True)
        details["sensitivity"] = {
            "measure": "relative squared error of the graph's output with the node alone int8",
            "inputs": count,
            "most_sensitive": [{"module": modules.get(n, ""), "onnx": n, "output_error": noise[n]} for n in ranked[:_REPORTED]],
        }
        if target is not None:
            out, details["agreement"] = _fall_back(proto, out, ranked, selection, target, progress)
    return _with_metadata(out, proto, {**details, **selection.summary(modules, noise)})


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
        modules = names.module_paths(self.proto)
        nodes = [names.describe(n.name, modules) for n in self.proto.graph.node if n.name in self.candidates and bad.intersection(n.input)]
        if bad:
            raise ExportError(
                f"INT8 calibration gave NaN/Inf ranges at {_listed(nodes or sorted(bad))}; check the calibration data for NaN/Inf"
            )


def _fall_back(
    fp32, qdq, ranked: list[str], selection: NodeSelection, target: sensitivity.QualityTarget, progress
) -> tuple[onnx.ModelProto, dict]:
    """Move the fewest most-sensitive nodes back to float that meet ``target`` (bisection)."""

    def check(nodes: list[str], stop_early: bool = True) -> tuple[dict, bool]:
        with cpu_runner(sensitivity.dequantize_nodes(qdq, fp32, nodes)) as runner:
            return target.measure(lambda x: run_rows(runner, x, len(x)), stop_early=stop_early)

    budget = int(len(ranked) * target.max_float_share)
    count, trials = sensitivity.bisect_fallback(ranked, budget, check, progress)
    for node in ranked[:count]:
        selection.quantize.remove(node)
        selection.keep_float[node] = "sensitivity"
    final = next(t for t in reversed(trials) if t.float_count == count)
    if not final.metrics["complete"]:  # the plan kept misses its target: say by how much, on every input
        final = sensitivity.Trial(count, *check(ranked[:count], stop_early=False))
    record = {
        "target": target.to_dict(),
        "quantized_all": trials[0].metrics,
        "final": final.metrics,
        "met": final.met,
        "checks": len(trials),
        "trials": [{"float": t.float_count, "met": t.met, **t.metrics} for t in trials],
    }
    if not final.met:
        _log.warning(
            "the int8 plan misses its target (%s) with %d of %d matmuls back in float (the most allowed): %s",
            target.describe(),
            count,
            len(ranked),
            sensitivity.summary(final.metrics),
        )
    return sensitivity.dequantize_nodes(qdq, fp32, ranked[:count]), record


def describe_plan(details: dict) -> list[str]:
    """A quantized graph's record (``deploykit.quantization``) as terminal lines, every node by its
    module path with its ONNX name beside it: what was quantized and on what, what stayed float
    and why (pinned, sensitivity, policy), the most sensitive nodes and the target reached."""
    kept = details.get("kept_float", [])
    lines = [f"{details['quantized_nodes']} matmuls int8, {len(kept) or sum(map(len, details.get('float_nodes', {}).values()))} float"]
    if "calibration_data" in details:
        lines[0] += f"; calibrated ({details['calibration']}) on {details['calibration_data']}"
    for entry in kept:
        if entry["reason"] != "policy":
            why = f" ({entry['why']})" if entry.get("why") else ""
            lines.append(f"kept float: {names.describe(entry['onnx'], {entry['onnx']: entry['module']})}: {entry['reason']}{why}")
    policy: dict[str, list[str]] = {}
    for entry in kept:
        if entry["reason"] == "policy":
            policy.setdefault(entry["why"], []).append(entry["module"] or entry["onnx"])
    if policy:
        groups = [f"{why} {len(mods)} ({_listed(list(dict.fromkeys(mods)), 3)})" for why, mods in policy.items()]
        lines.append(f"kept float by policy: {'; '.join(groups)}")
    if details.get("sensitivity"):
        ranked = details["sensitivity"]["most_sensitive"]
        lines.append("most sensitive: " + ", ".join(f"{e['module'] or e['onnx']} {e['output_error']:.1e}" for e in ranked))
    if details.get("agreement"):
        record = details["agreement"]
        goal = sensitivity.describe_goal(**{k: v for k, v in record["target"].items() if k != "held_out"})
        moved = sum(1 for e in kept if e["reason"] == "sensitivity")
        lines.append(
            f"target {goal} on {record['target']['held_out']} held-out inputs: "
            f"{sensitivity.summary(record['quantized_all'])} with every matmul int8; "
            f"{sensitivity.summary(record['final'])} with {moved} back in float ({record['checks']} checks)"
            + ("" if record["met"] else "; target missed")
        )
    if details.get("untrained_weights"):
        lines.append("warning: the weights look untrained; agreement on random weights says nothing about a trained model")
    return lines


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
            output leaves it and the quantized nodes in that block, by module path.
    """
    reference = run_graph(fp32, inputs) if reference is None else reference
    actual = run_graph(planned, inputs)
    metrics = compare_logits(reference, actual, len(reference), tolerance, top_k=top_k)
    if not metrics["passed"]:
        block = _first_divergent_block(fp32, planned, inputs[:16], tolerance)
        modules = names.module_paths(fp32)
        nodes = [
            names.describe(n.name, modules)
            for n in planned.graph.node
            if block
            and n.op_type in QUANTIZED_OP_TYPES
            and _quantized_input(planned, n)
            and (modules.get(n.name, "") == block or modules.get(n.name, "").startswith(block + "."))
        ]
        where = f"; first divergent block {block} (quantized there: {', '.join(nodes) or 'none'})" if block else ""
        raise ExportError(f"{label} fails its tolerance on {len(inputs)} held-out inputs ({'; '.join(metrics['failures'])}){where}")
    return metrics


def _quantized_input(proto: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    dequantized = {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    return any(name in dequantized for name in node.input)


def _first_divergent_block(fp32: onnx.ModelProto, planned: onnx.ModelProto, inputs: np.ndarray, tolerance: Tolerance) -> str:
    """``blocks.<i>`` (the module path) whose output first leaves ``tolerance``
    (``comparison.first_divergent``, as ``validate`` judges blocks; the block outputs recorded at
    export, marked as outputs of both graphs), or ``""``."""
    block_outputs = list(GraphMetadata.of(fp32).block_outputs)
    outputs = [_with_outputs(g, block_outputs) for g in (fp32, planned)]
    reference, actual = (run_graph(g, inputs, outputs=block_outputs) for g in outputs)
    block = first_divergent(reference, actual, tolerance)
    return "" if block is None else f"blocks.{block}"


def _with_outputs(proto: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    return sensitivity.with_outputs(proto, tensors)


def top1_agreement(reference: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(reference.argmax(-1) == actual.argmax(-1)))


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
    return _with_metadata(out, proto, {"plan": "int8-dynamic", "attention_int8": False, **selection.summary(names.module_paths(proto))})


def _gemm_as_matmul(proto: onnx.ModelProto, nodes: set[str]) -> onnx.ModelProto:
    """Each named ``Gemm(a, W, b)`` (no transposes, unit alpha/beta) → ``MatMul(a, W)`` + ``Add(·, b)``,
    keeping the node's name on the MatMul so the selection still finds it."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(proto)
    for node in [n for n in graph.nodes if n.op == "Gemm" and n.name in nodes]:
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


def _listed(items: list[str], shown: int = 5) -> str:
    """``a, b, c, d, e and 7 more``: at most ``shown`` names in a one-line message."""
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _with_metadata(out: onnx.ModelProto, original: onnx.ModelProto, details: dict) -> onnx.ModelProto:
    """The quantizer keeps the graph's metadata only partly; restore it and add ``details``."""
    copy_metadata(original, out)
    GraphMetadata.update(out, quantization=details)
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
