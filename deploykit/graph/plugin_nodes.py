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
distances of signatures computed once. Each ``SaPE2Bias`` node becomes its own first stage, a
``deploykit::SaPE2AxisSignatures`` node (the model-local function exported beside the bias's,
whose body the bias's begins with, plain ONNX in fp32: gates, reverse cumulative sum, clamp, interpolation of ``c · E``) giving ``Zx``
``[B, h, N, W]`` and ``Zy`` ``[B, h, N, H]``, a marked ``SaPE2Distance`` node reading them (fp32
``[B, h, T, T]``) and a ``CastLike`` back to q's dtype.

The split needs that companion function in the file (exports since it existed have it;
``deploykit.export.custom_ops.attach_functions`` adds it to an older one). Only onnx is imported
here: ``deploykit build`` loads no exporter, and ONNX Runtime's runner makes the same split for
its compiled ``SaPE2Distance`` kernel (``deploykit.kernels``).
"""

from __future__ import annotations

from collections.abc import Collection

import onnx

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
PLUGIN_VERSION = "1"
# (domain, op) exported -> (namespace, name) of the plugin that computes its last stage.
SPLITS = {("deploykit", "SaPE2Bias"): ("deploykit", "SaPE2Distance")}


def has_companions(model: onnx.ModelProto) -> bool:
    """Whether the graph holds the first-stage function each split needs (``SPLITS``)."""
    return any((f.domain, f.name) == ("deploykit", "SaPE2AxisSignatures") for f in model.functions)


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
            parts = _SPLITTERS[op](model, node, index)
            nodes.extend(parts)
            node = next(n for n in parts if (n.domain, n.op_type) == SPLITS[op])
        else:
            nodes.append(node)
        _mark(node)
        marked.append(node.name)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    called = {(n.domain, n.op_type) for n in nodes}  # the marked ops' functions, and any no node calls, go
    kept = [f for f in model.functions if (f.domain, f.name) in called - ops]
    del model.functions[:]
    model.functions.extend(kept)
    return marked


def _mark(node: onnx.NodeProto) -> None:
    attributes = {a.name for a in node.attribute}
    if "plugin_namespace" not in attributes:
        node.attribute.append(onnx.helper.make_attribute("plugin_namespace", node.domain))
    if "plugin_version" not in attributes:
        node.attribute.append(onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION))


def _split_sape2_bias(model: onnx.ModelProto, node: onnx.NodeProto, index: int) -> list[onnx.NodeProto]:
    """``deploykit::SaPE2Bias`` as its signature stage (the model-local function
    ``deploykit::SaPE2AxisSignatures``, which the parser inlines),
    a ``deploykit::SaPE2Distance`` node and a ``CastLike`` to q's dtype (the original output)."""
    from onnx import helper

    if not has_companions(model):
        raise ValueError("the graph has no deploykit::SaPE2AxisSignatures function to split SaPE2Bias with (attach_functions adds it)")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    name = node.name or f"SaPE2Bias_{index}"
    zx, zy, bias = f"{name}/zx", f"{name}/zy", f"{name}/distance"
    plugin_domain, plugin_op = SPLITS[(node.domain, node.op_type)]
    grid = {key: attrs[key] for key in ("grid_h", "grid_w", "num_prefix_tokens")}
    return [
        helper.make_node("SaPE2AxisSignatures", list(node.input[:4]), [zx, zy], name=f"{name}/signatures", domain=node.domain, **attrs),
        helper.make_node(plugin_op, [zx, zy], [bias], name=bias, domain=plugin_domain, **grid),
        helper.make_node("CastLike", [bias, node.input[0]], list(node.output), name=f"{name}/cast"),
    ]


_SPLITTERS = {("deploykit", "SaPE2Bias"): _split_sape2_bias}
