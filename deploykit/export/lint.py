"""Static lint of an exported ONNX graph, run before handing it to ONNX Runtime or TensorRT; and
of a quantized graph's scales (``check_scales``).

Each rule catches a pattern that exports "successfully" but then fails, runs slowly, or loses
accuracy in an engine. ``lint_graph`` collects every finding so one run shows all problems;
``check_graph`` turns them into a single-line ``ExportError`` for the CLI.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from deploykit.catalog import TABLE_PREFIXES
from deploykit.errors import ExportError, listed

# TensorRT builds data-dependent control flow poorly (or not at all); the ViT forward pass
# never needs it, so its presence means tracing captured a Python branch or loop.
_CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})
# Scatter ops come from in-place slice writes (e.g. writing prefix tokens into a buffer);
# TensorRT runs them slowly and they are always avoidable with Concat.
_SCATTER_OPS = frozenset({"ScatterND", "ScatterElements", "Scatter"})
_COMPLEX_TYPES = frozenset({TensorProto.COMPLEX64, TensorProto.COMPLEX128})
_HALF_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
# Random ops give a new value per run, so constant inputs do not make them foldable.
_NONDETERMINISTIC_OPS = frozenset({"RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
# Checker/shape-inference messages carry multi-line context; keep findings readable.
_MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class LintIssue:
    """One lint finding.

    Attributes:
        rule: Short rule id, e.g. ``"scatter"`` or ``"fp16-table"``.
        node: Name of the node or tensor involved (empty for whole-model rules).
        message: Human-readable, single-line description of the problem.
    """

    rule: str
    node: str
    message: str


def _one_line(text: str) -> str:
    """Collapse whitespace (the checker emits newlines) and cap the length."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_MESSAGE_CHARS else flat[: _MAX_MESSAGE_CHARS - 3] + "..."


def _node_label(node: onnx.NodeProto) -> str:
    """Name a node; exporters may leave names empty, so fall back to its first output."""
    if node.name:
        return node.name
    return f"<{node.op_type} -> {node.output[0]}>" if node.output else f"<{node.op_type}>"


def _check_model(model: onnx.ModelProto) -> list[LintIssue]:
    """Rule ``checker``: the full ONNX checker (includes strict shape inference)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as e:
        # ValueError: protobuf too large to check in memory; reported rather than crashing.
        return [LintIssue("checker", "", f"ONNX checker failed: {_one_line(str(e))}")]
    return []


def _infer_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, list[LintIssue]]:
    """Rule ``shape-inference``: strict shape inference; return the inferred model if it works."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True), []
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError) as e:
        msg = f"strict shape inference failed: {_one_line(str(e))}"
        return None, [LintIssue("shape-inference", "", msg)]


def _complex_types(graphs: list[onnx.GraphProto]) -> list[LintIssue]:
    """Rule ``complex-type``: TensorRT has no complex dtype, so complex tensors cannot build."""
    seen: set[str] = set()
    issues = []

    def report(name: str, elem_type: int) -> None:
        if elem_type in _COMPLEX_TYPES and name not in seen:
            seen.add(name)  # the inferred graph repeats the original's value_info
            dtype = TensorProto.DataType.Name(elem_type)
            issues.append(LintIssue("complex-type", name, f"tensor '{name}' has type {dtype}"))

    for graph in graphs:
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            report(vi.name, vi.type.tensor_type.elem_type)
        for init in graph.initializer:
            report(init.name, init.data_type)
    return issues


def _iter_nodes(body: onnx.GraphProto | onnx.FunctionProto, scope: str = "") -> Iterator[tuple[onnx.NodeProto, str]]:
    """Yield ``(node, scope)`` for every node of a graph or function, recursing into subgraphs."""
    for node in body.node:
        yield node, scope
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                where = f"subgraph '{attr.name}' of node '{_node_label(node)}'"
                yield from _iter_nodes(sub, f"{where} in {scope}" if scope else where)


def _all_nodes(model: onnx.ModelProto) -> Iterator[tuple[onnx.NodeProto, str]]:
    """Yield every node of the main graph, its subgraphs, and model-local functions."""
    yield from _iter_nodes(model.graph)
    for fn in model.functions:
        # Functions are inlined by the runtime, so their bodies face the same limits.
        yield from _iter_nodes(fn, f"function '{fn.domain}.{fn.name}'")


