"""The graph TensorRT's ONNX parser is given when plugins are wanted: custom nodes marked as
plugin nodes, with no model-local function left to shadow the plugin.

How the parser picks (onnx-tensorrt's ``parseNode``, TensorRT 10.x/11 and TensorRT-RTX): a node
carrying a ``plugin_namespace`` attribute is looked up in the plugin registry by (op type,
``plugin_version`` default ``"1"``, ``plugin_namespace``) and becomes a plugin layer when a
creator is registered. Without that attribute a model-local function of the same name wins and
is inlined, even with the plugin registered (releases before 10.8 preferred the plugin there, so
the preference is not something to rely on). The namespace is never read from the node's
domain. So for an engine with plugins, every node of an op that has a registered creator gets
``plugin_namespace`` (its domain) and ``plugin_version``, and the function of that op is
removed: the parser then either makes the plugin layer or fails on the node, never inlines it
silently. The exported file is not touched: ONNX Runtime and engines without plugins keep
running the function body.

Some ops are split instead of marked (``SPLITS``): their plugin computes only the part a single
ahead-of-time kernel can. ``deploykit::SaPE2Bias`` is one: a TensorRT AOT plugin launches one
kernel and has no workspace, so the SaPE² plugin is ``deploykit::SaPE2Distance``, the pairwise
distances of signatures computed once. Each ``SaPE2Bias`` node becomes the signature stage as
plain ONNX ops (the reference's ``_axis_signature``, in fp32: gates, reverse cumulative sum,
clamp, interpolation of ``c · E``), ``Zx`` ``[B, h, N, W]`` and ``Zy`` ``[B, h, N, H]``, a marked
``SaPE2Distance`` node reading them (fp32 ``[B, h, T, T]``) and a ``CastLike`` back to q's dtype.

Only onnx is imported here (``deploykit build`` loads no exporter).
"""

from __future__ import annotations

from collections.abc import Collection

import onnx

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
PLUGIN_VERSION = "1"
# (domain, op) exported -> (namespace, name) of the plugin that computes its last stage.
SPLITS = {("deploykit", "SaPE2Bias"): ("deploykit", "SaPE2Distance")}


def custom_ops(model: onnx.ModelProto) -> set[tuple[str, str]]:
    """``(domain, op_type)`` of every node outside the standard ONNX domains."""
    return {(n.domain, n.op_type) for n in model.graph.node if n.domain not in STANDARD_DOMAINS}


def plugin_ops(model: onnx.ModelProto, registered: Collection[tuple[str, str]]) -> set[tuple[str, str]]:
    """``(domain, op_type)`` of the graph's custom ops that a registered plugin creator computes,
    whole or (``SPLITS``) in part."""
    registered = set(registered)
    return {op for op in custom_ops(model) if op in registered or SPLITS.get(op) in registered}


def mark_plugin_nodes(model: onnx.ModelProto, registered: Collection[tuple[str, str]]) -> list[str]:
    """Mark, in place, the nodes of every custom op with a registered plugin creator, and split
    those whose plugin computes their last stage only (``SPLITS``).

    Args:
        model: the graph (edited in place).
        registered: ``(namespace, name)`` of the plugin creators registered with TensorRT.

    Returns:
        The names of the marked nodes, in graph order (the plugin layers the parser must make).
    """
    ops = plugin_ops(model, registered)
    marked, nodes = [], []
    for index, node in enumerate(model.graph.node):
        op = (node.domain, node.op_type)
        if op not in ops:
            nodes.append(node)
            continue
        if op not in set(registered):  # split: plain ONNX ops, then the plugin's node
            parts = _SPLITTERS[op](node, index)
            nodes.extend(parts)
            node = next(n for n in parts if (n.domain, n.op_type) == SPLITS[op])
        else:
            nodes.append(node)
        _mark(node)
        marked.append(node.name)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept = [f for f in model.functions if (f.domain, f.name) not in ops]
    del model.functions[:]
    model.functions.extend(kept)
    return marked


