"""The cast plans' pass: an fp32 graph rewritten with explicit ``Cast`` nodes so its products run
in fp16 or bf16 while the positional tables, LayerNorm, Softmax, custom ops and the logits stay
in fp32 (the rules: ``deploykit.export.precision``'s docstring); and the tensors such a plan keeps
in fp32, for a runtime that lowers precision itself (OpenVINO's bf16 hint).

Torch-free, on onnx_ir: values know their producer, readers and type, and its tensors hold
bfloat16 through ml_dtypes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import onnx
from onnx import TensorProto

from deploykit.catalog import TABLE_PREFIXES

if TYPE_CHECKING:
    import onnx_ir as ir  # imported where used: it is slow to import

# Where the time goes: these run in the plan's type.
LOW_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Conv"})
# Reductions whose range or accumulation fp16 cannot hold: always fp32.
FP32_OPS = frozenset({"LayerNormalization", "Softmax"})
# The ONNX operator set itself (a node of another domain is custom, and stays fp32).
ONNX_DOMAINS = ("", "ai.onnx")
# Low type -> (short name for inserted tensors, ONNX schema type name).
_LOW_NAMES = {TensorProto.FLOAT16: ("fp16", "float16"), TensorProto.BFLOAT16: ("bf16", "bfloat16")}


class Fp32Tensors(NamedTuple):
    """The output tensors a cast plan keeps in fp32, for a runtime that lowers precision itself."""

    every: set[str]  # every fp32 node's: what to mark for f32
    encoding: set[str]  # the part whose lowering makes a run unfaithful


def fp32_tensors(proto: onnx.ModelProto, low: int = TensorProto.BFLOAT16) -> Fp32Tensors:
    """Output tensors of the nodes a cast plan to ``low`` would keep in fp32: for a runtime that
    lowers precision itself (OpenVINO's bf16 hint) to keep the same nodes in fp32.

    ``every``: tables and their readers, LayerNorm, Softmax, custom ops, the logits, and what
    follows them. ``encoding``: the part a runtime must not lower for its run to count as faithful:
    the tables' readers (the rotations, the table adds), LayerNorm, Softmax, custom-domain nodes
    (encoding bodies), and every other fp32 node computing from a live value (the residual stream,
    the layout ops that carry a rotated query to its product). Not in it: the products the plan
    keeps in fp32 only because they produce an output (the logits), and nodes whose float inputs
    are weights alone (the class token's batch expand); a runtime that rounds those to bf16
    rounds them as it rounds every product's inputs.

    Args:
        proto: an exported graph, of any plan (its float nodes are classified as the cast plan would).
        low: ``TensorProto.BFLOAT16`` or ``FLOAT16``.
    """
    cast_pass = CastPass(proto, low)
    low_nodes = cast_pass._classify()
    kept = [node for node in cast_pass.graph if node not in low_nodes]
    encoding = []
    for node in kept:
        floats = [v for v in node.inputs if v in cast_pass.floats]
        own = node.op_type in FP32_OPS or node.domain not in ONNX_DOMAINS or any(v.name.startswith(TABLE_PREFIXES) for v in floats)
        computes = node.op_type not in LOW_PRECISION_OPS and any(not v.is_initializer() for v in floats)
        if own or computes:
            encoding.append(node)
    outputs = lambda nodes: {value.name for node in nodes for value in node.outputs if value in cast_pass.floats}
    return Fp32Tensors(outputs(kept), outputs(encoding))


class CastPass:
    """One pass over a topologically sorted graph, on onnx_ir: classify each node, then insert the casts.

    A value's type is the type it is stored in: the pass changes it as it lowers the value's
    producer or weight, and inserts a Cast where a reader wants the other type.
    """

    def __init__(self, proto: onnx.ModelProto, low: int, qdq: bool = False, keep_fp32: frozenset[str] = frozenset()):
        import onnx_ir as ir

        self.keep_fp32 = keep_fp32  # node names pinned to fp32 (--keep-float, ``precision_debug``)
        self.low, self.low_name = low, _LOW_NAMES[low][0]
        # Q/DQ plans over a low remainder (``gpu_plans``): a DequantizeLinear feeding only low
        # products gives the low type itself, rather than fp32 and a Cast before each product.
        self.qdq = qdq
        # inferred: every tensor's type, also in a plan's graph written without them
        self.model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
        self.graph = self.model.graph
        self.opset = next(v for d, v in self.model.opset_imports.items() if d in ONNX_DOMAINS)
        values = [*self.graph.inputs, *self.graph.initializers.values(), *(v for node in self.graph for v in node.outputs)]
        self.floats = {v for v in values if v.dtype == TensorProto.FLOAT}  # the fp32 graph's float tensors
        self.outputs = set(self.graph.outputs)

    def rewrite(self) -> onnx.ModelProto:
        import onnx_ir as ir

        low_nodes = self._classify()
        self._convert_initializers(low_nodes)
        casts: dict[tuple[ir.Value, int], ir.Value] = {}
        for node in list(self.graph):
            want = self.low if node in low_nodes else TensorProto.FLOAT
            for k, value in enumerate(node.inputs):
                if value in self.floats and value.dtype != want:
                    node.replace_input_with(k, self._cast(value, want, casts, node))
            if node in low_nodes:
                self._lower_node(node)
        out = ir.to_proto(self.model)
        # As exported plans always were: no value_info (the lint re-infers types). Given them,
        # ONNX Runtime fuses the fp16 graph differently and the logits move in the last bit.
        del out.graph.value_info[:]
        return out

    def _classify(self) -> set[ir.Node]:
        """The nodes that run in the low type."""
        low_nodes: set[ir.Node] = set()
        for node in self.graph:
            floats = [v for v in node.inputs if v in self.floats]
            live = [v for v in floats if not v.is_initializer()]
            if not self._may_lower(node, floats):
                continue
            if node.op_type in LOW_PRECISION_OPS or (live and all(v.producer() in low_nodes for v in live)):
                low_nodes.add(node)
            elif self.qdq and node.op_type == "DequantizeLinear" and self._feeds_low_products(node):
                low_nodes.add(node)
        return low_nodes

    def _feeds_low_products(self, node: ir.Node) -> bool:
        uses = [use.node for value in node.outputs for use in value.uses()]
        return bool(uses) and all(
            user.op_type in LOW_PRECISION_OPS and self._may_lower(user, [v for v in user.inputs if v in self.floats]) for user in uses
        )

    def _may_lower(self, node: ir.Node, floats: list[ir.Value]) -> bool:
        if node.name in self.keep_fp32:
            return False
        if not floats or node.domain not in ONNX_DOMAINS or node.op_type in FP32_OPS:
            return False
        if any(v.name.startswith(TABLE_PREFIXES) for v in floats) or not self.outputs.isdisjoint(node.outputs):
            return False
        return _schema_accepts(node.op_type, self.opset, self.low)

    def _convert_initializers(self, low_nodes: set[ir.Node]) -> None:
        """Store in the low type the float weights that only low nodes read (tables never)."""
        for name, value in self.graph.initializers.items():
            readers = {use.node in low_nodes for use in value.uses()}
            if value.dtype == TensorProto.FLOAT and readers == {True} and not name.startswith(TABLE_PREFIXES):
                self._retype(value, self.low)
                value.const_value = _converted(value.const_value, self.low, name)

    def _cast(self, value: ir.Value, to: int, casts: dict, reader: ir.Node) -> ir.Value:
        """``value`` cast to ``to``; the Cast is emitted once, before its first reader."""
        import onnx_ir as ir

        if (value, to) not in casts:
            cast = ir.Value(name=f"{value.name}.to_{'fp32' if to == TensorProto.FLOAT else self.low_name}", shape=value.shape)
            self._retype(cast, to)
            if value.is_initializer():  # a weight read in both types: store both (a Cast would be an unfolded constant)
                cast.const_value = _converted(value.const_value, to, cast.name)
                self.graph.register_initializer(cast)
            else:
                self.graph.insert_before(reader, ir.node("Cast", [value], {"to": to}, outputs=[cast], name=f"cast.{cast.name}"))
            casts[value, to] = cast
        return casts[value, to]

    def _lower_node(self, node: ir.Node) -> None:
        import onnx_ir as ir

        to, value = node.attributes.get("to"), node.attributes.get("value")  # ops that name their output type
        if node.op_type == "Cast" and to is not None and to.value == TensorProto.FLOAT:
            node.attributes["to"] = ir.AttrInt64("to", self.low)
        elif node.op_type == "Constant" and value is not None and value.value.dtype == TensorProto.FLOAT:
            node.attributes["value"] = ir.AttrTensor("value", _converted(value.value, self.low, value.value.name))
        for output in node.outputs:
            if output in self.floats:
                self._retype(output, self.low)

    @staticmethod
    def _retype(value: ir.Value, to: int) -> None:
        import onnx_ir as ir

        value.type = ir.TensorType(ir.DataType(to))  # a new type object: setting dtype edits the old one in place


def _schema_accepts(op_type: str, opset: int, low: int) -> bool:
    """Whether every type constraint of ``op_type`` that admits float also admits ``low``."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    low_str = f"tensor({_LOW_NAMES[low][1]})"
    return all(low_str in c.allowed_type_strs for c in schema.type_constraints if "tensor(float)" in c.allowed_type_strs)


def converted_array(values, to: int):
    """A numpy array rounded to ONNX type ``to`` (round-to-nearest-even; bfloat16 as ml_dtypes')."""
    import onnx_ir as ir

    return values.astype(ir.DataType(to).numpy())


def _converted(tensor: ir.TensorProtocol, to: int, name: str | None) -> ir.TensorProtocol:
    """``tensor`` converted to ONNX type ``to`` (round-to-nearest-even, as a Cast would; numpy
    holds bfloat16 as ml_dtypes')."""
    import onnx_ir as ir

    return ir.tensor(tensor.numpy().astype(ir.DataType(to).numpy()), name=name or None)


# The GPU plans' remainder (deploykit.export.gpu_plans): the cast pass over a Q/DQ graph.
