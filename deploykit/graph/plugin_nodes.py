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
from dataclasses import dataclass

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


SIGNATURES = ("deploykit", "SaPE2AxisSignatures")  # the first stage of SaPE2Bias's split, a model-local function
COMPILED_SIGNATURES = ("deploykit", "SaPE2Signatures")  # the same stage in deploykit's CPU kernel library


def compile_signatures(model: onnx.ModelProto, values: dict[str, onnx.TypeProto] | None = None) -> int:
    """ONNX Runtime's compiled-kernel form of a split graph (``mark_plugin_nodes``), in place: each
    ``SaPE2AxisSignatures`` node whose inputs are all fp32 becomes the library's ``SaPE2Signatures``
    (same inputs, outputs and attributes), and the function goes where no node calls it any more.
    ``values`` are the graph's value types (``value_types``), computed here when not given. Returns
    the number of nodes changed."""
    from onnx import TensorProto

    values = value_types(model) if values is None else values
    changed = 0
    for node in model.graph.node:
        if (node.domain, node.op_type) == SIGNATURES and all(
            name in values and values[name].tensor_type.elem_type == TensorProto.FLOAT for name in node.input
        ):
            node.domain, node.op_type = COMPILED_SIGNATURES
            changed += 1
    called = {(n.domain, n.op_type) for n in model.graph.node}
    kept = [f for f in model.functions if (f.domain, f.name) != SIGNATURES or SIGNATURES in called]
    del model.functions[:]
    model.functions.extend(kept)
    return changed


@dataclass(frozen=True)
class KernelForm:
    """What ``for_cpu_kernels`` made of a graph: how many signature stages and logits adds went
    into the compiled ops."""

    signatures: int
    folded_adds: int


def for_cpu_kernels(model: onnx.ModelProto, ops: Collection[tuple[str, str]]) -> KernelForm:
    """The graph the CPU runtimes' compiled kernels run (ONNX Runtime's custom-op library, OpenVINO's
    extension), in place: split for the distance op (``mark_plugin_nodes``), each fp32 signature
    stage given to the compiled one (``compile_signatures``) and each logits add folded into the
    distances (``fold_logits_adds``)."""
    mark_plugin_nodes(model, ops)
    values = value_types(model)
    return KernelForm(compile_signatures(model, values), fold_logits_adds(model, values))


def fold_logits_adds(model: onnx.ModelProto, values: dict[str, onnx.TypeProto] | None = None) -> int:
    """ONNX Runtime's compiled-kernel form of a split graph (``mark_plugin_nodes``), in place: where
    q is fp32, each ``SaPE2Distance``'s ``CastLike`` goes (ONNX Runtime runs a float-to-float
    ``Cast`` as a copy of ``[B, h, T, T]``), and where the distances' one consumer is then the
    ``Add`` of fp32 logits (the fp16 plan casts them to fp32 for the encoding), the logits become
    the node's third input and the node takes the ``Add``'s place: the kernel adds them as it
    writes, in the same single fp32 addition. ``values`` as ``compile_signatures`` takes them.
    Returns the number of ``Add`` nodes folded."""
    from onnx import TensorProto

    values = value_types(model) if values is None else values
    types = {name: t.tensor_type.elem_type for name, t in values.items()}
    nodes = list(model.graph.node)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    dropped, folded = set(), 0
    for node in nodes:
        if (node.domain, node.op_type) not in SPLITS.values() or len(node.input) != 2:
            continue
        cast = consumers.get(node.output[0], [])
        if len(cast) != 1 or cast[0].op_type != "CastLike" or types.get(cast[0].input[1]) != TensorProto.FLOAT:
            continue
        node.output[0] = cast[0].output[0]
        dropped.add(id(cast[0]))
        adds = consumers.get(node.output[0], [])
        if node.output[0] in outputs or len(adds) != 1 or adds[0].op_type != "Add" or adds[0].domain not in STANDARD_DOMAINS:
            continue
        add = adds[0]
        logits = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        if logits == node.output[0] or types.get(logits) != TensorProto.FLOAT or _rank(values[logits]) not in (4, None):
            continue
        node.input.append(logits)
        node.output[0] = add.output[0]
        dropped.add(id(add))
        folded += 1
    kept = [n for n in nodes if id(n) not in dropped]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return folded


def _rank(value: onnx.TypeProto) -> int | None:
    """A tensor type's rank, None where inference left its shape unknown (a plan's cast logits:
    deploykit's trunk adds the bias to full ``[B, h, T, T]`` logits, and the kernel refuses others)."""
    return len(value.tensor_type.shape.dim) if value.tensor_type.HasField("shape") else None


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's type (inputs, initializers, inferred inner values, outputs), from shape
    inference on a light copy of the graph: its initializers declared as inputs, without data."""
    graph = onnx.GraphProto(name=model.graph.name)
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    light = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions))
    light.ir_version = model.ir_version
    inferred = onnx.shape_inference.infer_shapes(light).graph
    return {v.name: v.type for v in (*inferred.input, *inferred.value_info, *inferred.output)}
