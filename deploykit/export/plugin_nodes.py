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

Only onnx is imported here (``deploykit build`` loads no exporter).
"""

from __future__ import annotations

from collections.abc import Collection

import onnx

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
PLUGIN_VERSION = "1"


def custom_ops(model: onnx.ModelProto) -> set[tuple[str, str]]:
    """``(domain, op_type)`` of every node outside the standard ONNX domains."""
    return {(n.domain, n.op_type) for n in model.graph.node if n.domain not in STANDARD_DOMAINS}


def mark_plugin_nodes(model: onnx.ModelProto, registered: Collection[tuple[str, str]]) -> list[str]:
    """Mark, in place, the nodes of every custom op with a registered plugin creator.

    Args:
        model: the graph (edited in place).
        registered: ``(namespace, name)`` of the plugin creators registered with TensorRT.

    Returns:
        The names of the marked nodes, in graph order (the plugin layers the parser must make).
    """
    ops = {op for op in custom_ops(model) if op in set(registered)}
    marked = []
    for node in model.graph.node:
        if (node.domain, node.op_type) not in ops:
            continue
        attributes = {a.name for a in node.attribute}
        if "plugin_namespace" not in attributes:
            node.attribute.append(onnx.helper.make_attribute("plugin_namespace", node.domain))
        if "plugin_version" not in attributes:
            node.attribute.append(onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION))
        marked.append(node.name)
    kept = [f for f in model.functions if (f.domain, f.name) not in ops]
    del model.functions[:]
    model.functions.extend(kept)
    return marked
