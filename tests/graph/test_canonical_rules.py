"""The canonical rule set: the exported file spells GELU as ONNX Runtime fuses it and the key
transpose as one Transpose, keeps linear layers as MatMul + bias over [B, N, D] for every runtime,
and computes what the plain export computes."""

from collections import Counter
from unittest import mock

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from deploykit.export import onnx_from_model
from deploykit.export.onnx_export import DEFAULT_OPSET
from deploykit.graph import RuleSet
from deploykit.graph.canonical import CANONICAL
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner, session_options


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding="ape", depth=2, img_size=64, num_classes=10).eval()


def _ort_optimised_ops(proto, tmp_path) -> Counter:
    """Op counts of the graph ONNX Runtime optimised from the exported file."""
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(tmp_path / "optimised.onnx"), load_external_data=False).graph.node)


def _linears_as_gemm(proto) -> int:
    """Gemm nodes between two Reshapes: 3-D linear layers flattened to 2-D."""
    producers = {out: n.op_type for n in proto.graph.node for out in n.output}
    reshaped = {name for n in proto.graph.node if n.op_type == "Reshape" for name in n.input}
    return sum(n.op_type == "Gemm" and producers.get(n.input[0]) == "Reshape" and n.output[0] in reshaped for n in proto.graph.node)


def test_ort_fuses_every_gelu_of_the_file_whose_linears_stay_3d(model, tmp_path):
    proto = onnx_from_model(model, (64, 64))
    assert _linears_as_gemm(proto) == 0 and sum(n.op_type == "MatMul" for n in proto.graph.node) >= 2 * 4
    ops = _ort_optimised_ops(proto, tmp_path)
    assert "Erf" not in ops and ops["Gelu"] + ops["BiasGelu"] == 2  # one per block


def test_rewrite_keeps_values_and_block_scopes(model):
    """The rewritten graph computes what the plain export computes, and keeps the name scopes."""
    program = torch.onnx.export(model, (torch.zeros(2, 3, 64, 64),), dynamo=True, opset_version=DEFAULT_OPSET, optimize=True, verbose=False)
    plain = program.model_proto
    rewritten = ir.from_proto(plain)
    assert CANONICAL.apply(rewritten) == 2  # one GELU per block
    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    with OnnxrtRunner(ir.to_proto(rewritten).SerializeToString()) as both, OnnxrtRunner(plain.SerializeToString()) as original:
        a = both.infer({both.input_names()[0]: x})
        b = original.infer({original.input_names()[0]: x})
    np.testing.assert_allclose(next(iter(a.values())), next(iter(b.values())), atol=1e-5, rtol=1e-5)
    gelus = [n for n in ir.to_proto(rewritten).graph.node if n.op_type == "Erf"]
    scopes = [next(p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes") for n in gelus]
    assert sum("mlp.act" in s for s in scopes) == 2


def _key_swaps(proto) -> int:
    """Transposes swapping the last two axes of a [B, heads, N, d] tensor."""
    perms = (next(list(a.ints) for a in n.attribute if a.name == "perm") for n in proto.graph.node if n.op_type == "Transpose")
    return sum(p == [0, 1, 3, 2] for p in perms)


def test_key_swap_is_one_transpose_and_keeps_every_bit(model):
    """torch.onnx swaps k's last two axes by flattening, a 3-D Transpose and a reshape back, with
    the shapes read from k at run time; the graph does it with one Transpose instead, and ONNX
    Runtime's outputs stay identical to the bit."""
    without_key_swap = RuleSet("canonical", lambda: [r for r in CANONICAL.rules() if r.name != "KeySwapAsOneTranspose"])

    proto = onnx_from_model(model, (64, 64))
    with mock.patch("deploykit.export.onnx_export.CANONICAL", without_key_swap):
        spelled_out = onnx_from_model(model, (64, 64))
    shapes = Counter(n.op_type for n in spelled_out.graph.node)["Shape"], Counter(n.op_type for n in proto.graph.node)["Shape"]
    assert shapes == (shapes[1] + 2, shapes[1])  # one shape read per block's attention is gone
    assert (_key_swaps(spelled_out), _key_swaps(proto)) == (0, 2)
    x = np.random.default_rng(1).standard_normal((3, 3, 64, 64)).astype(np.float32)
    with OnnxrtRunner(proto.SerializeToString()) as rewritten, OnnxrtRunner(spelled_out.SerializeToString()) as original:
        a = rewritten.infer({rewritten.input_names()[0]: x})
        b = original.infer({original.input_names()[0]: x})
    np.testing.assert_array_equal(next(iter(a.values())), next(iter(b.values())))


def _gelu_and_linear() -> onnx.ModelProto:
    """GELU as torch.onnx writes it, then a [B, 4, 6] linear layer as MatMul + bias Add."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    constants = {
        "sqrt2": np.array(np.sqrt(2.0), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
        "w": rng.standard_normal((6, 3)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }
    nodes = [
        helper.make_node("Div", ["x", "sqrt2"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["shifted"]),
        helper.make_node("Mul", ["half", "shifted"], ["halved"]),
        helper.make_node("Mul", ["x", "halved"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "w"], ["product"]),
        helper.make_node("Add", ["product", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 3])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
        # the exporter records shapes: the linear rule reads the static token and feature axes
        value_info=[helper.make_tensor_value_info("gelu", TensorProto.FLOAT, ["batch", 4, 6])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_canonical_set_respells_gelu_with_the_same_values_and_leaves_a_3d_linear():
    proto = _gelu_and_linear()
    model = ir.from_proto(proto)
    assert CANONICAL.apply(model) == 1
    rewritten = ir.to_proto(model)
    ops = [n.op_type for n in rewritten.graph.node if n.op_type != "Constant"]
    assert ops == ["Mul", "Div", "Erf", "Add", "Mul", "MatMul", "Add"]  # (x · 0.5) · (1 + erf(x/√2)), the linear as it was
    x = np.random.default_rng(1).standard_normal((2, 4, 6)).astype(np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    run = [
        ort.InferenceSession(p.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        for p in (proto, rewritten)
    ]
    np.testing.assert_allclose(run[1], run[0], rtol=1e-6, atol=1e-6)
