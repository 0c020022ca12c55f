"""OpenVINO's rule set on small graphs: each rule respells what deploykit exports and ONNX Runtime
computes the same values on the result (OpenVINO's own runs: tests/backends/test_openvino.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from deploykit.graph.openvino import prepare_for_openvino, weights_in_seven_bits
from tests.small_graphs import int8_linear, packed_qkv


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    """The graph's values as written: ONNX Runtime's own fusions (its int8 ones round differently
    on the packed graph) are off."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


@pytest.mark.parametrize(("form", "bias"), [("gemm", True), ("gemm", False), ("matmul", True), ("int8", True), ("int8", False)])
def test_packed_qkv_becomes_three_products_with_the_same_q_k_v(form, bias):
    proto = packed_qkv(form=form, bias=bias)
    prepared = prepare_for_openvino(proto)
    ops = _ops(prepared.proto)
    product = "Gemm" if form == "gemm" else "MatMul"
    assert ops.count(product) == 3 and ops.count("Slice") == ops.count("Squeeze") == 0
    assert ops.count("Add") == (3 if bias and form != "gemm" else 0)
    assert ops.count("DequantizeLinear") == (3 if form == "int8" else 0)  # each third keeps its channels' scales
    assert [n.name for n in prepared.proto.graph.node if n.op_type == product] == ["qkv_part0", "qkv_part1", "qkv_part2"]
    transposes = [list(n.attribute[0].ints) for n in prepared.proto.graph.node if n.op_type == "Transpose"]
    assert transposes == [[0, 2, 1, 3]] * 3
    assert [o.name for o in prepared.proto.graph.output] == ["q", "k", "v"]
    assert not {t.name for t in prepared.proto.graph.initializer} & {"w", "w_q", "bias"}  # the packed weights are gone
    onnx.checker.check_model(prepared.proto, full_check=True)
    x = np.random.default_rng(2).standard_normal((2, 5, 8)).astype(np.float32)
    for got, want in zip(_run(prepared.proto, x), _run(proto, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_qkv_reshape_that_reads_zero_as_a_size_is_left_alone():
    proto = packed_qkv()
    next(n for n in proto.graph.node if n.name == "split_heads").attribute.append(onnx.helper.make_attribute("allowzero", 1))
    assert prepare_for_openvino(proto).changed  # torch.onnx writes allowzero; with no 0 among the sizes it changes nothing
    heads = next(t for t in proto.graph.initializer if t.name == "heads")
    heads.CopyFrom(numpy_helper.from_array(np.array([0, 5, 3, 2, 4], np.int64), "heads"))
    prepared = prepare_for_openvino(proto)
    assert not prepared.changed and _ops(prepared.proto) == _ops(proto)


def test_products_sharing_their_weights_get_parts_of_their_own():
    """The exporter shares one initializer between layers whose values are equal (untrained zero
    biases): each product's three parts are initializers of its own."""
    proto = packed_qkv()
    kept = {t.name for t in proto.graph.initializer} | {"x"}
    for node in list(proto.graph.node):
        twin = proto.graph.node.add()
        twin.CopyFrom(node)
        twin.name = f"twin_{node.name}"
        twin.input[:] = [name if name in kept else f"twin_{name}" for name in node.input]
        twin.output[:] = [f"twin_{name}" for name in node.output]
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(f"twin_{n}", onnx.TensorProto.FLOAT, ["batch", 2, 5, 4]) for n in "qkv")
    prepared = prepare_for_openvino(proto)
    assert _ops(prepared.proto).count("Gemm") == 6
    onnx.checker.check_model(prepared.proto, full_check=True)
    x = np.random.default_rng(3).standard_normal((2, 5, 8)).astype(np.float32)
    for got, want in zip(_run(prepared.proto, x), _run(proto, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_seven_bit_weights_halve_each_symmetric_int8_weight_once():
    model = ir.from_proto(int8_linear(tokens=10, features=8, channels=4, bias=False, weight_limit=127))
    original = model.graph.initializers["w"].const_value.numpy().copy()
    scale = model.graph.initializers["w_scale"].const_value.numpy().copy()
    assert weights_in_seven_bits(model) == 1 and weights_in_seven_bits(model) == 0  # once: then within 7 bits
    narrowed = model.graph.initializers["w"].const_value.numpy()
    assert narrowed.min() >= -64 and narrowed.max() <= 63
    np.testing.assert_array_equal(narrowed, np.clip(np.rint(original / 2.0), -64, 63))
    np.testing.assert_array_equal(model.graph.initializers["w_scale"].const_value.numpy(), scale * 2)


def test_a_weight_two_nodes_share_is_narrowed_for_each_in_its_own_copy():
    proto = int8_linear(tokens=10, features=8, channels=4, bias=False, weight_limit=127)
    shared = onnx.helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["w_dq_again"], axis=1)
    proto.graph.node.append(shared)
    proto.graph.output.append(onnx.helper.make_tensor_value_info("w_dq_again", onnx.TensorProto.FLOAT, [8, 4]))
    prepared = prepare_for_openvino(proto, seven_bit_weights=True)
    assert prepared.narrowed_weights == 2
    weights = [
        onnx.numpy_helper.to_array(t) for t in prepared.proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2
    ]
    assert len(weights) == 2  # each reader has its own narrowed weight, and the copies are equal
    assert all(w.min() >= -64 and w.max() <= 63 for w in weights) and (weights[0] == weights[1]).all()