def _op_rules(model: onnx.ModelProto) -> list[LintIssue]:
    """Rules ``control-flow`` and ``scatter``: ops TensorRT handles badly."""
    issues = []
    for node, scope in _all_nodes(model):
        label = _node_label(node)
        where = f" (in {scope})" if scope else ""
        if node.op_type in _CONTROL_FLOW_OPS and node.domain in ("", "ai.onnx"):
            msg = f"node '{label}' is {node.op_type}{where}; TensorRT needs static control flow"
            issues.append(LintIssue("control-flow", label, msg))
        elif node.op_type in _SCATTER_OPS and node.domain in ("", "ai.onnx"):
            msg = f"node '{label}' is {node.op_type}{where}; replace slice writes with Concat"
            issues.append(LintIssue("scatter", label, msg))
    return issues


def _fp16_tables(graph: onnx.GraphProto, prefixes: tuple[str, ...]) -> list[LintIssue]:
    """Rule ``fp16-table``: positional tables lose accuracy at half precision."""
    issues = []
    for init in graph.initializer:
        if init.name.startswith(prefixes) and init.data_type in _HALF_TYPES:
            dtype = TensorProto.DataType.Name(init.data_type)
            msg = f"positional table '{init.name}' is {dtype}; keep it FLOAT even in fp16 engines"
            issues.append(LintIssue("fp16-table", init.name, msg))
    return issues


def _unfolded_constants(graph: onnx.GraphProto) -> list[LintIssue]:
    """Rule ``unfolded-constant``: nodes computing only from constants that export did not fold.

    ONNX requires nodes in topological order, so one forward pass propagates constness.
    """
    # An initializer that is also a graph input can be overridden at run time: not constant.
    inputs = {vi.name for vi in graph.input}
    const = {init.name for init in graph.initializer if init.name not in inputs}
    issues = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            const.update(node.output)
            continue
        used = [name for name in node.input if name]  # "" marks an omitted optional input
        has_subgraph = any(a.HasField("g") or a.graphs for a in node.attribute)
        if not used or has_subgraph or node.op_type in _NONDETERMINISTIC_OPS:
            continue  # subgraphs may read non-constant outer-scope values
        if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx"):
            continue  # an int8 weight's DequantizeLinear is the QDQ form itself, read by runtimes as "this weight is int8"
        if all(name in const for name in used):
            const.update(node.output)
            label = _node_label(node)
            msg = f"node '{label}' ({node.op_type}) has only constant inputs but was not folded"
            issues.append(LintIssue("unfolded-constant", label, msg))
    return issues


def lint_graph(model: onnx.ModelProto, *, table_prefixes: tuple[str, ...] = TABLE_PREFIXES) -> list[LintIssue]:
    """Lint an exported ONNX model for patterns that break or slow down deployment.

    Args:
        model: The exported model (must fit in memory; >2 GB external-data models are not
            supported by the in-memory checker).
        table_prefixes: Initializer-name prefixes that mark positional-encoding tables,
            which must stay fp32.

    Returns:
        Every finding, in rule order (``checker``, ``shape-inference``, ``complex-type``,
        ``control-flow``/``scatter``, ``fp16-table``, ``unfolded-constant``); empty if clean.
    """
    issues = _check_model(model)
    inferred, shape_issues = _infer_shapes(model)
    issues += shape_issues
    graphs = [model.graph] if inferred is None else [model.graph, inferred.graph]
    issues += _complex_types(graphs)
    issues += _op_rules(model)
    issues += _fp16_tables(model.graph, tuple(table_prefixes))
    issues += _unfolded_constants(model.graph)
    return issues


def check_graph(model: onnx.ModelProto, **kw) -> None:
    """Raise if ``lint_graph`` finds anything.

    Args:
        model: The exported model.
        **kw: Passed to ``lint_graph`` (e.g. ``table_prefixes``).

    Raises:
        ExportError: One line listing every finding, joined by ``"; "``.
    """
    issues = lint_graph(model, **kw)
    if not issues:
        return
    noun = "issue" if len(issues) == 1 else "issues"
    details = "; ".join(f"{i.rule}: {_one_line(i.message)}" for i in issues)
    raise ExportError(f"exported graph failed lint ({len(issues)} {noun}): {details}")


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
            f"INT8 calibration gave NaN/Inf or zero scales at {listed(bad)}; check the calibration data for NaN/Inf or constant inputs"
        )
