"""OpenVINO's rule set: what its ONNX frontend and CPU plugin read of an exported graph, prepared in memory.

``prepare_for_openvino`` runs, in order:

* model-local functions inlined: OpenVINO's ONNX frontend has no rule for a custom-domain node
  (``deploykit::SaPE2Bias``) even when its function gives the body (ONNX Runtime and TensorRT
  inline them themselves);
* ``THREE_PRODUCTS``: each attention's packed qkv product as three, one per tensor;
* on request, int8 weights narrowed to 7 bits (``weights_in_seven_bits``).

Every rule computes the same values; the file on disk is never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from deploykit.graph.rules import RuleSet, constant_ints, optional_input, plain_gemm


def _packed_qkv_part(op, x, weight, bias, shape, start, end):
    # timm's Attention as exported: one product to 3·h·d channels, reshaped to [B, N, 3, h, d],
    # permuted to [3, B, h, N, d], and part ``start`` (q, k or v) taken by Slice + Squeeze.
    from onnxscript.rewriter import pattern

    product = pattern.OrValue(
        [
            op.Gemm(x, weight, optional_input("bias"), _outputs=["product"]),
            op.Add(op.MatMul(x, weight, _outputs=["product"]), bias),
            op.MatMul(x, weight, _outputs=["product"]),
        ],
        tag_var="form",
        tag_values=["gemm", "matmul", "matmul"],
    )
    heads = op.Transpose(op.Reshape(product, shape), perm=[2, 0, 3, 1, 4])
    return op.Squeeze(op.Slice(heads, start, end, [0]), [0])


def _splits_in_three(context, weight, shape, product, form, start, end, bias=None, **_) -> bool:
    # Heads split from constant weights: a float weight, or an int8 one with per-channel scales.
    dims, first, last = constant_ints(shape), constant_ints(start), constant_ints(end)
    # no 0 among the sizes, so a Reshape's ``allowzero`` (torch.onnx sets it) changes nothing
    if dims is None or len(dims) != 5 or dims[2] != 3 or 0 in dims or min(dims[3:]) < 1:
        return False
    channels = 3 * dims[3] * dims[4]
    biased = bias is None or (_constant(bias) is not None and _constant(bias).shape == (channels,))
    part = first is not None and len(first) == 1 and first[0] in (0, 1, 2) and last == [first[0] + 1]
    return part and biased and _weight_thirds_exist(weight, channels) and (form != "gemm" or plain_gemm(product.producer()))


def _one_of_three_products(op, x, weight, shape, product, form, start, bias=None, **_):
    # OpenVINO 2026.4 runs the 5-D permute as a standalone Transpose (9-10% of ViT-S/16's time at
    # 384 px, batch 8) but folds a per-tensor [0, 2, 1, 3] transpose into its fused attention
    # (``benchmarks/openvino_qkv.py``). Each output channel is the same dot product over the same
    # weights, and an int8 weight keeps its per-channel scales. The packed product goes once its
    # three parts are rewritten (the rule leaves matched nodes for ``prepare_for_openvino``'s sweep).
    batch, tokens, _, heads, width = constant_ints(shape)
    (i,) = constant_ints(start)
    tag = f"{product.producer().name or product.name}_part{i}"
    part_weight, part_bias = _third(op, weight, i, tag), [] if bias is None else [_third(op, bias, i, tag)]
    out = op.MatMul(x, part_weight) if form == "matmul" else op.Gemm(x, part_weight, *part_bias)
    out.producer().name = tag
    if form == "matmul" and part_bias:
        out = op.Add(out, *part_bias)
    part = op.Transpose(op.Reshape(out, op.Constant(value_ints=[batch, tokens, heads, width])), perm=[0, 2, 1, 3])
    part.producer().name = f"{tag}_heads"
    return part


def _constant(value) -> np.ndarray | None:
    return None if value is None or value.const_value is None else value.const_value.numpy()


def _dequantized(weight):
    """The ``DequantizeLinear`` computing ``weight`` from constants along axis 1, or None."""
    node = weight.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.attributes.get_int("axis", 1) != 1:
        return None
    return node if all(_constant(v) is not None for v in node.inputs) else None


def _columns(weight) -> int | None:
    """Output channels of a 2-D constant weight, or of the constant an int8 weight dequantizes."""
    dq = _dequantized(weight)
    values = _constant(dq.inputs[0] if dq is not None else weight)
    return values.shape[-1] if values is not None and values.ndim == 2 else None


def _weight_thirds_exist(weight, channels: int) -> bool:
    dq = _dequantized(weight)
    if dq is None:
        return _constant(weight) is not None and _columns(weight) == channels
    return _columns(weight) == channels and all(_constant(v).shape == (channels,) for v in dq.inputs[1:])


def _third(op, value, index: int, part: str):
    """Part ``index`` of three of a constant's last axis, or of what an int8 weight dequantizes,
    named after ``part`` (the product it feeds): the exporter shares one initializer between
    layers whose values are equal (zero biases), so the source's name alone is not unique."""
    import onnx_ir as ir

    dq = _dequantized(value)
    if dq is not None:
        return op.DequantizeLinear(*(_third(op, source, index, part) for source in dq.inputs), axis=1)
    values = _constant(value)
    width = values.shape[-1] // 3
    name = f"{part}.{value.name}"
    return op.initializer(ir.tensor(np.ascontiguousarray(values[..., index * width : (index + 1) * width]), name=name), name)


