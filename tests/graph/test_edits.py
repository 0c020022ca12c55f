"""Graph edits without numeric meaning: a quantized node put back in float reads the float graph's
tensors (its weight copied in), the Q/DQ pairs nobody reads go, and a graph cut where some of its
tensors are given keeps only what its outputs need. Each result runs in ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from deploykit.graph.edits import back_to_float, starting_at

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 4)).astype(np.float32)
W1, W2 = RNG.standard_normal((4, 3)).astype(np.float32), RNG.standard_normal((3, 5)).astype(np.float32)
SCALES = {"x": 0.03, "h": 0.05, "w1": 0.02, "w2": 0.025}
SCOPE = {"pkg.torch.onnx.name_scopes": "['model', 'model.fc1']"}


def _graph(nodes, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "two-linears",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [numpy_helper.from_array(np.asarray(v), name) for name, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _fc1(first_input: str, weight: str) -> onnx.NodeProto:
    node = helper.make_node("MatMul", [first_input, weight], ["h"], name="fc1")
    helper.set_metadata_props(node, SCOPE)
    return node


def _float() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        _fc1("x", "w1"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2"),
    ]
    return _graph(nodes, {"w1": W1, "w2": W2})


def _quantized() -> onnx.ModelProto:
    """Both products int8 (ONNX Runtime's QDQ form): activations and weights through Q/DQ pairs;
    the image's pair is read by ``Shape`` too."""
    nodes, initializers = [], {}
    for name in ("x", "h"):
        initializers |= {f"{name}_scale": np.float32(SCALES[name]), f"{name}_zero": np.int8(0)}
        nodes += [
            helper.make_node("QuantizeLinear", [name, f"{name}_scale", f"{name}_zero"], [f"{name}_q"], name=f"{name}_Q"),
            helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zero"], [f"{name}_dq"], name=f"{name}_DQ"),
        ]
    for name, weight in (("w1", W1), ("w2", W2)):
        initializers |= {f"{name}_quantized": _int8(weight, SCALES[name]), f"{name}_scale": np.float32(SCALES[name])}
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_quantized", f"{name}_scale"], [f"{name}_dq"], name=f"{name}_DQ"))
    nodes += [
        helper.make_node("Shape", ["x_dq"], ["shape"], name="shape"),
        _fc1("x_dq", "w1_dq"),
        helper.make_node("MatMul", ["h_dq", "w2_dq"], ["y"], name="fc2"),
    ]
    order = ["x_Q", "x_DQ", "w1_DQ", "w2_DQ", "shape", "fc1", "h_Q", "h_DQ", "fc2"]  # topological
    return _graph(sorted(nodes, key=lambda n: order.index(n.name)), initializers)


def _int8(values: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(np.rint(values / scale), -128, 127).astype(np.int8)


def _run(proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y", "shape"], feed)


def test_a_node_back_in_float_reads_the_float_tensors_and_unread_pairs_go():
    quantized, float_graph = _quantized(), _float()
    model = ir.from_proto(quantized)
    back_to_float(model, ir.from_proto(float_graph), ["fc1"], ("MatMul", "Gemm", "Conv"))
    edited = ir.to_proto(model)
    nodes = {n.name: n for n in edited.graph.node}
    assert list(nodes["fc1"].input) == ["x", "w1"] and nodes["fc1"].metadata_props[0].value == SCOPE["pkg.torch.onnx.name_scopes"]
    assert list(nodes["shape"].input) == ["x"]  # the image's pair fed only Shape: it reads the image again
    assert list(nodes) == ["w2_DQ", "shape", "fc1", "h_Q", "h_DQ", "fc2"]  # fc2 keeps its int8 input and weight
    assert sorted(i.name for i in edited.graph.initializer) == ["h_scale", "h_zero", "w1", "w2_quantized", "w2_scale"]
    np.testing.assert_array_equal(numpy_helper.to_array(next(i for i in edited.graph.initializer if i.name == "w1")), W1)
    # Worked by hand: fc1 in float, then h and w2 through int8 (round half to even, zero point 0).
    h = X @ W1
    expected = (_int8(h, SCALES["h"]).astype(np.float32) * np.float32(SCALES["h"])) @ (_int8(W2, SCALES["w2"]) * np.float32(SCALES["w2"]))
    y, shape = _run(edited, {"x": X})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert shape.tolist() == [2, 4]
    assert not np.allclose(_run(quantized, {"x": X})[0], y, rtol=1e-5, atol=1e-5)  # control: the edit changed the values


def test_no_node_back_in_float_leaves_the_graph_as_it_is():
    model = ir.from_proto(_quantized())
    back_to_float(model, ir.from_proto(_float()), [], ("MatMul",))
    assert [n.name for n in model.graph] == [n.name for n in _quantized().graph.node]


def test_a_graph_started_at_given_tensors_keeps_what_its_outputs_need():
    model = ir.from_proto(_float())
    h = X @ W1
    starting_at(model, {"x": X[:1], "h": h})
    cut = ir.to_proto(model)
    assert [n.name for n in cut.graph.node] == ["shape", "fc2"] and [i.name for i in cut.graph.initializer] == ["w2"]
    assert [(i.name, len(i.type.tensor_type.shape.dim)) for i in cut.graph.input] == [("x", 2), ("h", 2)]
    assert cut.graph.input[1].type.tensor_type.shape.dim[0].dim_param == "h.0"  # dimensions left free
    y, shape = _run(cut, {"x": X, "h": h})
    np.testing.assert_array_equal(y, _run(_float(), {"x": X})[0])
    assert shape.tolist() == [2, 4]
