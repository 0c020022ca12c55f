"""Precision plans: read the written graph to check where the casts went, and run it."""

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit.encodings import list_encodings
from deploykit.errors import ConfigError, DeployKitError
from deploykit.export import export
from deploykit.export.lint import TABLE_PREFIXES, check_graph
from deploykit.export.manifest import Manifest
from deploykit.export.metadata import GraphMetadata
from deploykit.export.precision import apply_precision
from deploykit.validation.run import validate
from tests.encoding_params import EXPORT_BASE, encoding_model

RES = (EXPORT_BASE, EXPORT_BASE)
FP32, FP16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


@pytest.fixture(scope="module", params=list_encodings())
def export_dir(request, encoding_export):
    return encoding_export(request.param)


def _types(proto):
    """Tensor name -> element type, from strict shape inference of the written graph."""
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.value_info, *inferred.output]}
    types.update({i.name: i.data_type for i in inferred.initializer})
    return types


def _float_types(node, types, names):
    return {types[n] for n in names if n and types.get(n) in (FP32, FP16, BF16)}


def _check_plan(proto, low):
    types = _types(proto)
    producers = {o: n for n in proto.graph.node for o in n.output}
    logits_node = producers[proto.graph.output[0].name]
    tables = [i for i in proto.graph.initializer if i.name.startswith(TABLE_PREFIXES)]
    for table in tables:
        assert table.data_type == FP32, table.name
    matmuls = 0
    for node in proto.graph.node:
        io = _float_types(node, types, [*node.input, *node.output])
        if node.op_type in ("LayerNormalization", "Softmax") or any(i.startswith(TABLE_PREFIXES) for i in node.input):
            assert io == {FP32}, (node.op_type, node.name, io)
        elif node is logits_node:
            assert io == {FP32}
        elif node.op_type in ("MatMul", "Gemm") or (node.op_type == "Conv" and low == FP16):
            assert io == {low}, (node.op_type, node.name, io)
            matmuls += 1
    assert matmuls >= 2 * 4  # qkv, q@k, attn@v, proj per block at least
    assert proto.graph.input[0].type.tensor_type.elem_type == FP32
    assert proto.graph.output[0].type.tensor_type.elem_type == FP32
    return tables


@pytest.mark.slow
def test_fp16_graph_keeps_tables_layernorm_softmax_logits_fp32(export_dir):
    manifest = Manifest.read(export_dir)
    at_64 = [(g.file, g.precision) for g in manifest.graphs if tuple(g.resolution) == RES]
    assert at_64 == [("model_64.onnx", "fp32"), ("model_64_fp16.onnx", "fp16"), ("model_64_bf16.onnx", "bf16")]
    fp32 = onnx.load(str(export_dir / "model_64.onnx"))
    fp16 = onnx.load(str(export_dir / "model_64_fp16.onnx"))
    assert GraphMetadata.of(fp16).plan == "fp16" and GraphMetadata.of(fp32).plan == "fp32"
    assert all(_float_types(n, _types(fp32), n.output) <= {FP32} for n in fp32.graph.node)
    tables = _check_plan(fp16, FP16)
    # Tables are bit-identical to the fp32 export's: never rounded through fp16.
    original = {i.name: numpy_helper.to_array(i) for i in fp32.graph.initializer}
    for table in tables:
        np.testing.assert_array_equal(numpy_helper.to_array(table), original[table.name])
    # Weights read only by low nodes are stored as the fp32 weights rounded to half.
    weight = next(i for i in fp16.graph.initializer if i.data_type == FP16 and i.name in original)
    np.testing.assert_array_equal(numpy_helper.to_array(weight), original[weight.name].astype(np.float16))


@pytest.mark.slow
def test_validate_fp16_uses_fp16_graphs_and_tolerance(export_dir):
    report = validate(export_dir, resolutions=[RES], precision="fp16", num_random=2, num_real=4)
    assert bool(report), report.to_json()
    (record,) = report.records
    assert record.precision == "fp16" and record.tolerance["min_cosine"] < 0.99999
    # The plan really rounds: the fp16 graph is measurably less exact than the fp32 one.
    fp32 = validate(export_dir, resolutions=[RES], precision="fp32", num_random=2, num_real=4).records[0]
    assert record.max_abs > fp32.max_abs and record.cosine >= 0.999


def test_bf16_plan_keeps_opset18_conv_fp32():
    proto = apply_precision(onnx.load_from_string(_fp32_bytes("rope-axial")), "bf16")
    check_graph(proto)
    _check_plan(proto, BF16)
    types = _types(proto)
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    assert _float_types(conv, types, conv.output) == {FP32}  # opset 18 Conv has no bfloat16
    weights = [i for i in proto.graph.initializer if i.data_type == BF16]
    assert weights and numpy_helper.to_array(weights[0]).dtype == ml_dtypes.bfloat16


def _fp32_bytes(encoding):
    from deploykit.export import onnx_from_model

    return onnx_from_model(encoding_model(encoding), RES).SerializeToString()


def test_custom_domain_node_stays_fp32():
    # MatMul -> deploykit::SaPE2Bias (a model-local function) -> Softmax, as SaPE² will emit.
    body = [helper.make_node("Add", ["q", "k"], ["y"])]
    fn = helper.make_function("deploykit", "SaPE2Bias", ["q", "k"], ["y"], body, [helper.make_opsetid("", 18)])
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["q"]),
        helper.make_node("SaPE2Bias", ["q", "x"], ["b"], domain="deploykit"),
        helper.make_node("MatMul", ["b", "w"], ["m"]),
        helper.make_node("Softmax", ["m"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", FP32, [2, 4])], [helper.make_tensor_value_info("out", FP32, [2, 4])], [w]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)], functions=[fn])
    planned = apply_precision(model, "fp16")
    check_graph(planned)
    types = _types(planned)
    custom = next(n for n in planned.graph.node if n.domain == "deploykit")
    assert _float_types(custom, types, [*custom.input, *custom.output]) == {FP32}
    first = next(n for n in planned.graph.node if n.op_type == "MatMul")
    assert _float_types(first, types, [*first.input, *first.output]) == {FP16}
    assert planned.functions[0] == fn  # the function body is left to each runtime


def test_unknown_precision_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="fp16"):
        export(encoding_model("ape"), [RES], tmp_path, precisions=["fp4"])
    assert not any(tmp_path.iterdir())


def test_fp32_only_export_has_no_fp16_graphs(tmp_path):
    export(encoding_model("ape"), [RES], tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["graphs"][0]["precision"] == "fp32"
    with pytest.raises(DeployKitError, match="no fp16 graphs exported"):
        validate(tmp_path, precision="fp16")