def _mark(node: onnx.NodeProto) -> None:
    attributes = {a.name for a in node.attribute}
    if "plugin_namespace" not in attributes:
        node.attribute.append(onnx.helper.make_attribute("plugin_namespace", node.domain))
    if "plugin_version" not in attributes:
        node.attribute.append(onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION))


def _split_sape2_bias(node: onnx.NodeProto, index: int) -> list[onnx.NodeProto]:
    """``deploykit::SaPE2Bias`` as its signature stage in plain ONNX (fp32), a
    ``deploykit::SaPE2Distance`` node and a ``CastLike`` to q's dtype (the original output)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    H, W, P = attrs["grid_h"], attrs["grid_w"], attrs["num_prefix_tokens"]
    name = node.name or f"SaPE2Bias_{index}"
    out: list[onnx.NodeProto] = []
    count = iter(range(1_000_000))

    def op(op_type: str, *inputs: str, **kwargs) -> str:
        result = f"{name}/sig/{op_type}_{next(count)}"
        out.append(helper.make_node(op_type, list(inputs), [result], name=result, **kwargs))
        return result

    def const(value, dtype) -> str:
        return op("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    q, k, table_x, table_y = (op("Cast", t, to=TensorProto.FLOAT) for t in node.input[:4])
    gate_a, gate_b, project = {0: (q, k, q), 1: (q, k, k), 2: (k, q, k)}[attrs["mode"]]
    rows = {}
    for t in dict.fromkeys((gate_a, gate_b, project)):  # [B, h, P + N, d] -> [B, h, H, W, d]
        patches = op("Slice", t, const([P], np.int64), const([np.iinfo(np.int64).max], np.int64), const([2], np.int64))
        rows[t] = op("Reshape", patches, const([0, 0, H, W, -1], np.int64))
    cols = {t: op("Transpose", r, perm=[0, 1, 3, 2, 4]) for t, r in rows.items()}  # [B, h, W, H, d]
    scale, one, last = const(attrs["scale"], np.float32), const(1.0, np.float32), const(-1, np.int64)

    def signature(lines: dict, table: str) -> str:  # Eq. 9-14, deploykit.encodings.sape2._axis_signature
        gates = op("Sigmoid", op("Mul", op("MatMul", lines[gate_a], op("Transpose", lines[gate_b], perm=[0, 1, 2, 4, 3])), scale))
        top = op("Sub", op("Cast", op("Shape", table, start=1, end=2), to=TensorProto.FLOAT), one)  # M - 1
        pos = op("Min", op("CumSum", gates, last, reverse=1), top)
        lo, hi = op("Floor", pos), op("Ceil", pos)
        weight = op("Sub", pos, lo)
        logits = op("MatMul", lines[project], table)  # c · E[:, p] for every integer p
        at_lo = op("GatherElements", logits, op("Cast", lo, to=TensorProto.INT64), axis=-1)
        at_hi = op("GatherElements", logits, op("Cast", hi, to=TensorProto.INT64), axis=-1)
        return op("Add", op("Mul", at_hi, weight), op("Mul", at_lo, op("Sub", one, weight)))

    zx = op("Reshape", signature(rows, table_x), const([0, 0, -1, W], np.int64))  # [B, h, N, W]
    zy = op("Reshape", op("Transpose", signature(cols, table_y), perm=[0, 1, 3, 2, 4]), const([0, 0, -1, H], np.int64))
    plugin_domain, plugin_op = SPLITS[(node.domain, node.op_type)]
    bias = f"{name}/distance"
    out.append(helper.make_node(plugin_op, [zx, zy], [bias], name=bias, domain=plugin_domain, grid_h=H, grid_w=W, num_prefix_tokens=P))
    out.append(helper.make_node("CastLike", [bias, node.input[0]], list(node.output), name=f"{name}/cast"))
    return out


_SPLITTERS = {("deploykit", "SaPE2Bias"): _split_sape2_bias}