def _three_products_rules() -> list:
    from onnxscript.rewriter import pattern

    # Matched nodes stay (``remove_nodes=False``): q, k and v share the packed product, so each
    # part is one match with one output, not one match with three (a search over node triples).
    return [pattern.RewriteRule(_packed_qkv_part, _one_of_three_products, _splits_in_three, name="QkvAsThreeProducts", remove_nodes=False)]


THREE_PRODUCTS = RuleSet("openvino: packed qkv as three products", _three_products_rules)


def weights_in_seven_bits(model) -> int:
    """Requantize, in place, every symmetric int8 weight of an ``onnx_ir`` model to 7 bits (values
    halved and rounded to [-64, 63], scales doubled); returns how many weights.

    Without VNNI, OpenVINO's CPU plugin adds two u8·s8 products in 16 bits: 255·127·2 overflows,
    255·64·2 does not. The saturated sums made OpenVINO's int8 ViT-S/16 at 224 px (seeded) reach
    cosine 0.915 with fp32 on an AVX2 CPU, where ONNX Runtime reached 0.996 on the same file (0.996
    with 7-bit weights). 7-bit weights are OpenVINO's documented workaround (NNCF's
    ``overflow_fix``); they cost one bit of weight resolution.
    """
    import onnx_ir as ir

    narrowed = 0
    for node in list(model.graph):
        if node.op_type != "DequantizeLinear" or len(node.inputs) < 3:
            continue
        sources = node.inputs[:3]
        if any(v is None or v.producer() is not None or v.const_value is None for v in sources):
            continue  # only a weight held in initializers
        values, factors, zero = (v.const_value.numpy() for v in sources)
        if values.dtype != np.int8 or zero.any() or (values.min() >= -64 and values.max() <= 63):
            continue  # not a symmetric int8 weight, or already within 7 bits
        halved = (
            np.clip(np.rint(values / 2.0), -64, 63).astype(np.int8),
            np.asarray(factors * 2, dtype=factors.dtype),
        )  # a 0-d scale stays an array of its dtype
        for index, (value, array) in enumerate(zip(sources[:2], halved)):
            if len(value.uses()) == 1:
                value.const_value = ir.tensor(array, name=value.name)
            else:  # shared with another node: this node gets its own copy
                own = ir.Value(name=f"{value.name}_7bit_{node.outputs[0].name}", const_value=ir.tensor(array))
                own.shape, own.type = own.const_value.shape, ir.TensorType(own.const_value.dtype)
                model.graph.register_initializer(own)
                node.replace_input_with(index, own)
        narrowed += 1
    return narrowed


@dataclass(frozen=True)
class OpenvinoGraph:
    """An exported graph as OpenVINO reads it."""

    proto: onnx.ModelProto
    changed: bool  # whether it differs from the file (else OpenVINO may read the file itself)
    inlined: frozenset[str]  # outputs of the nodes inlined from model-local functions
    narrowed_weights: int  # int8 weights narrowed to 7 bits


def prepare_for_openvino(proto: onnx.ModelProto, seven_bit_weights: bool = False) -> OpenvinoGraph:
    """``proto`` with OpenVINO's rule set applied (the module docstring lists it, in order);
    ``proto`` itself is left as it is. ``seven_bit_weights``: narrow int8 weights
    (``weights_in_seven_bits``), for a CPU whose int8 products saturate."""
    import onnx.inliner
    import onnx_ir as ir
    import onnx_ir.passes.common

    inlined: frozenset[str] = frozenset()
    if proto.functions:
        before = {name for node in proto.graph.node for name in node.output}
        proto = onnx.inliner.inline_local_functions(proto)
        inlined = frozenset(name for node in proto.graph.node for name in node.output if name not in before)
    model = ir.from_proto(proto)
    rewritten = THREE_PRODUCTS.apply(model)
    if rewritten:  # what the rules replaced goes (the packed qkv products too) before the weights are counted
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    narrowed = weights_in_seven_bits(model) if seven_bit_weights else 0
    if rewritten or narrowed:
        proto = ir.to_proto(model)
    return OpenvinoGraph(proto, bool(inlined or rewritten or narrowed), inlined, narrowed)
