"""The dynamic quantizer's rule set: a selected plain Gemm becomes MatMul + bias Add under its own
name, with the same values; anything else is left as it is."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from deploykit.graph.dynamic_quantizer import dynamic_quantizer_rules


def _two_gemms() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in (("w1", (6, 5)), ("b1", (5,)), ("w2", (5, 3)))}
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
        helper.make_node("Gemm", ["h", "w2"], ["y"], name="fc2"),
        helper.make_node("Gemm", ["h", "w2"], ["z"], name="transposed", transA=1),
    ]
    graph = helper.make_graph(
        nodes,
        "gemms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 6])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [5, 3]) for name in ("y", "z")],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_selected_plain_gemms_become_matmul_and_bias_under_their_names():
    proto = _two_gemms()
    model = ir.from_proto(proto)
    assert dynamic_quantizer_rules({"fc1", "fc2", "transposed"}).apply(model) == 2
    rewritten = ir.to_proto(model)
    assert [(n.op_type, n.name) for n in rewritten.graph.node] == [
        ("MatMul", "fc1"),
        ("Add", "fc1.bias"),
        ("MatMul", "fc2"),
        ("Gemm", "transposed"),  # transA: not a plain product
    ]
    x = np.random.default_rng(1).standard_normal((5, 6)).astype(np.float32)
    for got, want in zip(_run(rewritten, x), _run(proto, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_gemm_not_selected_stays():
    model = ir.from_proto(_two_gemms())
    assert dynamic_quantizer_rules({"fc2"}).apply(model) == 1
    assert [n.op_type for n in model.graph] == ["Gemm", "MatMul", "Gemm"]
