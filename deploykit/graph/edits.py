"""Graph edits with no numeric meaning of their own, on ``onnx_ir`` (which keeps node metadata:
the exporter's name scopes, by which every node is named after its module).

* ``back_to_float``: quantized nodes read the float tensors of their float graph again, and the
  Q/DQ pairs nobody reads any more go;
* ``counterpart``: a value of another graph of the same model, found in this one by name (a
  float weight copied in when this graph holds it quantized only);
* ``starting_at``: the part of a graph its outputs need once some of its tensors are given.

Torch-free; the INT8 fallback (``deploykit.export.sensitivity``) decides what to edit.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: onnx_ir is slow to import
    import numpy as np
    import onnx_ir as ir

QDQ = ("QuantizeLinear", "DequantizeLinear")


def counterpart(graph: ir.Graph, value: ir.Value, known: dict[str, ir.Value]) -> ir.Value:
    """The value of ``graph`` named as ``value`` (a value of another graph of the same model): from
    ``known`` (``graph``'s values by name, updated), or a new initializer holding ``value``'s
    constant (a float weight the quantized graph holds as int8 only)."""
    import onnx_ir as ir

    if value.name not in known:
        copy = ir.Value(name=value.name, shape=value.shape, type=value.type, const_value=value.const_value)
        graph.register_initializer(copy)
        known[value.name] = copy
    return known[value.name]


def back_to_float(model: ir.Model, float_model: ir.Model, nodes: Iterable[str], quantized_ops: Collection[str]) -> None:
    """Put ``nodes`` of a Q/DQ ``model`` back in float, in place: each input a node reads through a
    ``DequantizeLinear`` becomes the input the same node reads in ``float_model`` (the activation,
    or the float weight); an activation Q/DQ pair no node of ``quantized_ops`` reads any more gives
    its readers the float tensor again; then the Q/DQ nodes and the initializers nobody reads go.
    Every other node keeps its calibrated scales."""
    import onnx_ir as ir

    wanted = set(nodes)
    if not wanted:  # nothing goes back: not even an orphan pair changes
        return
    twins = {n.name: n for n in float_model.graph if n.name in wanted}
    known = ir.convenience.create_value_mapping(model.graph)
    for node in [n for n in model.graph if n.name in wanted]:
        for k, value in enumerate(node.inputs):
            if value is not None and value.producer() is not None and value.producer().op_type == "DequantizeLinear":
                # The activation (Q's input, produced earlier: the order stays valid) or the float weight.
                node.replace_input_with(k, counterpart(model.graph, twins[node.name].inputs[k], known))
    _unquantize_orphans(model.graph, quantized_ops)
    _drop_unread_qdq(model.graph)


def _unquantize_orphans(graph: ir.Graph, quantized_ops: Collection[str]) -> None:
    """An activation Q/DQ pair no quantized node reads any more (only, say, the ``Shape`` of the
    image): its readers take the float tensor again."""
    import onnx_ir as ir

    for dq in [n for n in graph if n.op_type == "DequantizeLinear"]:
        q = dq.inputs[0].producer()
        if q is None or q.op_type != "QuantizeLinear" or any(use.node.op_type in quantized_ops for use in dq.outputs[0].uses()):
            continue
        ir.convenience.replace_all_uses_with(dq.outputs[0], q.inputs[0])


def _drop_unread_qdq(graph: ir.Graph) -> None:
    """Remove the Q/DQ nodes whose outputs nobody reads (last first, so a pair goes in one sweep),
    then the initializers nobody reads."""
    for node in reversed(list(graph)):
        if node.op_type in QDQ and not any(out.uses() or out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)
    for name, value in list(graph.initializers.items()):
        if not (value.uses() or value.is_graph_output() or value.is_graph_input()):
            del graph.initializers[name]


def starting_at(model: ir.Model, given: Mapping[str, np.ndarray]) -> None:
    """Cut ``model``, in place, to what its outputs need once the tensors ``given`` are fed: those
    become graph inputs (of the given values' dtypes and ranks, dimensions left free); the nodes
    before them, the initializers only those read and the graph inputs nobody reads any more go."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    graph = model.graph
    known = ir.convenience.create_value_mapping(graph)
    fed = []
    for name, array in given.items():
        value = known[name]
        if value.producer() is not None:
            value = ir.Value(name=name)
            ir.convenience.replace_all_uses_with(known[name], value, replace_graph_outputs=True)
        value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        value.shape = ir.Shape([f"{name}.{d}" for d in range(array.ndim)])
        fed.append(value)
    kept = [v for v in graph.inputs if v.name not in given and v.uses()]  # the masks of a blended graph, say
    graph.inputs.clear()
    graph.inputs.extend([*fed, *kept])
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
